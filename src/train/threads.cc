#include "train/threads.h"

#include <dlfcn.h>

#include <thread>

#include <torch/torch.h>

#include "common/log.h"
#include "common/process.h"

namespace limbo::train {
namespace {

// OpenBLAS entry points, looked up at run time: the system libblas.so.3 may be
// OpenBLAS or the reference BLAS, chosen by Debian's alternatives.
template <typename F>
F lookup(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_DEFAULT, name));
}

}  // namespace

ThreadReport apply_thread_settings(const ThreadSettings& s) {
  ThreadReport r;
  const int cores = usable_cores();
  r.intra_op = s.intra_op > 0 ? s.intra_op : cores;

  auto get_parallel = lookup<int (*)()>("openblas_get_parallel");
  auto set_threads = lookup<void (*)(int)>("openblas_set_num_threads");
  auto get_threads = lookup<int (*)()>("openblas_get_num_threads");
  if (get_parallel) {
    int kind = get_parallel();
    r.blas_library = kind == 2 ? "openblas-openmp" : kind == 1 ? "openblas-pthread" : "openblas-serial";
  } else if (lookup<void*>("dgemm_")) {
    r.blas_library = "reference-or-other";
  } else {
    r.blas_library = "none";
  }
  // OpenMP OpenBLAS's setter also sets the OpenMP count, so it goes first and
  // libtorch's setting second.
  int blas = s.blas > 0 ? s.blas : r.intra_op;
  if (set_threads) set_threads(blas);
  at::set_num_threads(r.intra_op);
  r.blas = get_threads ? get_threads() : 1;
  if (r.blas_library == "reference-or-other")
    log_warn("the system BLAS is not OpenBLAS (likely Debian's slow reference libblas3); "
             "install libopenblas0-openmp for fast linear layers");
  return r;
}

}  // namespace limbo::train
