// All-reduce bandwidth: Limbo's gradient all-reduce (comm::Collective, the
// path training uses: a raw Gloo context driven on the calling thread)
// against raw Gloo (gloo::allreduce on one buffer, set up here without any
// Limbo code) for the same bytes, side by side in one run; also Limbo's
// fallback path through c10d's ProcessGroupGloo (bucketed). Two ranks on
// loopback, forked from this process.
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

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "comm/collective.h"

namespace {

using Clock = std::chrono::steady_clock;
int64_t g_bucket_bytes = limbo::comm::GroupOptions{}.bucket_bytes;
int g_threads = limbo::comm::GroupOptions{}.worker_threads;

double seconds(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The three implementations under test, connected once per size; both ranks
// then run the same interleaved sequence (raw, limbo, c10d, raw, ...) so that
// machine noise hits all three alike. Rank 0 reports.
struct Contenders {
  std::shared_ptr<gloo::rendezvous::Context> raw;
  std::unique_ptr<limbo::comm::Collective> limbo, c10d;
};

Contenders connect(int rank, int port, const std::string& dir, int64_t floats) {
  Contenders c;
  gloo::transport::tcp::attr attr("127.0.0.1");
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  c.raw = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  c.raw->connectFullMesh(store, dev);
  limbo::comm::GroupOptions go;
  go.store_port = port;
  go.bucket_bytes = g_bucket_bytes;
  go.worker_threads = g_threads;
  go.prefix = "bench/" + std::to_string(floats) + "/direct";
  c.limbo = limbo::comm::make_gloo_group(go, rank, 2);
  go.direct_allreduce = false;
  go.prefix = "bench/" + std::to_string(floats) + "/c10d";
  c.c10d = limbo::comm::make_gloo_group(go, rank, 2);
  return c;
}

// Mean seconds per call for each contender: {raw, limbo, c10d}.
std::array<double, 3> measure(Contenders& c, int64_t floats, int reps) {
  std::vector<float> raw_buf(floats, 1.0f);
  auto t = torch::ones({floats});
  auto raw = [&] {
    gloo::AllreduceOptions o(c.raw);
    o.setOutput(raw_buf.data(), raw_buf.size());
    o.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(
        &gloo::sum<float>));
    gloo::allreduce(o);
  };
  std::array<double, 3> total{0, 0, 0};
  for (int i = -1; i < reps; ++i) {  // i = -1: warm-up
    auto t0 = Clock::now();
    raw();
    double a = seconds(t0);
    t0 = Clock::now();
    c.limbo->allreduce_sum(t);
    double b = seconds(t0);
    t0 = Clock::now();
    c.c10d->allreduce_sum(t);
    double d = seconds(t0);
    if (i >= 0) total[0] += a, total[1] += b, total[2] += d;
  }
  for (auto& x : total) x /= reps;
  return total;
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
  std::printf("%10s %14s %14s %8s %18s\n", "size", "raw gloo GB/s", "limbo GB/s", "ratio",
              "via c10d PG GB/s");
  for (double mb : sizes_mb) {
    const int64_t floats = static_cast<int64_t>(mb * (1 << 20) / 4);
    std::string sub = dir + "/" + std::to_string(floats);
    ::mkdir(sub.c_str(), 0755);
    pid_t child = ::fork();
    if (child == 0) {
      auto c = connect(1, port, sub, floats);
      measure(c, floats, reps);
      ::_exit(0);
    }
    auto c = connect(0, port, sub, floats);
    auto m = measure(c, floats, reps);
    const double t_gloo = m[0], t_limbo = m[1], t_c10d = m[2];
    int status = 0;
    ::waitpid(child, &status, 0);
    double bytes = static_cast<double>(floats) * 4;
    std::printf("%8.0fMB %14.2f %14.2f %7.2fx %18.2f\n", mb, bytes / t_gloo / 1e9,
                bytes / t_limbo / 1e9, t_gloo / t_limbo, bytes / t_c10d / 1e9);
    std::fflush(stdout);
  }
  std::system(("rm -rf " + dir).c_str());
  return 0;
}
