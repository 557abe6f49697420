// Writes a model as a TorchScript archive that PyTorch for Python loads with
// torch.jit.load and runs without any Limbo code.
//
//  - A TorchScript model is written as the user's own module (same class,
//    methods and attribute names) holding the trained parameters and buffers.
//  - A built-in model is written as a generated module with the same
//    parameter names as its checkpoint (conv1.weight, ...) and a forward that
//    first normalises its input: it takes images in [0, 1] pixel units
//    [B, C, H, W] (uint8 / 255, what torchvision's ToTensor gives) and applies
//    (x - input_mean) / input_std per channel, as Limbo's loader does.
//
// Tensors are written contiguous (not in Limbo's channels-last flat layout)
// and the module is saved in eval mode. `extra_files` are stored in the
// archive (torch.jit.load(path, _extra_files=...) reads them). The file is
// written atomically. Throws InvalidInput for models that cannot be written.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "models/net.h"

namespace limbo::models {

struct ExportOptions {
  std::string path;
  std::vector<float> input_mean, input_std;  // built-ins: per-channel, [0,1] units
  std::map<std::string, std::string> extra_files;
};

void export_torchscript(Net& net, const ModelOptions& opt, const InputSpec& in,
                        const ExportOptions& ex);

}  // namespace limbo::models
