// Thread settings for compute: libtorch's intra-op (OpenMP) pool and the BLAS
// library's threads.
//
// With OpenBLAS built for OpenMP (Debian's libopenblas0-openmp, which the
// set-up installs) BLAS runs on the same OpenMP pool as libtorch: it follows
// the OpenMP thread count and runs single-threaded when called inside a
// parallel region, so the two never oversubscribe the cores. With the pthread
// build, BLAS keeps its own pool; then blas_threads should be pinned.
#pragma once

#include <string>

namespace limbo::train {

struct ThreadSettings {
  int intra_op = 0;     // 0 = the cores this process may use (usable_cores())
  int blas = 0;         // 0 = share the intra-op pool; n > 0 = pin BLAS to n
};

struct ThreadReport {
  int intra_op = 1;
  int blas = 1;
  std::string blas_library;  // "openblas-openmp", "openblas-pthread", "reference", ...
};

// Applies the settings process-wide (call once, before any compute) and
// reports what is in effect. Logs a warning for the slow reference BLAS.
ThreadReport apply_thread_settings(const ThreadSettings& s);

}  // namespace limbo::train
