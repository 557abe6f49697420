// scripts/setup.sh, the first command's set-up: when a step fails (no
// network to the package archive, no root, a compiler error) the user gets
// one message naming the step and its log, and a non-zero exit. The tools
// it calls (dpkg-query, apt-get, id, cmake) are replaced by small scripts
// put first on PATH, so nothing is installed or built.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/files.h"
#include "test_util.h"

using limbo::testing::TempDir;

namespace {

struct SetupRun {
  TempDir d;
  std::string shims = d.file("shims");
  std::string build = d.file("build");

  SetupRun() { limbo::make_dirs(shims); }
  void shim(const std::string& name, const std::string& body) {
    const std::string path = shims + "/" + name;
    std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
    ::chmod(path.c_str(), 0755);
  }
  // The fast BLAS is already the system's (nothing to select).
  void blas_selected() {
    shim("update-alternatives",
         "case \"$*\" in *lapack*) echo 'Value: /usr/lib/x86_64-linux-gnu/openblas-openmp/liblapack.so.3';;"
         " *libopenblas*) echo 'Value: /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0';;"
         " *) echo 'Value: /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3';; esac");
    shim("dpkg-architecture", "echo x86_64-linux-gnu");
  }
  limbo::testing::ProcessResult run() {
    const std::string out = d.file("setup.out");
    // LIMBO_JOBS is set here whatever the caller's environment holds.
    const std::vector<std::string> argv = {"/usr/bin/env", "PATH=" + shims + ":/usr/sbin:/usr/bin:/sbin:/bin",
                                           "LIMBO_BUILD_DIR=" + build, "LIMBO_JOBS=3", "bash",
                                           std::string(LIMBO_SOURCE_DIR) + "/scripts/setup.sh", "--limbo"};
    return limbo::testing::wait_child(limbo::testing::spawn_process(argv, out), out, 60);
  }
};

TEST(Setup, NoNetworkToTheArchiveNamesTheStepAndTheLog) {
  SetupRun s;
  s.shim("dpkg-query", "exit 1");  // nothing installed
  s.shim("apt-get",
         "echo \"Err:1 http://deb.debian.org/debian bookworm InRelease\"\n"
         "echo \"  Temporary failure resolving 'deb.debian.org'\"\nexit 100");
  const auto r = s.run();
  EXPECT_EQ(r.exit_code, 100) << r.output;
  EXPECT_NE(r.output.find("setup: installing packages (apt-get update) failed (exit 100)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("could not be reached"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("full log: " + s.build + "/logs/packages.log"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Temporary failure resolving"), std::string::npos) << "the log's end is not shown\n"
                                                                            << r.output;
  EXPECT_EQ(r.output.find("building"), std::string::npos) << "went on after the failure\n" << r.output;
}

TEST(Setup, WithoutRootOrSudoItSaysWhatToRun) {
  if (::access("/usr/bin/sudo", X_OK) == 0) GTEST_SKIP() << "sudo is installed here";
  SetupRun s;
  s.shim("dpkg-query", "exit 1");
  s.shim("id", "echo 1000");
  const auto r = s.run();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("setup: installing packages failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("needs root"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("apt-get install build-essential"), std::string::npos) << r.output;
}

TEST(Setup, ACompilerErrorShowsTheErrorAndTheLog) {
  SetupRun s;
  s.shim("dpkg-query", "echo 'install ok installed'");
  s.blas_selected();
  s.shim("cmake",
         "case \"$*\" in *--build*) echo '[ 40%] Building CXX object src/x.cc.o';"
         " echo \"src/x.cc:3:1: error: expected ';' before '}' token\"; exit 2;; esac\nexit 0");
  const auto r = s.run();
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("packages: all"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("setup: building limbo and its Python module failed (exit 2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("error: expected ';'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("full log: " + s.build + "/logs/build.log"), std::string::npos) << r.output;
}

// Found on a fresh machine: the test packages bring the pthread OpenBLAS,
// which took libopenblas.so.0 over by priority, so the default job run after
// the tests used it (it oversubscribes the cores next to libtorch's OpenMP).
TEST(Setup, ThePthreadOpenBlasIsNotLeftInCharge) {
  if (::access("/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0", R_OK) != 0)
    GTEST_SKIP() << "no OpenMP OpenBLAS here";
  SetupRun s;
  s.shim("dpkg-query", "echo 'install ok installed'");
  s.shim("dpkg-architecture", "echo x86_64-linux-gnu");
  const std::string calls = s.d.file("alternatives.calls");
  s.shim("update-alternatives",
         "echo \"$*\" >> " + calls + "\n"
         "case \"$*\" in *--query*lapack*) echo 'Value: /usr/lib/x86_64-linux-gnu/openblas-openmp/liblapack.so.3';;"
         " *--query*libopenblas*) echo 'Value: /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0';;"
         " *--query*) echo 'Value: /usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3';; esac");
  s.shim("cmake", "exit 0");
  const auto r = s.run();
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string log = limbo::testing::slurp(calls);
  EXPECT_NE(log.find("--set libopenblas.so.0-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0"),
            std::string::npos) << log;
  EXPECT_EQ(log.find("--set libblas.so.3"), std::string::npos) << "set what was already right\n" << log;
  EXPECT_NE(r.output.find("selecting OpenBLAS (OpenMP) for libopenblas.so.0 ... done"), std::string::npos) << r.output;
}

// Everything present and built: one line per phase, nothing installed.
TEST(Setup, WhenAllIsThereItSaysSoInOneLinePerPhase) {
  SetupRun s;
  s.shim("dpkg-query", "echo 'install ok installed'");
  s.blas_selected();
  s.shim("apt-get", "echo apt-get was called; exit 1");
  s.shim("cmake", "exit 0");
  const auto r = s.run();
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("apt-get was called"), std::string::npos) << r.output;
  // As many as the script's list for `limbo` names (not a number written here).
  const std::string script = limbo::testing::slurp(std::string(LIMBO_SOURCE_DIR) + "/scripts/setup.sh");
  const auto from = script.find("LIMBO_PACKAGES=("), to = script.find(')', from);
  ASSERT_NE(from, std::string::npos);
  std::istringstream names(script.substr(from + 16, to - from - 16));
  int listed = 0;
  for (std::string w; names >> w;) listed += w[0] != '#';
  EXPECT_GT(listed, 10);
  EXPECT_NE(r.output.find("] packages: all " + std::to_string(listed) + " present"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("] building limbo and its Python module on 3 cores ... up to date ("), std::string::npos) << r.output;
}

}  // namespace
