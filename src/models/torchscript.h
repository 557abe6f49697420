// A user's TorchScript module as a Limbo model (`model.name = "torchscript"`).
//
// The archive written by torch.jit.save (from torch.jit.script or trace) is
// loaded with torch::jit::load. Its parameters and buffers are registered, as
// the same tensors, in a tree of plain nn::Modules that mirrors the script
// module's submodules, so everything that works on a built-in Net works on it
// unchanged: FlatParams moves the parameters into the flat buffer (the script
// module sees the moved tensors, since set_data changes them in place),
// checkpoints and safetensors export use the usual dotted names, and
// train()/eval() switch both trees.
//
// Contract of the module: forward(x) returns one tensor (class scores
// [B, C, ...] or regression outputs); with model.loss = "module", forward(x, y)
// returns the scalar loss and an optional predict(x) returns [B, C] scores.
// Parameters must be float32 and not shared between submodules (tied weights
// are refused). Throws InvalidInput naming the file on any of these.
#pragma once

#include <string>

#include "models/net.h"

namespace torch::jit {
struct Module;
}

namespace limbo::models {

NetPtr load_torchscript(const std::string& path);

// The script module behind a Net made by load_torchscript; nullptr for others.
torch::jit::Module* script_module(Net& net);

}  // namespace limbo::models
