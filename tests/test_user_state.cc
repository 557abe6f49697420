// What a user's module holds besides trainable weights, and steps that go
// wrong, in every mode, with the real `limbo` binary:
//   - frozen parameters (a pre-trained backbone) are exported unchanged;
//   - buffers of every dtype end the same on every data-parallel member;
//   - ISGD's extra passes leave BatchNorm statistics as the step left them;
//   - a BatchNorm model trained through the parameter server evaluates like
//     one trained in a single process (the shards hold its buffers);
//   - steps whose gradient is not finite are skipped by every member and
//     counted, and too many in a row stop the run as diverged;
//   - a data set in 16 shards trains exactly as the same data in one file.
// The modules and data sets come from tests/python/make_fixtures.py; the
// state of a module file is read by tests/python/module_state.py.
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <sstream>

#include "user_fixtures.h"

namespace {

// Parameters and buffers of a TorchScript file: name -> {dtype,
// requires_grad, sum, hash, values (at most 16)}.
json module_state(const std::string& file) {
  const std::string log = file + ".state.log";
  pid_t pid = limbo::testing::spawn_process(
      {kPython, std::string(LIMBO_SOURCE_DIR) + "/tests/python/module_state.py", file}, log);
  auto r = limbo::testing::wait_child(pid, log);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto at = r.output.find('{');
  return at == std::string::npos ? json::object() : json::parse(r.output.substr(at));
}

// The module a run's checkpoint holds, exported as TorchScript.
json exported_state(const std::string& run) {
  auto ex = run_limbo({"export", "--checkpoint", run + "/checkpoint.pt", "--out", run + "/exported.pt"});
  EXPECT_EQ(ex.exit_code, 0) << ex.output;
  return module_state(run + "/exported.pt");
}

double first_value(const json& state, const std::string& buffer) {
  return state["buffers"][buffer]["values"][0].get<double>();
}

// A job alone ("single") or on two elastic data-parallel workers.
limbo::testing::ProcessResult run_in_mode(const std::string& mode, const std::string& run,
                                          const std::vector<std::string>& job) {
  return run_limbo(mode == "single" ? cat({"train", "--run-dir", run}, job)
                                    : cat({"launch", "--nproc", "2", "--min-workers", "1", "--", "--run-dir", run}, job));
}

json last_train_record(const std::string& run) {
  json last;
  std::istringstream in(slurp(run + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    auto r = json::parse(line, nullptr, false);
    if (r.is_object() && r.value("kind", "") == "train") last = r;
  }
  return last;
}

}  // namespace

// conv1 and bn1 of the module were frozen in PyTorch before saving: after
// training in each mode they are exported bit for bit as they were (and
// still frozen), while every other parameter trained.
TEST(UserState, AFrozenBackboneIsExportedUnchangedInEveryMode) {
  NEED_FIXTURES();
  TempDir d;
  const json original = module_state(fx("frozen_backbone.pt"));
  ASSERT_TRUE(original.contains("parameters"));
  const auto job = user_job(fx, "frozen_backbone.pt", "fmnist_npy", {"train.epochs=1", "train.threads=1"});
  const std::map<std::string, std::vector<std::string>> modes = {
      {"single", cat({"train", "--run-dir", d.file("single")}, job)},
      {"data-parallel", cat({"launch", "--nproc", "2", "--min-workers", "1", "--", "--run-dir", d.file("data-parallel")}, job)},
      {"parameter-server", cat({"launch", "--mode", "async", "--servers", "2", "--workers", "2", "--run-dir",
                                d.file("parameter-server"), "--"},
                               cat(job, {"--set", "ps.request_timeout=30"}))}};  // under a loaded suite
  for (const auto& [mode, args] : modes) {
    SCOPED_TRACE(mode);
    auto r = run_limbo(args);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const json got = exported_state(d.file(mode));
    int frozen = 0;
    for (const auto& [name, p] : original["parameters"].items()) {
      const json& q = got["parameters"][name];
      EXPECT_EQ(q["requires_grad"], p["requires_grad"]) << name;
      if (!p["requires_grad"].get<bool>()) {
        ++frozen;
        EXPECT_EQ(q["hash"], p["hash"]) << name << " was trained";
      } else {
        EXPECT_NE(q["hash"], p["hash"]) << name << " did not train";
      }
    }
    EXPECT_EQ(frozen, 4);  // conv1.weight, conv1.bias, bn1.weight, bn1.bias
  }
  auto s = summary(d.file("single"));
  // conv1 (12*1*3*3 + 12) and bn1 (12 + 12) hold 144 of the parameters.
  EXPECT_EQ(s["parameters"].get<int64_t>() - s["trainable_parameters"].get<int64_t>(), 144) << s.dump();
}

// A BatchNorm with a cumulative average (momentum=None: its int64
// num_batches_tracked sets the weights) and float64, float16, int32 and bool
// buffers. The second worker joins half way through the first epoch (state
// sync), and both data-parallel members end with the same values of every
// buffer; the counters count each step once.
TEST(UserState, DataParallelMembersEndWithTheSameBuffersOfEveryDtype) {
  NEED_FIXTURES();
  TempDir d;
  const std::string run = d.file("run");
  auto r = run_limbo(cat({"launch", "--nproc", "2", "--min-workers", "1", "--elastic-schedule", "0:1,0.5:2", "--",
                          "--run-dir", run},
                         user_job(fx, "buffers.pt", "fmnist_npy",
                                  {"train.epochs=2", "train.threads=1", "train.sample_log=true",
                                   // Paced while alone (30 ms a step: 8 s for the
                                   // 281 steps after the schedule starts the joiner),
                                   // so the job cannot end before the joiner got in.
                                   "train.slow_step_ms=30", "train.testing_pace_until_workers=2"})));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(summary(run)["workers"], 2);
  expect_members_agree(run, 2);
  const int64_t steps = summary(run)["steps"];
  const json state = exported_state(run);
  EXPECT_EQ(first_value(state, "bn.num_batches_tracked"), steps);
  EXPECT_EQ(first_value(state, "calls"), steps);
  EXPECT_EQ(state["buffers"]["seen"]["dtype"], "float64");
  EXPECT_EQ(state["buffers"]["mean16"]["dtype"], "float16");
  EXPECT_GT(state["buffers"]["mean16"]["sum"].get<double>(), 0);
}

// A user's TorchScript CNN with BatchNorm, fully sharded
// (optim.shard_weights): two members end with the replicated run's
// parameters and buffers bit for bit; and with a joiner (the job paced
// while alone), every member ends with the same weights and buffers.
TEST(UserState, AFullyShardedTorchScriptModuleTrainsAsTheReplicatedOneAndTakesAJoiner) {
  NEED_FIXTURES();
  TempDir d;
  const std::vector<std::string> common = {"train.epochs=1", "train.threads=1", "optim.algorithm=\"adamw\"",
                                           "optim.lr=0.002", "data.train_limit=2000", "data.test_limit=200"};
  auto full = common;
  full.insert(full.end(), {"optim.shard_state=true", "optim.shard_weights=true"});
  ASSERT_EQ(run_in_mode("data-parallel", d.file("rep"), user_job(fx, "cnn_bn.pt", "fmnist_npy", common)).exit_code, 0);
  auto r = run_in_mode("data-parallel", d.file("full"), user_job(fx, "cnn_bn.pt", "fmnist_npy", full));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json a = exported_state(d.file("rep")), b = exported_state(d.file("full"));
  ASSERT_FALSE(a["parameters"].empty());
  for (const char* kind : {"parameters", "buffers"})
    for (const auto& [name, t] : a[kind].items()) EXPECT_EQ(t["hash"], b[kind][name]["hash"]) << kind << " " << name;
  EXPECT_EQ(summary(d.file("rep"))["test_accuracy"], summary(d.file("full"))["test_accuracy"]);

  const std::string run = d.file("join");
  auto paced = full;
  // Paced while alone (150 ms a step: 8 s for the 56 steps after the
  // schedule starts the joiner), so the job cannot end before the joiner
  // got in, however busy the machine (30 ms from half the epoch, 1 s, was
  // missed once beside three other tests).
  paced.insert(paced.end(), {"train.sample_log=true", "train.slow_step_ms=150", "train.testing_pace_until_workers=2"});
  r = run_limbo(cat({"launch", "--nproc", "2", "--min-workers", "1", "--elastic-schedule", "0:1,0.1:2", "--",
                     "--run-dir", run}, user_job(fx, "cnn_bn.pt", "fmnist_npy", paced)));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(summary(run)["workers"], 2);
  expect_members_agree(run, 2);
}

// ISGD's extra passes over an under-trained batch run forward in train mode
// but are not new data: BatchNorm's statistics and the module's counters end
// as the step itself left them, alone and on two members.
TEST(UserState, IsgdExtraPassesLeaveBatchNormStatisticsAsTheStepLeftThem) {
  NEED_FIXTURES();
  TempDir d;
  const auto job = user_job(fx, "buffers.pt", "fmnist_npy",
                            {"train.epochs=1", "train.threads=1", "train.sample_log=true",
                             "optim.algorithm=isgd", "isgd.k=0", "isgd.window=8"});
  for (const std::string mode : {"single", "data-parallel"}) {
    SCOPED_TRACE(mode);
    const std::string run = d.file(mode);
    auto r = run_in_mode(mode, run, job);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto s = summary(run);
    EXPECT_GT(s["isgd_extra_iterations"].get<int64_t>(), 0) << s.dump();
    const json state = exported_state(run);
    EXPECT_EQ(first_value(state, "bn.num_batches_tracked"), s["steps"].get<int64_t>());
    EXPECT_EQ(first_value(state, "calls"), s["steps"].get<int64_t>());
    if (mode == "data-parallel") expect_members_agree(run, 2);
  }
}

// Through the parameter server (hardsync, 2 learners x 32), the shards hold
// the BatchNorm statistics: learners send theirs with their gradients and
// take the shard's with the weights, so the final checkpoint evaluates like
// a single process trained on the same budget (1 x 64).
TEST(UserState, ABatchNormModelThroughTheParameterServerEvaluatesLikeASingleProcess) {
  NEED_FIXTURES();
  TempDir d;
  auto single = run_limbo(cat({"train", "--run-dir", d.file("one")},
                              user_job(fx, "cnn_bn.pt", "fmnist_npy",
                                       {"train.epochs=2", "data.batch_size=64", "train.threads=1"})));
  ASSERT_EQ(single.exit_code, 0) << single.output;
  auto ps = run_limbo(cat({"launch", "--mode", "async", "--servers", "2", "--workers", "2", "--protocol",
                           "hardsync", "--run-dir", d.file("ps"), "--"},
                          user_job(fx, "cnn_bn.pt", "fmnist_npy",
                                   {"train.epochs=2", "data.batch_size=32", "train.threads=1",
                                    "ps.request_timeout=30"})));  // under a loaded suite
  ASSERT_EQ(ps.exit_code, 0) << ps.output;
  auto ev = run_limbo({"eval", "--checkpoint", d.file("ps/checkpoint.pt")});
  ASSERT_EQ(ev.exit_code, 0) << ev.output;
  const double a1 = summary(d.file("one"))["test_accuracy"];
  const double a2 = json::parse(ev.output.substr(ev.output.find('{')))["test_accuracy"];
  // Alone the parameter-server run lands at 0.815-0.828 against 0.831; in
  // loaded suites it landed at 0.794 and 0.792 (against 0.843). The same
  // checkpoint with its BatchNorm statistics reset to their initial values
  // evaluates at 0.33, so a margin of 0.10 still tells the two apart.
  EXPECT_GT(a2, 0.70);
  EXPECT_NEAR(a1, a2, 0.10) << "single " << a1 << ", parameter server " << a2;
}

// Found: under DiLoCo an inner step whose gradient is not finite was
// skipped, but the NaN its forward put in BatchNorm's running statistics
// stayed, was averaged into every member at the outer step, and the model
// evaluated at chance (0.107). Now the skipped inner step leaves the
// buffers as before it (as a skipped step does in step mode).
TEST(UserState, ANonFiniteInnerStepOfDilocoLeavesTheBatchNormStatisticsAsBeforeIt) {
  NEED_FIXTURES();
  TempDir d;
  const std::string run = d.file("diloco");
  auto r = run_in_mode("data-parallel", run,
                       user_job(fx, "cnn_bn.pt", "fmnist_nan_npy",
                                {"train.epochs=1", "train.threads=1", "train.sample_log=true",
                                 "elastic.sync=\"diloco\"", "diloco.inner_steps=5", "optim.lr=0.01"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto s = summary(run);
  EXPECT_GE(s["inner_steps_skipped"].get<int64_t>(), 1) << s.dump();
  EXPECT_GT(s["test_accuracy"].get<double>(), 0.5) << s.dump();  // 0.73-0.76; 0.107 with NaN statistics
  expect_members_agree(run, 2);
  const json state = exported_state(run);
  for (const auto& [name, b] : state["buffers"].items())
    EXPECT_TRUE(std::isfinite(b["sum"].get<double>())) << name;
}

// DiLoCo with 8- and 4-bit pseudo-gradients on a model with blocks that
// stop moving (a 7,840-value weight whose gradient is exactly zero after 40
// inner steps): their error-feedback residual shrinks by at least 14x an
// outer step, and once a block's largest value fell below what a scale can
// divide (about 1e-36) the quantizer made NaN; the int8 run stopped as
// diverged at outer step 32 (seen with the fix taken out). Both now train
// to the end, every outer step applied, and the block keeps what it learnt.
TEST(UserState, DilocoWithIntegerPseudoGradientsTrainsOnWhenABlockStopsMoving) {
  NEED_FIXTURES();
  TempDir d;
  for (const std::string wire : {"int8", "int4"}) {
    SCOPED_TRACE(wire);
    const std::string run = d.file(wire);
    auto r = run_in_mode("data-parallel", run,
                         user_job(fx, "stops_moving.pt", "fmnist_npy",
                                  {"train.epochs=4", "train.threads=1", "train.sample_log=true",
                                   "elastic.sync=\"diloco\"", "diloco.inner_steps=5", "optim.lr=0.01",
                                   "optim.momentum=0", "diloco.max_wait=0", "elastic.shares=\"equal\"",
                                   "comm.compression=\"" + wire + "\""}));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto s = summary(run);
    // 6000 samples in outer steps of 2 x 5 x 32 = 320: 19 an epoch, the
    // block still after the 5th.
    EXPECT_EQ(s["outer_steps"].get<int64_t>(), 76) << s.dump();
    EXPECT_EQ(s["skipped_steps"].get<int64_t>(), 0) << s.dump();
    EXPECT_GT(s["test_accuracy"].get<double>(), 0.6) << s.dump();  // 0.774 with int8 and int4
    expect_members_agree(run, 2);
    const json state = exported_state(run);
    EXPECT_NE(state["parameters"]["late"]["sum"].get<double>(), 0.0) << state["parameters"].dump();
  }
}

// Three training samples are NaN. The batches that hold them give gradients
// that are not finite: alone and on two members, those steps are skipped
// (on both members alike: the same final weights and buffers), counted in
// the records and the summary, and the run trains on.
TEST(UserState, NonFiniteGradientsAreSkippedTogetherAndCounted) {
  NEED_FIXTURES();
  TempDir d;
  const auto job = user_job(fx, "cnn_bn.pt", "fmnist_nan_npy",
                            {"train.epochs=1", "train.threads=1", "train.sample_log=true", "train.log_every=5"});
  for (const std::string mode : {"single", "data-parallel"}) {
    SCOPED_TRACE(mode);
    const std::string run = d.file(mode);
    auto r = run_in_mode(mode, run, job);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto s = summary(run);
    const int64_t skipped = s["skipped_steps"];
    EXPECT_GE(skipped, 1) << s.dump();
    EXPECT_LE(skipped, 3) << s.dump();
    EXPECT_EQ(last_train_record(run)["skipped_steps"], skipped);
    EXPECT_GT(s["test_accuracy"].get<double>(), 0.6) << s.dump();
    EXPECT_NE(r.output.find("not finite"), std::string::npos) << r.output;
    if (mode == "data-parallel") expect_members_agree(run, 2);
  }
}

// A learning rate that blows the weights up: every step from some point on
// has a loss that is not finite. After train.max_nonfinite_steps (3 here)
// in a row the run stops as diverged with exit code 2, and a launcher does
// not restart its workers for it.
TEST(UserState, RepeatedNonFiniteStepsStopTheRunAsDiverged) {
  NEED_FIXTURES();
  TempDir d;
  const auto job = user_job(fx, "regress.pt", "regress_npy",
                            {"model.loss=mse", "optim.lr=100", "train.epochs=5", "train.threads=1",
                             "train.max_nonfinite_steps=3"});
  for (const std::string mode : {"single", "data-parallel"}) {
    SCOPED_TRACE(mode);
    const std::string run = d.file(mode);
    auto r = run_in_mode(mode, run, job);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("3 steps in a row"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("diverged"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("restart"), std::string::npos) << r.output;
  }
}

namespace {

// Every "step epoch id id ..." line the members of a run logged
// (train.sample_log), de-duplicated by step, in step order.
std::map<int64_t, std::string> sample_lines(const std::string& run) {
  std::map<int64_t, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(run)) {
    if (e.path().filename().string().rfind("samples-", 0) != 0) continue;
    std::istringstream in(slurp(e.path()));
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) out[std::stoll(line)] = line;
  }
  return out;
}

}  // namespace

// Fashion-MNIST's training split in 16 safetensors shards of uneven sizes
// (and as numpy pairs), trained by 2 data-parallel workers: every sample
// once per epoch, and with the same seed the very run the single-file data
// gives (the same batches, the same final weights and buffers).
TEST(UserState, SixteenShardsTrainExactlyAsOneFileAcrossTwoWorkers) {
  NEED_FIXTURES();
  TempDir d;
  std::map<std::string, std::map<int64_t, std::string>> lines;
  std::map<std::string, std::string> finals;
  for (const std::string data : {"fmnist_npy", "fmnist_shards_st", "fmnist_shards_npy"}) {
    SCOPED_TRACE(data);
    const std::string run = d.file(data);
    auto r = run_limbo(cat({"launch", "--nproc", "2", "--min-workers", "1", "--", "--run-dir", run},
                           user_job(fx, "cnn_bn.pt", data,
                                    {"train.epochs=2", "train.threads=1", "train.sample_log=true"})));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    lines[data] = sample_lines(run);
    expect_members_agree(run, 2);
    finals[data] = final_fingerprints(run).at(0);
  }
  // Exactly once: each epoch's batches are a permutation of the 6,000 samples.
  std::map<int64_t, std::vector<int64_t>> per_epoch;
  for (const auto& [step, line] : lines["fmnist_shards_st"]) {
    std::istringstream in(line);
    int64_t s, epoch, id;
    in >> s >> epoch;
    while (in >> id) per_epoch[epoch].push_back(id);
  }
  ASSERT_EQ(per_epoch.size(), 2u);
  for (auto& [epoch, ids] : per_epoch) {
    std::sort(ids.begin(), ids.end());
    std::vector<int64_t> all(6000);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(ids, all) << "epoch " << epoch;
  }
  EXPECT_EQ(lines["fmnist_shards_st"], lines["fmnist_npy"]);
  EXPECT_EQ(lines["fmnist_shards_npy"], lines["fmnist_npy"]);
  EXPECT_EQ(finals["fmnist_shards_st"], finals["fmnist_npy"]);
  EXPECT_EQ(finals["fmnist_shards_npy"], finals["fmnist_npy"]);
}

namespace {

// Found by a review: each parameter-server shard checked only its own slice,
// so a gradient that was NaN in one slice had its finite rest applied by the
// other shards. This module's loss is finite and only its `tail` parameter's
// gradient is NaN: no shard may apply any of it, so the model ends as it
// began (and the learner counts every step as skipped).
TEST(UserState, AGradientThatIsNotFiniteInOneShardsSliceIsAppliedByNoShard) {
  NEED_FIXTURES();
  TempDir d;
  const json original = module_state(fx("nan_tail.pt"));
  const std::string run = d.file("ps");
  auto r = run_limbo(cat({"launch", "--mode", "async", "--servers", "2", "--workers", "1", "--run-dir", run, "--"},
                         user_job(fx, "nan_tail.pt", "fmnist_npy",
                                  {"data.train_limit=384", "train.epochs=1", "train.threads=1", "train.max_nonfinite_steps=0",
                                   "ps.request_timeout=30"})));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json got = exported_state(run);
  for (const char* name : {"body.1.weight", "body.1.bias"})
    EXPECT_EQ(got["parameters"][name]["hash"], original["parameters"][name]["hash"]) << name << " moved";
  // The same module alone skips every step the same way.
  const std::string single = d.file("single");
  auto s = run_limbo(cat({"train", "--run-dir", single},
                         user_job(fx, "nan_tail.pt", "fmnist_npy", {"data.train_limit=384", "train.epochs=1", "train.max_nonfinite_steps=0"})));
  ASSERT_EQ(s.exit_code, 0) << s.output;
  EXPECT_EQ(summary(single)["skipped_steps"], 12) << s.output;
}

}  // namespace
