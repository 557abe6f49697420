// Evaluation across the members (python/core.h).
#include "core.h"

#include <limits>

namespace limbo::python {

py::tuple Core::eval_share(int64_t n) const {
  const int w = world(), r = rank();
  return py::make_tuple(n * r / w, n * (r + 1) / w);
}

py::object Core::eval_reduce(const std::vector<double>& values, bool ended) {
  const int64_t k = static_cast<int64_t>(values.size());
  auto rows = torch::full({world(), k}, -std::numeric_limits<double>::infinity(), torch::kFloat64);
  for (int64_t j = 0; j < k; ++j) rows[rank()][j] = values[static_cast<size_t>(j)];
  bool done = false;
  {
    py::gil_scoped_release no_gil;
    try {
      if (ended) {
        try {
          rule().agree_max(rows);
          done = true;
        } catch (const Error& e) {
          log_warn(std::string("evaluation after training: ") + e.what() + "; this member evaluates it all");
        }
      } else {
        done = session_->collective("evaluation", [&] { rule().agree_max(rows); });
      }
    } catch (const train::CompletedElsewhere& e) {
      log_warn(std::string(e.what()) + " (in an evaluation); this member ends");
      left_ = true;
    }
  }
  if (!done) return py::none();
  std::vector<double> sums(static_cast<size_t>(k), 0.0);
  auto a = rows.accessor<double, 2>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    for (int64_t j = 0; j < k; ++j) sums[static_cast<size_t>(j)] += a[i][j];
  return py::cast(sums);
}

}  // namespace limbo::python
