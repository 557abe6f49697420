#include "models/export.h"

#include <torch/script.h>

#include <sstream>

#include "common/error.h"
#include "common/files.h"
#include "models/torchscript.h"

namespace limbo::models {
namespace {

using torch::jit::Module;

torch::Tensor frozen(const torch::Tensor& t) { return t.detach().contiguous().clone(); }

// A script module tree with the parameters and buffers of `src` (cloned,
// contiguous), submodules named as in `src`, one class per path.
Module mirror(torch::nn::Module& src, const std::string& cls,
              const std::shared_ptr<torch::jit::CompilationUnit>& cu) {
  Module m(c10::QualifiedName("__torch__.limbo." + cls), cu, /*shouldMangle=*/true);
  m.register_attribute("training", c10::BoolType::get(), false);
  for (const auto& p : src.named_parameters(false)) m.register_parameter(p.key(), frozen(p.value()), false);
  for (const auto& b : src.named_buffers(false)) m.register_buffer(b.key(), frozen(b.value()));
  for (const auto& c : src.named_children()) m.register_module(c.key(), mirror(*c.value(), cls + "_" + c.key(), cu));
  return m;
}

std::string lin(const std::string& x, const std::string& m) {
  return "torch.linear(" + x + ", self." + m + ".weight, self." + m + ".bias)";
}

std::string mlp_source(const ModelOptions& opt) {
  std::string s = "    h = torch.flatten(x, 1)\n";
  for (int64_t i = 1; i <= opt.depth; ++i)
    s += "    h = torch.relu(" + lin("h", "fc" + std::to_string(i)) + ")\n";
  return s + "    return " + lin("h", "fc" + std::to_string(opt.depth + 1)) + "\n";
}

const char* kLeNet = R"(
    h = torch.max_pool2d(torch.conv2d(x, self.conv1.weight, self.conv1.bias), [2, 2])
    h = torch.max_pool2d(torch.conv2d(h, self.conv2.weight, self.conv2.bias), [2, 2])
    h = torch.relu(torch.linear(torch.flatten(h, 1), self.fc1.weight, self.fc1.bias))
    return torch.linear(h, self.fc2.weight, self.fc2.bias)
)";

const char* kCifarQuick = R"(
    h = torch.conv2d(x, self.conv1.weight, self.conv1.bias, [1, 1], [2, 2])
    h = torch.relu(torch.max_pool2d(h, [3, 3], [2, 2], [0, 0], [1, 1], True))
    h = torch.relu(torch.conv2d(h, self.conv2.weight, self.conv2.bias, [1, 1], [2, 2]))
    h = torch.avg_pool2d(h, [3, 3], [2, 2], [0, 0], True)
    h = torch.relu(torch.conv2d(h, self.conv3.weight, self.conv3.bias, [1, 1], [2, 2]))
    h = torch.avg_pool2d(h, [3, 3], [2, 2], [0, 0], True)
    h = torch.linear(torch.flatten(h, 1), self.ip1.weight, self.ip1.bias)
    return torch.linear(h, self.ip2.weight, self.ip2.bias)
)";

std::string bn(const std::string& x, const std::string& m) {
  return "torch.batch_norm(" + x + ", self." + m + ".weight, self." + m + ".bias, self." + m +
         ".running_mean, self." + m + ".running_var, self.training, 0.1, 1e-05, False)";
}

std::string conv3(const std::string& x, const std::string& m, int64_t stride) {
  const std::string s = std::to_string(stride);
  return "torch.conv2d(" + x + ", self." + m + ".weight, None, [" + s + ", " + s + "], [1, 1])";
}

std::string resnet20_source() {
  std::string s = "    h = torch.relu(" + bn(conv3("x", "conv1", 1), "bn1") + ")\n";
  int64_t channels = 16;
  const int64_t widths[3] = {16, 32, 64};
  for (int st = 0; st < 3; ++st) {
    for (int b = 0; b < 3; ++b) {
      const int64_t stride = (st > 0 && b == 0) ? 2 : 1, pad = widths[st] - channels;
      const std::string m = "layer" + std::to_string(st + 1) + "_" + std::to_string(b);
      s += "    y = torch.relu(" + bn(conv3("h", m + ".conv1", stride), m + ".bn1") + ")\n";
      s += "    y = " + bn(conv3("y", m + ".conv2", 1), m + ".bn2") + "\n";
      if (stride != 1 || pad != 0) {
        s += "    sc = h[:, :, ::" + std::to_string(stride) + ", ::" + std::to_string(stride) + "]\n";
        s += "    sc = torch.constant_pad_nd(sc, [0, 0, 0, 0, " + std::to_string(pad / 2) + ", " +
             std::to_string(pad - pad / 2) + "], 0.0)\n";
        s += "    h = torch.relu(y + sc)\n";
      } else {
        s += "    h = torch.relu(y + h)\n";
      }
      channels = widths[st];
    }
  }
  return s + "    h = torch.mean(h, [2, 3])\n    return " + lin("h", "fc") + "\n";
}

std::string builtin_body(const ModelOptions& opt) {
  if (opt.name == "mlp") return mlp_source(opt);
  if (opt.name == "lenet") return kLeNet;
  if (opt.name == "cifar-quick") return kCifarQuick;
  if (opt.name == "resnet20") return resnet20_source();
  throw InvalidInput("model '" + opt.name + "' cannot be exported to TorchScript");
}

void save_atomic(const Module& m, const ExportOptions& ex) {
  std::ostringstream out;
  torch::jit::ExtraFilesMap extra(ex.extra_files.begin(), ex.extra_files.end());
  m.save(out, extra);
  write_file_atomic(ex.path, out.str());
}

}  // namespace

void export_torchscript(Net& net, const ModelOptions& opt, const InputSpec& in,
                        const ExportOptions& ex) {
  torch::NoGradGuard no_grad;
  if (Module* user = script_module(net)) {
    // An independent copy through serialisation: deepcopy() memoises tensors
    // by storage and would hand every view of the flat buffer the same copy.
    std::stringstream buf;
    user->save(buf);
    Module copy = torch::jit::load(buf);
    for (auto sub : copy.modules()) {
      // Collect first: setting attributes while iterating the slot list
      // pairs names with the wrong values.
      std::vector<std::pair<std::string, torch::Tensor>> tensors;
      // Parameters keep the user's requires_grad (a frozen backbone stays frozen).
      for (const auto& p : sub.named_parameters(false))
        tensors.emplace_back(p.name, frozen(p.value).requires_grad_(p.value.requires_grad()));
      for (const auto& b : sub.named_buffers(false)) tensors.emplace_back(b.name, frozen(b.value));
      for (auto& [name, t] : tensors) sub.setattr(name, t);
    }
    copy.eval();
    save_atomic(copy, ex);
    return;
  }
  auto cu = std::make_shared<torch::jit::CompilationUnit>();
  std::string cls = opt.name == "cifar-quick" ? "CifarQuick" : opt.name;
  Module m = mirror(net, cls, cu);
  std::vector<float> mean = ex.input_mean, stdv = ex.input_std;
  if (mean.empty()) mean.assign(in.channels, 0.0f);
  if (stdv.empty()) stdv.assign(in.channels, 1.0f);
  const auto c = static_cast<int64_t>(mean.size());
  m.register_buffer("input_mean", torch::tensor(mean).view({1, c, 1, 1}));
  m.register_buffer("input_std", torch::tensor(stdv).view({1, c, 1, 1}));
  m.define("def forward(self, x: Tensor) -> Tensor:\n"
           "    x = (x - self.input_mean) / self.input_std\n" +
           builtin_body(opt));
  m.eval();
  save_atomic(m, ex);
}

}  // namespace limbo::models
