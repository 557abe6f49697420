// Slurm: the host list and job environment (common/slurm.h), what
// `limbo launch` takes from them (--dry-run), and a real Slurm (munged,
// slurmctld and slurmd started here, one node) running the example's
// batch script: a job that completes, and one warned of preemption that is
// requeued and resumes from its checkpoint.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "common/slurm.h"
#include "job_checks.h"
#include "netns.h"
#include "test_util.h"

using limbo::expand_slurm_hostlist;
using limbo::testing::slurp;
using limbo::testing::TempDir;
using namespace std::chrono_literals;

namespace {

using Names = std::vector<std::string>;

TEST(SlurmHostList, ExpandsRangesListsAndPaddingInOrder) {
  EXPECT_EQ(expand_slurm_hostlist("vm"), Names{"vm"});
  EXPECT_EQ(expand_slurm_hostlist("node[01-03,7],gpu-a,x[1-2]-ib"),
            (Names{"node01", "node02", "node03", "node7", "gpu-a", "x1-ib", "x2-ib"}));
  EXPECT_EQ(expand_slurm_hostlist("a[08-10]"), (Names{"a08", "a09", "a10"}));
  EXPECT_EQ(expand_slurm_hostlist("r[1-2]n[1-2]"), (Names{"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_slurm_hostlist("c[998-1000]"), (Names{"c998", "c999", "c1000"}));
}

TEST(SlurmHostList, RefusesMalformedListsAndHugeOnesWithAClearError) {
  for (const std::string bad : {"", "n[1-", "n1]", "n[3-1]", "n[a-b]", "n[1-2],", "n[]", "n[1--2]"}) {
    try {
      expand_slurm_hostlist(bad);
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const limbo::InvalidInput& e) {
      EXPECT_NE(std::string(e.what()).find("Slurm host list"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(expand_slurm_hostlist("n[1-2000000]"), limbo::InvalidInput);
  EXPECT_THROW(expand_slurm_hostlist("a[1-1000]b[1-1000]c[1-1000]", 100000), limbo::InvalidInput);
  EXPECT_EQ(expand_slurm_hostlist("n[1-1000]").size(), 1000u);
}

TEST(SlurmJob, ReadsTheJobFromItsEnvironmentAndNothingOutsideOne) {
  std::map<std::string, std::string> env;
  auto get = [&](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  EXPECT_FALSE(limbo::slurm_job(get).has_value());
  env = {{"SLURM_JOB_ID", "123456"}, {"SLURM_JOB_NODELIST", "n[1-4]"}, {"SLURM_CPUS_ON_NODE", "8"},
         {"SLURM_RESTART_COUNT", "2"}, {"SLURM_NODEID", "3"}};
  auto j = limbo::slurm_job(get);
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->job_id, "123456");
  EXPECT_EQ(j->nodes, (Names{"n1", "n2", "n3", "n4"}));
  EXPECT_EQ(j->workers_per_node(), 8);  // no CPUs per task: the node's CPUs
  env["SLURM_CPUS_PER_TASK"] = "2";
  EXPECT_EQ(limbo::slurm_job(get)->workers_per_node(), 2);
  EXPECT_EQ(j->restart_count, 2);
  EXPECT_EQ(j->node_id, 3);
  EXPECT_EQ(j->rendezvous_port(), 29400 + 456);
  env["SLURM_CPUS_PER_TASK"] = "two";
  EXPECT_THROW(limbo::slurm_job(get), limbo::InvalidInput);
  env.erase("SLURM_CPUS_PER_TASK");
  env.erase("SLURM_JOB_NODELIST");
  EXPECT_THROW(limbo::slurm_job(get), limbo::InvalidInput);
}

// `limbo launch --dry-run` with `env` added to its environment.
limbo::testing::ProcessResult launch_dry_run(const std::vector<std::string>& env, const std::vector<std::string>& args,
                                             const std::string& dir) {
  std::vector<std::string> a = {"/usr/bin/env", "-u", "SLURM_JOB_ID", "-C", dir};
  a.insert(a.end(), env.begin(), env.end());
  a.insert(a.end(), {LIMBO_BINARY, "launch", "--dry-run"});
  a.insert(a.end(), args.begin(), args.end());
  const std::string log = dir + "/dry-run.log";
  return limbo::testing::wait_child(limbo::testing::spawn_process(a, log), log, 60);
}

const std::vector<std::string> kJobEnv = {"SLURM_JOB_ID=4321", "SLURM_JOB_NODELIST=n[07-09]",
                                          "SLURM_CPUS_PER_TASK=3", "SLURM_NODEID=1"};

TEST(SlurmLaunch, TakesNodesWorkersRendezvousAndRunDirectoryFromTheJob) {
  TempDir d;
  auto r = launch_dry_run(kJobEnv, {"--", "--config", "x.toml"}, d.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* want : {"from Slurm: --nproc 3 (SLURM_CPUS_PER_TASK)", "from Slurm: --min-workers 3 --max-workers 9",
                           "from Slurm: --start-workers 9", "from Slurm: --rdzv n07:29721",
                           "from Slurm: --run-dir runs/slurm-4321", "from Slurm: --job-name slurm-4321",
                           "workers on this host: 3",
                           "elastic: min 3, max 9, the first round waits for 9", "rendezvous: n07:29721",
                           "training arguments: --config x.toml --run-dir runs/slurm-4321"})
    EXPECT_NE(r.output.find(want), std::string::npos) << "no '" << want << "' in:\n" << r.output;
  EXPECT_EQ(r.output.find("--resume"), std::string::npos) << r.output;
}

TEST(SlurmLaunch, FlagsGivenWinOverWhatTheJobSays) {
  TempDir d;
  auto r = launch_dry_run(kJobEnv,
                          {"--nproc", "1", "--min-workers", "2", "--max-workers", "5", "--rdzv", "10.0.0.1:5000",
                           "--run-dir", d.file("mine"), "--", "--config", "x.toml"},
                          d.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("from Slurm: --nproc"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("from Slurm: --rdzv"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("from Slurm: --run-dir"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("workers on this host: 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("elastic: min 2, max 5"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rendezvous: 10.0.0.1:5000"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--run-dir " + d.file("mine")), std::string::npos) << r.output;
  // The run directory among the training arguments counts as given too.
  r = launch_dry_run(kJobEnv, {"--", "--run-dir", d.file("theirs")}, d.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("runs/slurm-4321"), std::string::npos) << r.output;
}

// Found: etcd.sbatch did not parse (a quote inside ${ETCD:?...}). Every
// script in examples/slurm parses, and each batch script asks for what the
// docs promise: requeue, --no-kill, the warning ahead of time.
TEST(SlurmExamples, EveryScriptParsesAndAsksForRequeueNoKillAndTheWarning) {
  int seen = 0;
  for (const auto& f : std::filesystem::directory_iterator(std::string(LIMBO_SOURCE_DIR) + "/examples/slurm")) {
    const std::string path = f.path().string();
    SCOPED_TRACE(path);
    ++seen;
    auto r = limbo::testing::wait_child(limbo::testing::spawn_process({"/bin/bash", "-n", path}, path + ".log"),
                                        path + ".log", 30);
    std::filesystem::remove(path + ".log");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (f.path().extension() != ".sbatch") continue;
    const std::string text = slurp(path);
    for (const char* line : {"#SBATCH --requeue\n", "#SBATCH --no-kill\n", "#SBATCH --signal=B:USR1@",
                             "#SBATCH --ntasks-per-node=1\n", "examples/slurm/limbo-srun.sh"})
      EXPECT_NE(text.find(line), std::string::npos) << line;
  }
  EXPECT_EQ(seen, 4);
}

// A requeued job finds its checkpoint in its run directory and goes on.
TEST(SlurmLaunch, ARequeuedJobResumesFromItsRunDirectorysCheckpoint) {
  TempDir d;
  std::filesystem::create_directories(d.file("runs/slurm-4321"));
  std::ofstream(d.file("runs/slurm-4321/checkpoint.pt")) << "x";
  auto env = kJobEnv;
  env.push_back("SLURM_RESTART_COUNT=1");
  auto r = launch_dry_run(env, {"--", "--config", "x.toml"}, d.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("from Slurm: --resume (runs/slurm-4321 holds a checkpoint; requeued 1 time(s))"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("training arguments: --config x.toml --resume --run-dir runs/slurm-4321"),
            std::string::npos)
      << r.output;
}

TEST(SlurmLaunch, OutsideSlurmNothingIsDerivedAndABadJobEnvironmentIsAnInputError) {
  TempDir d;
  auto r = launch_dry_run({}, {"--", "--config", "x.toml"}, d.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("from Slurm"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("workers on this host: 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fixed membership"), std::string::npos) << r.output;
  r = launch_dry_run({"SLURM_JOB_ID=7", "SLURM_JOB_NODELIST=n[1-"}, {"--"}, d.path());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("Slurm host list 'n[1-'"), std::string::npos) << r.output;
}

// ---------- a real Slurm ----------

// Runs `argv`; its combined output.
std::string output_of(const std::vector<std::string>& argv) {
  TempDir d;
  const std::string log = d.file("out");
  return limbo::testing::wait_child(limbo::testing::spawn_process(argv, log), log, 60).output;
}

// A Slurm cluster of `n` nodes on this machine: each node a network
// namespace (VirtualHosts) running its slurmd (`-N node<i>`), slurmctld in
// node 0's, and a munged of its own. ok() is false, with why(), where that
// cannot run (not root, the packages missing, no namespaces).
class SlurmCluster {
 public:
  explicit SlurmCluster(int n) : hosts_(n) { start(n); }
  ~SlurmCluster() {
    if (ok_) output_of(in(0, {"/usr/bin/scancel", "--user=root"}));
    for (int i = 0; i < hosts_.size() && hosts_.ok(); ++i) hosts_.signal_host(i, SIGKILL);
    for (pid_t p : daemons_) ::kill(p, SIGKILL);
    if (munged_ > 0) ::kill(munged_, SIGKILL);
    ::unsetenv("SLURM_CONF");
  }
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  const std::string& dir() const { return d_.path(); }
  // `argv` on node i, in its network namespace (nsenter: `ip netns exec`
  // would hide the cgroup file system slurmd reads).
  std::vector<std::string> in(int i, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {"/usr/bin/nsenter", "--net=/run/netns/" + hosts_.ns(i)});
    return argv;
  }

 private:
  void start(int n) {
    if (::geteuid() != 0) return void(why_ = "Slurm's daemons need root");
    for (const char* b : {"/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/sbatch",
                          "/usr/bin/nsenter"})
      if (!limbo::file_exists(b))
        return void(why_ = std::string(b) + " is not installed (scripts/setup.sh installs munge, slurmctld, slurmd and "
                                            "slurm-client)");
    if (!hosts_.ok()) return void(why_ = hosts_.why());
    for (const char* sub : {"state", "spool", "log"}) std::filesystem::create_directories(d_.file(sub));
    {
      std::ofstream key(d_.file("munge.key"), std::ios::binary);
      for (int i = 0; i < 1024; ++i) key.put(static_cast<char>(std::rand() & 0xff));
    }
    std::filesystem::permissions(d_.file("munge.key"), std::filesystem::perms::owner_read);
    munged_ = limbo::testing::spawn_process(
        {"/usr/sbin/munged", "--foreground", "--force", "--key-file=" + d_.file("munge.key"),
         "--socket=" + d_.file("munge.sock"), "--pid-file=" + d_.file("munged.pid"),
         "--log-file=" + d_.file("log/munged.log"), "--seed-file=" + d_.file("munged.seed")},
        d_.file("log/munged.out"), true);
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    std::ofstream conf(d_.file("slurm.conf"));
    conf << "ClusterName=limbo\nSlurmctldHost=" << host << "(" << hosts_.ip(0) << ")\n"
         << "AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket=" << d_.file("munge.sock") << "\n"
         << "SlurmUser=root\nSlurmdUser=root\nStateSaveLocation=" << d_.file("state") << "\n"
         << "SlurmdSpoolDir=" << d_.file("spool/%n") << "\nSlurmctldPidFile=" << d_.file("slurmctld.pid") << "\n"
         << "SlurmdPidFile=" << d_.file("slurmd-%n.pid") << "\nSlurmctldLogFile=" << d_.file("log/slurmctld.log")
         << "\nSlurmdLogFile=" << d_.file("log/slurmd-%n.log") << "\n"
         << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
         << "AccountingStorageType=accounting_storage/none\nSelectType=select/cons_tres\n"
         << "SelectTypeParameters=CR_CPU\nMpiDefault=none\nReturnToService=2\nKillWait=5\nSlurmdTimeout=10\n"
         << "MinJobAge=600\nSchedulerParameters=sched_interval=2,bf_interval=2\n";
    for (int i = 0; i < n; ++i)
      conf << "NodeName=node" << i << " NodeAddr=" << hosts_.ip(i) << " CPUs=1 State=UNKNOWN\n";
    conf << "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n";
    conf.close();
    ::setenv("SLURM_CONF", d_.file("slurm.conf").c_str(), 1);
    for (int i = 0; i < 100 && !limbo::file_exists(d_.file("munge.sock")); ++i) std::this_thread::sleep_for(50ms);
    if (!limbo::file_exists(d_.file("munge.sock"))) return void(fail("munged did not start"));
    daemons_.push_back(limbo::testing::spawn_process(in(0, {"/usr/sbin/slurmctld", "-D", "-f", d_.file("slurm.conf")}),
                                                     d_.file("log/slurmctld.out"), true));
    for (int i = 0; i < n; ++i)
      daemons_.push_back(limbo::testing::spawn_process(
          in(i, {"/usr/sbin/slurmd", "-D", "-f", d_.file("slurm.conf"), "-N", "node" + std::to_string(i)}),
          d_.file("log/slurmd" + std::to_string(i) + ".out"), true));
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < until) {
      const std::string idle = output_of(in(0, {"/usr/bin/sinfo", "-h", "-t", "idle", "-o", "%D"}));
      if (std::atoi(idle.c_str()) == n) return void(ok_ = true);
      std::this_thread::sleep_for(500ms);
    }
    fail("the nodes did not come up within 60 s");
  }

 public:
  // sbatch `args` (a script, or options and --wrap); the job id.
  std::string submit(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {"/usr/bin/sbatch", "--parsable", "--chdir=" + dir(),
                                     "--output=" + dir() + "/slurm-%j.out"};
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string out = output_of(in(0, argv));
    std::smatch m;
    return std::regex_search(out, m, std::regex("^([0-9]+)")) ? m[1].str() : "sbatch said: " + out;
  }
  std::string job(const std::string& id) { return output_of(in(0, {"/usr/bin/scontrol", "show", "job", id})); }
  std::string field(const std::string& id, const std::string& name) {
    std::smatch m;
    const std::string text = job(id);
    return std::regex_search(text, m, std::regex(name + "=([^ \n]*)")) ? m[1].str() : "";
  }
  // Waits up to `limit` for the job's field to read `want`.
  bool wait_field(const std::string& id, const std::string& name, const std::string& want, std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < until) {
      if (field(id, name) == want) return true;
      std::this_thread::sleep_for(500ms);
    }
    return field(id, name) == want;
  }
  std::string run(const std::vector<std::string>& argv) { return output_of(in(0, argv)); }
  // Node i lost: every process in its namespace killed, its slurmd included.
  void lose(int i) { hosts_.signal_host(i, SIGKILL); }
  // Node i given back: its slurmd started again.
  void give_back(int i) {
    daemons_.push_back(limbo::testing::spawn_process(
        in(i, {"/usr/sbin/slurmd", "-D", "-f", d_.file("slurm.conf"), "-N", "node" + std::to_string(i)}),
        d_.file("log/slurmd" + std::to_string(i) + "-again.out"), true));
  }
  // Waits up to `limit` for node i's state (sinfo %T) to begin with `want`.
  bool wait_node(int i, const std::string& want, std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    do {
      if (node_state(i).rfind(want, 0) == 0) return true;
      std::this_thread::sleep_for(500ms);
    } while (std::chrono::steady_clock::now() < until);
    return false;
  }
  std::string node_state(int i) {
    return output_of(in(0, {"/usr/bin/sinfo", "-h", "-N", "-n", "node" + std::to_string(i), "-o", "%T"}));
  }
  std::string logs() {
    std::string all;
    for (const auto& f : std::filesystem::directory_iterator(d_.file("log")))
      all += "\n== " + f.path().string() + "\n" + slurp(f.path());
    return all;
  }

 private:
  void fail(const std::string& what) { why_ = what + logs(); }
  limbo::testing::VirtualHosts hosts_;
  TempDir d_;
  bool ok_ = false;
  std::string why_;
  pid_t munged_ = -1;
  std::vector<pid_t> daemons_;
};

const int kClusterEpochs = 12;

// The training arguments of the jobs here; `extra`: more of them.
std::string train_args(int epochs, const std::string& extra = "") {
  return "--set model.name=mlp --set model.width=64 --set data.train_limit=3000 --set data.test_limit=300"
         " --set data.batch_size=8 --set train.epochs=" +
         std::to_string(epochs) +
         " --set train.threads=1 --set train.progress=false --set train.sample_log=true"
         " --set train.checkpoint_every_epochs=0 --set elastic.collective_timeout=2" +
         extra;
}

// The batch script of a job of the default shape: every node runs
// `limbo launch` through examples/slurm/limbo-srun.sh, the way
// examples/slurm/default.sbatch does.
std::string write_job_script(const SlurmCluster& c, int nodes, int epochs, const std::string& extra = "") {
  const std::string path = c.dir() + "/job.sbatch";
  std::ofstream f(path);
  f << "#!/bin/bash\n#SBATCH --nodes=" << nodes << "\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
    << "#SBATCH --requeue\n#SBATCH --no-kill\n#SBATCH --open-mode=append\nexport LIMBO=" << LIMBO_BINARY << "\n"
    << "exec " << LIMBO_SOURCE_DIR << "/examples/slurm/limbo-srun.sh -- " << train_args(epochs, extra) << "\n";
  f.close();
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

bool have_fmnist() { return limbo::file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"); }

// A job on two nodes: a launcher on each, each with the one worker its CPU
// allows, meeting at the first node; it trains every sample once an epoch
// and completes, and Slurm records exit code 0.
TEST(SlurmCluster, ABatchJobOnTwoNodesTrainsOnBothAndCompletes) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  SlurmCluster c(2);
  if (!c.ok()) GTEST_SKIP() << "Slurm cannot run here: " << c.why();
  const std::string id = c.submit({write_job_script(c, 2, 2)});
  ASSERT_TRUE(std::regex_match(id, std::regex("[0-9]+"))) << id;
  const std::string out = c.dir() + "/slurm-" + id + ".out";
  ASSERT_TRUE(c.wait_field(id, "JobState", "COMPLETED", 300s))
      << c.job(id) << slurp(out) << c.logs();
  EXPECT_EQ(c.field(id, "ExitCode"), "0:0");
  const std::string run = c.dir() + "/runs/slurm-" + id;
  auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 2) << slurp(out);
  const std::string text = slurp(out);
  EXPECT_NE(text.find("from Slurm: --nproc 1"), std::string::npos) << text;
  EXPECT_NE(text.find("from Slurm: --min-workers 1 --max-workers 2"), std::string::npos) << text;
  limbo::testing::expect_exactly_once(run, 2, 3000);
}

// Slurm's warning to the batch job `id` once its first metrics line is
// written: the workers checkpoint and leave, `limbo launch` exits 75, the
// script requeues the job, and its next run resumes from the checkpoint and
// completes. Returns the run's summary (null after a failed assertion).
nlohmann::json warn_requeue_and_complete(SlurmCluster& c, const std::string& id, std::chrono::seconds start_wait) {
  const std::string out = c.dir() + "/slurm-" + id + ".out";
  const std::string run = c.dir() + "/runs/slurm-" + id;
  if (!limbo::testing::wait_for_text(run + "/metrics.jsonl", "\"kind\":\"train\"", start_wait.count())) {
    ADD_FAILURE() << "no training record\n" << c.job(id) << slurp(out) << c.logs();
    return nullptr;
  }
  c.run({"/usr/bin/scancel", "--signal=USR1", "--batch", id});
  if (!c.wait_field(id, "Restarts", "1", 120s)) {
    ADD_FAILURE() << "not requeued\n" << c.job(id) << slurp(out);
    return nullptr;
  }
  EXPECT_TRUE(limbo::file_exists(run + "/checkpoint.pt")) << slurp(out);
  EXPECT_FALSE(limbo::file_exists(run + "/summary.json")) << "completed before the warning; pace the job";
  // A requeued job waits out Slurm's requeue delay; start it sooner, but not
  // within the second of the requeue: slurmd refuses a job started in the
  // second its previous run's credential was revoked ("Job credential
  // revoked"), which failed this test once with StartTime=now.
  c.run({"/usr/bin/scontrol", "update", "JobId=" + id, "StartTime=now+2"});
  if (!c.wait_field(id, "JobState", "COMPLETED", 400s)) {
    ADD_FAILURE() << "not completed\n" << c.job(id) << slurp(out) << c.logs();
    return nullptr;
  }
  const std::string text = slurp(out);
  EXPECT_NE(text.find("exit code 75"), std::string::npos) << text;
  EXPECT_NE(text.find("requeueing job " + id), std::string::npos) << text;
  EXPECT_NE(text.find("from Slurm: --resume"), std::string::npos) << text;
  auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 2) << text;
  return s;
}

// Slurm's warning ahead of preemption (what `#SBATCH --signal=B:USR1@60`
// sends): no sample lost or repeated across the two runs.
TEST(SlurmCluster, AJobWarnedOfPreemptionCheckpointsIsRequeuedAndResumes) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  SlurmCluster c(2);
  if (!c.ok()) GTEST_SKIP() << "Slurm cannot run here: " << c.why();
  // Paced (10 ms a step, 188 steps an epoch): the job cannot complete
  // before the warning, which comes after its first epoch.
  const std::string id = c.submit({write_job_script(c, 2, kClusterEpochs, " --set train.slow_step_ms=10")});
  ASSERT_TRUE(std::regex_match(id, std::regex("[0-9]+"))) << id;
  if (warn_requeue_and_complete(c, id, 120s).is_null()) return;
  limbo::testing::expect_exactly_once(c.dir() + "/runs/slurm-" + id, kClusterEpochs, 3000);
}

// The same warning for a user's Python loop (tests/python/job_script.py
// with the `limbo` module, run by `limbo launch -- python3 ...` on each
// node): every sample once an epoch across the two runs.
TEST(SlurmCluster, APythonLoopWarnedOfPreemptionCheckpointsIsRequeuedAndResumes) {
  SlurmCluster c(2);
  if (!c.ok()) GTEST_SKIP() << "Slurm cannot run here: " << c.why();
  const std::string path = c.dir() + "/python.sbatch";
  {
    // Paced (50 ms a step, 32 steps an epoch of 1024 samples on two nodes of
    // batch 16): the job cannot complete before the warning.
    std::ofstream f(path);
    f << "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=1\n"
      << "#SBATCH --requeue\n#SBATCH --no-kill\n#SBATCH --open-mode=append\nexport LIMBO=" << LIMBO_BINARY << "\n"
      << "export PACE=0.05\n"
      << "exec " << LIMBO_SOURCE_DIR << "/examples/slurm/limbo-srun.sh -- /usr/bin/python3 " << LIMBO_SOURCE_DIR
      << "/tests/python/job_script.py --epochs " << kClusterEpochs << " --loader-workers 0\n";
  }
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  const std::string id = c.submit({path});
  ASSERT_TRUE(std::regex_match(id, std::regex("[0-9]+"))) << id;
  const auto s = warn_requeue_and_complete(c, id, 180s);
  if (s.is_null()) return;
  EXPECT_EQ(s["front_end"], "python") << s.dump();
  limbo::testing::expect_exactly_once(c.dir() + "/runs/slurm-" + id, kClusterEpochs, 1024);
}

// Polls `done` every 200 ms for up to `limit`.
template <typename F>
bool wait_until(F done, std::chrono::seconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(200ms);
  }
  return true;
}

// The membership changes of a run: (world, reason) in order.
std::vector<std::pair<int, std::string>> memberships(const std::string& run) {
  std::vector<std::pair<int, std::string>> out;
  std::istringstream in(slurp(run + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    auto r = nlohmann::json::parse(line);
    if (r.value("kind", "") == "membership") out.emplace_back(r["world"].get<int>(), r.value("reason", ""));
  }
  return out;
}

bool has_world(const std::string& run, int world, size_t after) {
  const auto m = memberships(run);
  for (size_t i = after; i < m.size(); ++i)
    if (m[i].first == world) return true;
  return false;
}

// One node of two lost (every process on it killed, slurmd too): the other
// trains on alone; Slurm marks the node down and the job keeps running
// (--no-kill). The node given back joins the running job from a job of its
// own, the way docs/slurm.md says, and the job completes on both, every
// sample once an epoch.
TEST(SlurmCluster, ANodeLostTheOtherTrainsOnAndTheNodeGivenBackRejoins) {
  if (!have_fmnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  SlurmCluster c(2);
  if (!c.ok()) GTEST_SKIP() << "Slurm cannot run here: " << c.why();
  // Paced (20 ms a step: 3.75 s an epoch on two workers, 7.5 s on one):
  // after the loss at least 80 s of training remain, for a node that
  // rejoins in about 20.
  const std::string paced = " --set train.slow_step_ms=20";
  const std::string id = c.submit({write_job_script(c, 2, kClusterEpochs, paced)});
  ASSERT_TRUE(std::regex_match(id, std::regex("[0-9]+"))) << id;
  const std::string out = c.dir() + "/slurm-" + id + ".out";
  const std::string run = c.dir() + "/runs/slurm-" + id;
  ASSERT_TRUE(limbo::testing::wait_for_text(run + "/metrics.jsonl", "\"kind\":\"train\"", 120))
      << c.job(id) << slurp(out) << c.logs();
  ASSERT_TRUE(has_world(run, 2, 0)) << slurp(out);
  c.lose(1);
  const size_t before = memberships(run).size();
  ASSERT_TRUE(wait_until([&] { return has_world(run, 1, before); }, 60s))
      << "no re-formed group of one\n" << slurp(out);
  ASSERT_TRUE(c.wait_node(1, "down", 60s)) << c.node_state(1) << c.logs();
  EXPECT_EQ(c.field(id, "JobState"), "RUNNING") << c.job(id);
  EXPECT_FALSE(limbo::file_exists(run + "/summary.json")) << "completed before the node came back; pace the job";
  // Given back: the node's slurmd again, then a job of one node that joins.
  c.give_back(1);
  ASSERT_TRUE(c.wait_node(1, "idle", 60s)) << c.node_state(1) << c.logs();
  std::smatch m;
  const std::string said = slurp(out);
  ASSERT_TRUE(std::regex_search(said, m, std::regex("from Slurm: --rdzv ([^ ]+)"))) << said;
  const size_t alone = memberships(run).size();
  const std::string joiner =
      c.submit({"--nodelist=node1", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1",
                "--wrap=srun " + std::string(LIMBO_BINARY) + " launch --rdzv " + m[1].str() +
                    " --min-workers 1 --run-dir runs/slurm-" + id + " -- " + train_args(kClusterEpochs, paced)});
  ASSERT_TRUE(std::regex_match(joiner, std::regex("[0-9]+"))) << joiner;
  ASSERT_TRUE(wait_until([&] { return has_world(run, 2, alone); }, 120s))
      << "the node did not rejoin\n" << c.job(joiner) << slurp(c.dir() + "/slurm-" + joiner + ".out") << slurp(out);
  ASSERT_TRUE(c.wait_field(id, "JobState", "COMPLETED", 300s)) << c.job(id) << slurp(out) << c.logs();
  EXPECT_EQ(c.field(id, "ExitCode"), "0:0") << slurp(out);
  ASSERT_TRUE(c.wait_field(joiner, "JobState", "COMPLETED", 60s))
      << c.job(joiner) << slurp(c.dir() + "/slurm-" + joiner + ".out");
  auto s = nlohmann::json::parse(slurp(run + "/summary.json"));
  EXPECT_EQ(s["workers"].get<int64_t>(), 2) << slurp(out);
  limbo::testing::expect_exactly_once(run, kClusterEpochs, 3000);
}

}  // namespace
