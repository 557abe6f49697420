// All-reduce bandwidth: Limbo's gradient all-reduce (comm::Collective, the
// path training uses: c10d ProcessGroupGloo, bucketed) against raw Gloo
// (gloo::allreduce on one buffer, no c10d) for the same bytes, side by side
// in one run. Two ranks on loopback, forked from this process.
//
//   build/bench/limbo_bench_allreduce [--reps 20] [--sizes-mb 1,4,16,64]
//                                     [--bucket-mb 8] [--threads 1]
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "comm/collective.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Both ranks run the same sequence; rank 0 reports (time of the slowest rank
// is what a step waits for, and rank 0 finishes last in a ring all the same).
int64_t g_bucket_bytes = limbo::comm::GroupOptions{}.bucket_bytes;
int g_threads = limbo::comm::GroupOptions{}.worker_threads;

double time_limbo(int rank, int port, int64_t floats, int reps) {
  limbo::comm::GroupOptions go;
  go.bucket_bytes = g_bucket_bytes;
  go.worker_threads = g_threads;
  go.store_port = port;
  go.prefix = "bench/" + std::to_string(floats);
  auto group = limbo::comm::make_gloo_group(go, rank, 2);
  auto t = torch::ones({floats});
  group->allreduce_sum(t);  // warm-up (connections, buffers)
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) group->allreduce_sum(t);
  return seconds(t0) / reps;
}

double time_gloo(int rank, const std::string& dir, int64_t floats, int reps) {
  gloo::transport::tcp::attr attr("127.0.0.1");
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  ctx->connectFullMesh(store, dev);
  std::vector<float> buf(floats, 1.0f);
  auto run = [&] {
    gloo::AllreduceOptions opts(ctx);
    opts.setOutput(buf.data(), buf.size());
    opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
        &gloo::sum<float>));
    gloo::allreduce(opts);
  };
  run();
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) run();
  return seconds(t0) / reps;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  std::vector<double> sizes_mb = {1, 4, 16, 64};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--reps") reps = std::atoi(argv[i + 1]);
    if (a == "--bucket-mb") g_bucket_bytes = static_cast<int64_t>(std::stod(argv[i + 1]) * (1 << 20));
    if (a == "--threads") g_threads = std::atoi(argv[i + 1]);
    if (a == "--sizes-mb") {
      sizes_mb.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string s; std::getline(ss, s, ',');) sizes_mb.push_back(std::stod(s));
    }
  }
  torch::set_num_threads(1);
  int port = 0;
  auto store = limbo::comm::host_store("127.0.0.1", &port, std::chrono::seconds(60));
  char tmpl[] = "/tmp/limbo-gloo-bench-XXXXXX";
  std::string dir = ::mkdtemp(tmpl);
  std::printf("2 ranks on loopback, %d repetitions; algorithm bandwidth = bytes / time\n", reps);
  std::printf("%10s %14s %14s %8s\n", "size", "raw gloo GB/s", "limbo GB/s", "ratio");
  for (double mb : sizes_mb) {
    const int64_t floats = static_cast<int64_t>(mb * (1 << 20) / 4);
    double t_gloo = 0, t_limbo = 0;
    std::string sub = dir + "/" + std::to_string(floats);
    ::mkdir(sub.c_str(), 0755);
    pid_t child = ::fork();
    if (child == 0) {
      time_gloo(1, sub, floats, reps);
      time_limbo(1, port, floats, reps);
      ::_exit(0);
    }
    t_gloo = time_gloo(0, sub, floats, reps);
    t_limbo = time_limbo(0, port, floats, reps);
    int status = 0;
    ::waitpid(child, &status, 0);
    double bytes = static_cast<double>(floats) * 4;
    std::printf("%8.0fMB %14.2f %14.2f %7.2fx\n", mb, bytes / t_gloo / 1e9, bytes / t_limbo / 1e9,
                t_gloo / t_limbo);
    std::fflush(stdout);
  }
  std::system(("rm -rf " + dir).c_str());
  return 0;
}
