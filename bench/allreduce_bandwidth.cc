// All-reduce bandwidth: Limbo's gradient all-reduce (comm::Collective, the
// path training uses: a raw Gloo context driven on the calling thread)
// against raw Gloo (gloo::allreduce on one buffer, set up here without any
// Limbo code) for the same bytes, side by side in one run; also Limbo's
// fallback path through c10d's ProcessGroupGloo (bucketed). Two ranks on
// loopback, forked from this process.
//
// Then the training step with the all-reduce overlapped with backward
// (elastic.overlap): per step, interleaved, compute alone (forward,
// backward, SGD; no communication), the step with its buckets reduced after
// backward, and the step with them reduced during backward. The exposed
// communication is what a step takes beyond compute alone.
//
//   build/bench/limbo_bench_allreduce [--reps 20] [--sizes-mb 1,4,16,64]
//                                     [--bucket-mb 8] [--threads 1]
//                                     [--model-width 2048] [--model-depth 3] [--batch 64]
//                                     [--overlap-bucket-mb 4] [--steps 30]
#include "bench_args.h"

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "comm/collective.h"
#include "elastic/allreduce_update.h"
#include "models/net.h"
#include "optim/flat_params.h"
#include "train/step.h"

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

struct OverlapResult {
  double compute = 0, sequential = 0, overlapped = 0;  // median seconds per step
  double waited_sequential = 0, waited_overlapped = 0;  // mean seconds in finish() per step
  int64_t buckets = 0, started_in_backward = 0, steps = 0;
};

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

OverlapResult measure_overlap(int rank, int port, int64_t width, int64_t depth, int64_t batch,
                              int64_t bucket_bytes, int steps) {
  torch::manual_seed(1);
  limbo::models::ModelOptions mo;
  mo.name = "mlp";
  mo.width = width;
  mo.depth = depth;
  auto net = limbo::models::make_mlp(mo, {1, 28, 28, 10});
  limbo::optim::FlatParams flat(*net);
  limbo::train::TrainStep step(*net, flat, limbo::train::LossKind::CrossEntropy, false);
  limbo::optim::OptimizerOptions so;
  so.momentum = 0.9;
  auto sgd = std::make_shared<limbo::train::OptimizerStep>(limbo::optim::make_optimizer(so), 0.0);
  limbo::comm::GroupOptions go;
  go.store_port = port;
  go.prefix = "bench/overlap";
  std::shared_ptr<limbo::comm::Collective> group = limbo::comm::make_gloo_group(go, rank, 2);
  limbo::elastic::ReduceOptions seq_opt, ovl_opt;
  seq_opt.bucket_bytes = ovl_opt.bucket_bytes = bucket_bytes;
  ovl_opt.overlap = true;
  limbo::elastic::AllReduceUpdate seq(group, sgd, flat, seq_opt), ovl(group, sgd, flat, ovl_opt);
  auto x = torch::randn({batch, 1, 28, 28});
  auto y = torch::randint(0, 10, {batch});
  auto run = [&](limbo::elastic::AllReduceUpdate* rule) {
    auto t0 = Clock::now();
    limbo::train::StepContext ctx{flat.data(), flat.grad(), flat.grad_with_slot(), 0.0, batch, 2 * batch,
                                  0.01, 0, {}};
    if (!rule) {
      step.gradient(x, y);
      sgd->apply(flat.data(), flat.grad(), 0.01);
      return seconds(t0);
    }
    ctx.loss = step.gradient(x, y, [&](double loss) {
      ctx.loss = loss;
      rule->backward_starts(ctx);
    });
    rule->apply(ctx);
    return seconds(t0);
  };
  std::vector<double> a, b, c;
  for (int i = -3; i < steps; ++i) {  // 3 warm-up rounds
    double ta = run(nullptr), tb = run(&seq), tc = run(&ovl);
    if (i >= 0) a.push_back(ta), b.push_back(tb), c.push_back(tc);
  }
  OverlapResult r;
  r.compute = median_of(a);
  r.sequential = median_of(b);
  r.overlapped = median_of(c);
  r.waited_sequential = seq.reducer().stats().exposed_seconds / seq.reducer().stats().steps;
  r.waited_overlapped = ovl.reducer().stats().exposed_seconds / ovl.reducer().stats().steps;
  r.buckets = static_cast<int64_t>(ovl.reducer().buckets().size());
  r.started_in_backward = ovl.reducer().stats().buckets_started_in_backward;
  r.steps = ovl.reducer().stats().steps;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const limbo::bench::BenchArgs args(
      argc, argv,
      "[--reps 20] [--sizes-mb 1,4,16,64] [--threads 2] [--bucket-mb 8] [--model-width 2048] "
      "[--model-depth 3] [--batch 64] [--steps 30] [--overlap-bucket-mb 4]",
      {"--reps", "--sizes-mb", "--threads", "--bucket-mb", "--model-width", "--model-depth", "--batch", "--steps",
       "--overlap-bucket-mb"});
  const int reps = static_cast<int>(args.integer("--reps", 20));
  const std::vector<double> sizes_mb = args.numbers("--sizes-mb", {1, 4, 16, 64});
  const int64_t width = args.integer("--model-width", 2048), depth = args.integer("--model-depth", 3),
                batch = args.integer("--batch", 64);
  const int64_t overlap_bucket = static_cast<int64_t>(args.number("--overlap-bucket-mb", 4) * (1 << 20));
  const int steps = static_cast<int>(args.integer("--steps", 30));
  g_bucket_bytes = static_cast<int64_t>(args.number("--bucket-mb", g_bucket_bytes / double(1 << 20)) * (1 << 20));
  g_threads = static_cast<int>(args.integer("--threads", g_threads));
  torch::set_num_threads(1);
  int port = 0;
  auto store = limbo::comm::host_store("127.0.0.1", &port);
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

  // The step with the all-reduce overlapped with backward.
  pid_t child = ::fork();
  if (child == 0) {
    measure_overlap(1, port, width, depth, batch, overlap_bucket, steps);
    ::_exit(0);
  }
  auto o = measure_overlap(0, port, width, depth, batch, overlap_bucket, steps);
  int status = 0;
  ::waitpid(child, &status, 0);
  std::printf("\nMLP 784-%ldx%ld-10, batch %ld per rank, 2 ranks x 1 thread, buckets of %.1f MiB (%ld buckets), "
              "median of %d interleaved steps:\n",
              static_cast<long>(width), static_cast<long>(depth), static_cast<long>(batch),
              overlap_bucket / double(1 << 20), static_cast<long>(o.buckets), steps);
  std::printf("  compute alone (forward, backward, SGD)   %7.1f ms\n", 1e3 * o.compute);
  std::printf("  all-reduce after backward                %7.1f ms   exposed %6.1f ms (waited %5.1f ms)\n",
              1e3 * o.sequential, 1e3 * (o.sequential - o.compute), 1e3 * o.waited_sequential);
  std::printf("  all-reduce overlapped with backward      %7.1f ms   exposed %6.1f ms (waited %5.1f ms)\n",
              1e3 * o.overlapped, 1e3 * (o.overlapped - o.compute), 1e3 * o.waited_overlapped);
  std::printf("  buckets started while backward ran: %ld of %ld\n", static_cast<long>(o.started_in_backward),
              static_cast<long>(o.buckets * o.steps));
  return 0;
}
