// The user's nn.Module as Limbo sees it, and changes made to it (python/core.h).
#include "core.h"

namespace limbo::python {

std::shared_ptr<torch::nn::Module> module_tree(const Named& params, const Named& buffers) {
  auto root = std::make_shared<torch::nn::Module>("Model");
  auto place = [&](const std::string& name) -> std::pair<torch::nn::Module*, std::string> {
    torch::nn::Module* m = root.get();
    size_t at = 0;
    for (size_t dot; (dot = name.find('.', at)) != std::string::npos; at = dot + 1) {
      const std::string part = name.substr(at, dot - at);
      if (part.empty()) throw InvalidInput("the model names a tensor '" + name + "' with an empty part");
      auto children = m->named_children();
      if (auto* c = children.find(part)) {
        m = c->get();
      } else {
        m = m->register_module(part, std::make_shared<torch::nn::Module>(part)).get();
      }
    }
    return {m, name.substr(at)};
  };
  for (const auto& [name, t] : params) {
    auto [m, leaf] = place(name);
    m->register_parameter(leaf, t, t.requires_grad());
  }
  for (const auto& [name, t] : buffers) {
    auto [m, leaf] = place(name);
    m->register_buffer(leaf, t);
  }
  return root;
}

void Core::check_model() const {
  const auto& ps = flat_->parameters();
  const auto& es = flat_->entries();
  const float* base = flat_->data().data_ptr<float>();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (ps[i].defined() && ps[i].scalar_type() != torch::kFloat32)
      throw InvalidInput("parameter '" + es[i].name + "' became " + std::string(c10::toString(ps[i].scalar_type())) +
                         " after limbo.Job took the model (model.half() or .to(dtype)?); Limbo trains float32 "
                         "parameters: keep the model in float32 and compute in bf16 under torch.autocast");
    if (!ps[i].defined() || ps[i].sizes().vec() != es[i].shape || ps[i].data_ptr<float>() != base + es[i].offset)
      throw InvalidInput("parameter '" + es[i].name + "' changed after limbo.Job took the model (its data was "
                         "replaced or resized); build the model completely before creating the job");
  }
}

}  // namespace limbo::python

namespace limbo::python {

// Unit 0 ("") holds every parameter of no other unit; a parameter belongs
// to the unit with the longest name that prefixes its own ("blocks.1" holds
// "blocks.1.mlp.0.weight"). A unit's parameters need not be contiguous in
// the flat order: it has a range for each run of them.
void Core::plan_units(const std::vector<std::string>& names) {
  unit_names_ = {""};
  for (const auto& n : names) {
    if (n.empty()) throw InvalidInput("a unit's name is empty: name a submodule of the model (\"blocks.0\")");
    if (std::find(unit_names_.begin(), unit_names_.end(), n) != unit_names_.end())
      throw InvalidInput("unit '" + n + "' is named twice");
    unit_names_.push_back(n);
  }
  const auto& es = flat_->entries();
  std::vector<int> unit_of(es.size(), 0);
  std::vector<int64_t> held(unit_names_.size(), 0);
  for (size_t i = 0; i < es.size(); ++i) {
    size_t best = 0;
    for (size_t u = 1; u < unit_names_.size(); ++u) {
      const std::string& p = unit_names_[u];
      if (es[i].name.size() > p.size() && es[i].name.compare(0, p.size(), p) == 0 && es[i].name[p.size()] == '.' &&
          p.size() > unit_names_[best].size())
        best = u;
    }
    unit_of[i] = static_cast<int>(best);
    held[best] += es[i].numel;
  }
  for (size_t u = 1; u < unit_names_.size(); ++u)
    if (held[u] == 0)
      throw InvalidInput("unit '" + unit_names_[u] + "' holds no trainable parameter of the model (units name "
                         "submodules: model.get_submodule(name))");
  unit_ranges_.assign(unit_names_.size(), {});
  unit_starts_.clear();
  for (size_t i = 0; i < es.size(); ++i) {
    const int u = unit_of[i];
    auto& r = unit_ranges_[static_cast<size_t>(u)];
    const bool continues = i > 0 && unit_of[i - 1] == u;
    if (!continues) unit_starts_.push_back(static_cast<int>(i));
    if (continues && !r.empty() && r.back().second == es[i].offset)
      r.back().second = es[i].offset + es[i].numel;
    else
      r.push_back({es[i].offset, es[i].offset + es[i].numel});
  }
  unit_gathered_.assign(unit_names_.size(), 0);
  unit_ticket_.assign(unit_names_.size(), -1);
}

py::list Core::units() const {
  py::list out;
  for (size_t u = 0; u < unit_names_.size(); ++u) {
    py::list ranges;
    for (const auto& [a, b] : unit_ranges_[u]) ranges.append(py::make_tuple(a, b));
    out.append(py::make_tuple(unit_names_[u], ranges));
  }
  return out;
}

void Core::issue_unit(int u) {
  const auto& ranges = unit_ranges_[static_cast<size_t>(u)];
  int64_t ticket = -1;
  for (const auto& [a, b] : ranges) ticket = std::max(ticket, full_->issue_gather(a, b));
  unit_ticket_[static_cast<size_t>(u)] = ticket;
  unit_gathered_[static_cast<size_t>(u)] = 1;
}

void Core::wait_unit(int u) {
  if (unit_gathered_[static_cast<size_t>(u)] != 1) return;
  full_->wait_gather(unit_ticket_[static_cast<size_t>(u)]);
  unit_gathered_[static_cast<size_t>(u)] = 2;
}

void Core::gather_unit(int u, bool forward) {
  if (!full_ || u < 0 || static_cast<size_t>(u) >= unit_gathered_.size()) return;
  py::gil_scoped_release no_gil;
  const bool held = unit_gathered_[static_cast<size_t>(u)] == 2;
  if (unit_gathered_[static_cast<size_t>(u)] == 0) issue_unit(u);
  // The next unit's gather, handed over before this one is waited for.
  int next = -1;
  if (forward && !held) {
    unit_order_.push_back(u);
    const size_t i = unit_order_.size() - 1;
    if (i + 1 < last_unit_order_.size() && last_unit_order_[i] == u) next = last_unit_order_[i + 1];
  } else if (!forward) {  // held too: the last unit of forward stays for backward
    const auto it = std::find(unit_order_.rbegin(), unit_order_.rend(), u);
    if (it != unit_order_.rend() && std::next(it) != unit_order_.rend()) next = *std::next(it);
  }
  if (next >= 0 && unit_gathered_[static_cast<size_t>(next)] == 0) issue_unit(next);
  wait_unit(u);
}

void Core::release_unit(int u) {
  if (!full_ || u < 0 || static_cast<size_t>(u) >= unit_gathered_.size() || !unit_gathered_[u]) return;
  // The last unit of forward (as the last step's forward went: the same on
  // every member) is the first of backward: kept, not gathered again.
  if (!last_unit_order_.empty() && last_unit_order_.back() == u && unit_order_.size() == last_unit_order_.size())
    return;
  py::gil_scoped_release no_gil;
  wait_unit(u);  // a gather handed over writes there still
  for (const auto& [a, b] : unit_ranges_[static_cast<size_t>(u)]) full_->release_weights(a, b);
  unit_gathered_[static_cast<size_t>(u)] = 0;
}

void Core::units_between_steps() {
  py::gil_scoped_release no_gil;
  // A unit gathered ahead that the step did not use: given back.
  for (size_t u = 0; u < unit_gathered_.size(); ++u) {
    if (unit_gathered_[u] == 0) continue;
    wait_unit(static_cast<int>(u));
    for (const auto& [a, b] : unit_ranges_[u]) full_->release_weights(a, b);
    unit_gathered_[u] = 0;
  }
  full_->ready_weights(state_.step);
  if (!unit_order_.empty()) last_unit_order_ = unit_order_;
  unit_order_.clear();
}

}  // namespace limbo::python
