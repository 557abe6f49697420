// Precompiled for every libtorch-using target (see limbo_pch in CMakeLists).
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
