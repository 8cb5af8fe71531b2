// Data-parallel training over MPI: the communicator across processes, 2 ranks matching 1 rank,
// checkpoints that resume on another rank count, and jobs that end (rather than hang) when a rank
// dies. Tests that need mpirun skip with a message when it or the MPI build is absent.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>

#include "attnres/checkpoint.hpp"
#include "attnres/dist.hpp"
#include "attnres/error.hpp"
#include "attnres/params.hpp"
#include "attnres/safetensors.hpp"
#include "test_util.hpp"
#include "train/grad_buckets.hpp"

namespace fs = std::filesystem;
using namespace attnres;
using attnres::testing::CliRun;
using attnres::testing::TempDir;

namespace {

bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// mpirun's path, or "" when it is not installed.
std::string find_mpirun() {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    const size_t end = std::min(p.find(':', start), p.size());
    const fs::path cand = fs::path(p.substr(start, end - start)) / "mpirun";
    if (::access(cand.c_str(), X_OK) == 0) return cand.string();
    start = end + 1;
  }
  return "";
}

// The mpirun command prefix for n ranks on this machine (any number of cores, as root too).
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNRES_HAS_ASAN 1
#endif
#endif
#ifndef ATTNRES_HAS_ASAN
#define ATTNRES_HAS_ASAN 0
#endif

std::string mpirun(int n) {
  // CI runs as root; OpenMPI refuses that unless told it is deliberate.
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  std::string cmd = "exec " + find_mpirun() + " -np " + std::to_string(n) + " --oversubscribe ";
#if defined(__SANITIZE_ADDRESS__) || ATTNRES_HAS_ASAN
  // Under scripts/sanitize.sh: OpenMPI never frees some of its own allocations (many in its
  // dlopen'ed plugins, which LeakSanitizer cannot name, so no suppression file can match them).
  // The ranks keep every other ASan/UBSan check; only leak detection is off, and only in them.
  cmd += "-x ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 ";
#endif
  return cmd;
}

#define SKIP_WITHOUT_MPIRUN()                                                                    \
  do {                                                                                           \
    if (!dist::mpi_compiled()) {                                                                 \
      GTEST_SKIP() << "attnres was built without MPI: install libopenmpi-dev (scripts/setup.sh)" \
                      " and reconfigure to run the multi-process tests";                         \
    }                                                                                            \
    if (find_mpirun().empty()) {                                                                 \
      GTEST_SKIP() << "mpirun not found: install openmpi-bin (scripts/setup.sh) to run the "     \
                      "multi-process tests";                                                     \
    }                                                                                            \
  } while (0)

// Runs a shell command; stdout and stderr together.
CliRun shell(const std::string& cmd) {
  CliRun r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string cli() { return std::string(ATTNRES_CLI_PATH) + " --threads 1 "; }

std::string write_corpus(const fs::path& dir) {
  std::ofstream f(dir / "corpus.txt");
  for (int i = 0; i < 400; i++) {
    f << "line " << i % 17 << ": the quick brown fox jumps over the lazy dog number " << i % 7
      << ".\n";
  }
  return (dir / "corpus.txt").string();
}

// A small model and run; --batch-size is the global batch whatever the rank count.
std::string train_args(const std::string& data, const fs::path& out, int steps, int batch = 8,
                       int eval_every = 5) {
  return "train --data " + data + " --out " + out.string() + " --steps " + std::to_string(steps) +
         " --n-layer 2 --d-model 32 --n-head 2 --n-kv-head 1 --seq-len 32 --batch-size " +
         std::to_string(batch) + " --grad-accum 2 --lr 3e-3 --warmup 2 --eval-every " +
         std::to_string(eval_every) + " --eval-batches 2 --sample-tokens 0";
}

struct Metrics {
  std::vector<double> loss, val_loss, grad_norm;
};

Metrics read_metrics(const fs::path& file) {
  Metrics m;
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && !j.contains("skipped")) m.loss.push_back(j["loss"].get<double>());
    if (j.contains("grad_norm") && j["grad_norm"].is_number())
      m.grad_norm.push_back(j["grad_norm"].get<double>());
    if (j.contains("val_loss")) m.val_loss.push_back(j["val_loss"].get<double>());
  }
  return m;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rel,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); i++) {
    EXPECT_NEAR(a[i], b[i], rel * std::abs(b[i])) << what << " " << i;
  }
}

double weights_rel_diff(const fs::path& a, const fs::path& b) {
  auto ma = load_model(a.string());
  auto mb = load_model(b.string());
  EXPECT_EQ(ma->layout().total(), mb->layout().total());
  return attnres::testing::rel_diff(ma->params(), mb->params(), ma->layout().total());
}

// Rewinds the run dir/name (`steps` steps, one metrics line per step) to its checkpoint at step
// `at`, as if it had died there, resumes it in one process, and checks that it continues exactly
// as the uninterrupted one-process run dir/one: losses from step at+1 on and final weights.
CliRun resume_on_one_rank(const fs::path& dir, const std::string& name, int at, int steps) {
  char ck[32];
  std::snprintf(ck, sizeof ck, "step_%08d\n", at);
  std::ofstream(dir / name / "latest") << ck;
  fs::remove(dir / name / "model.safetensors");
  const CliRun resumed =
      shell("exec " + cli() + "train --resume --sample-tokens 0 --out " + (dir / name).string());
  EXPECT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_TRUE(contains(resumed.out, "at step " + std::to_string(at))) << resumed.out;
  const Metrics a = read_metrics(dir / "one" / "metrics.jsonl");
  const Metrics b = read_metrics(dir / name / "metrics.jsonl");  // the whole run, then the resumed
  EXPECT_EQ(a.loss.size(), static_cast<size_t>(steps));
  EXPECT_EQ(b.loss.size(), static_cast<size_t>(2 * steps - at));
  if (a.loss.size() == static_cast<size_t>(steps) && b.loss.size() == size_t(2 * steps - at)) {
    expect_close(std::vector<double>(b.loss.begin() + steps, b.loss.end()),
                 std::vector<double>(a.loss.begin() + at, a.loss.end()), 1e-5,
                 "resumed loss after step " + std::to_string(at));
  }
  EXPECT_LT(weights_rel_diff(dir / "one" / "model.safetensors", dir / name / "model.safetensors"),
            1e-5);
  return resumed;
}

// ---------------------------------------------------------------------------------------------

TEST(Dist, SingleProcessCommunicator) {
  dist::SingleCommunicator c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_TRUE(c.is_root());
  float f[3] = {1, 2, 3};
  c.allreduce_sum(f, 3);
  EXPECT_EQ(f[2], 3.0f);
  EXPECT_TRUE(c.any(true));
  EXPECT_FALSE(c.any(false));
  EXPECT_EQ(c.broadcast_string("abc"), "abc");
  EXPECT_NO_THROW(c.require_same(1, "x", "y"));
  try {
    c.send(f, 3, 1, 0);
    ADD_FAILURE() << "send on one process must fail";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "mpirun -np")) << e.what();
  }
  // Not launched by mpirun: one process, whatever the build.
  if (dist::launched_world_size() == 1) {
    EXPECT_EQ(dist::init_world()->size(), 1);
  }
}

TEST(Dist, TrainHelpDocumentsMultiProcessRuns) {
  const CliRun r = attnres::testing::run_cli("train --help");
  EXPECT_EQ(r.code, 0);
  for (const char* s : {"mpirun -np N", "--zero1", "--dist-timeout", "divisible by N", "USR1",
                        "--pipeline N", "--virtual-stages", "--pipeline-comm"}) {
    EXPECT_TRUE(contains(r.out, s)) << s << "\n" << r.out;
  }
}

TEST(Dist, CollectivesAcrossTwoRanks) {
  SKIP_WITHOUT_MPIRUN();
  const CliRun r = shell(mpirun(2) + ATTNRES_DIST_CHECK_PATH + " collectives");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "rank 0 of 2: ok (mpi)")) << r.out;
  EXPECT_TRUE(contains(r.out, "rank 1 of 2: ok (mpi)")) << r.out;
}

TEST(Dist, WatchdogAbortsAHungCollective) {
  SKIP_WITHOUT_MPIRUN();
  const auto t0 = std::chrono::steady_clock::now();
  const CliRun r = shell(mpirun(2) + ATTNRES_DIST_CHECK_PATH + " hang 2");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(s, 30.0) << r.out;  // the sleeping rank would otherwise keep it alive for 120 s
  EXPECT_TRUE(contains(r.out, "waited 2 s in MPI barrier")) << r.out;
  EXPECT_TRUE(contains(r.out, "--dist-timeout")) << r.out;
  EXPECT_FALSE(contains(r.out, "barrier returned")) << r.out;
}

TEST(Dist, TwoRanksMatchOneRank) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const CliRun one = shell("exec " + cli() + train_args(data, dir / "one", 10) + " --log-every 1");
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_TRUE(contains(one.out, "; 1 rank")) << one.out;
  const CliRun two =
      shell(mpirun(2) + cli() + train_args(data, dir / "two", 10) + " --log-every 1");
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_TRUE(contains(two.out, "2 ranks (mpi), 4 sequences per rank")) << two.out;
  // Rank 0 alone reports: one summary, one metrics line per step.
  EXPECT_EQ(two.out.find("done:"), two.out.rfind("done:")) << two.out;
  const Metrics a = read_metrics(dir / "one" / "metrics.jsonl");
  const Metrics b = read_metrics(dir / "two" / "metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 10u);
  ASSERT_EQ(a.val_loss.size(), 2u);
  expect_close(b.loss, a.loss, 1e-5, "training loss at step");
  expect_close(b.val_loss, a.val_loss, 1e-5, "validation loss at evaluation");
  EXPECT_NE(a.loss.front(), a.loss.back());  // it trained
  EXPECT_LT(weights_rel_diff(dir / "one" / "model.safetensors", dir / "two" / "model.safetensors"),
            1e-5);
}

// The overlapped gradient sum, ranks as threads: tensors reported final in any order (padding
// between them never reported) give the sum of the whole buffer, in buckets of any size.
TEST(Dist, GradBucketsSumTheWholeBufferWhateverTheOrder) {
  ParamLayout layout;
  for (int k = 0; k < 9; k++) layout.add("t" + std::to_string(k), {3 + 7 * k}, false);
  const int64_t n = layout.total();
  for (const int64_t bucket : {int64_t{5}, int64_t{16}, int64_t{40}, int64_t{1000}}) {
    auto group = dist::make_local_group(3);
    std::vector<std::vector<float>> got(3), want(3);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 3; r++) {
      ranks.emplace_back([&, r] {
        dist::Communicator& comm = *group[static_cast<size_t>(r)];
        comm.set_timeout(60);
        comm.set_bucket_elems(bucket);
        std::vector<float>& g = got[static_cast<size_t>(r)];
        g = attnres::testing::randn(n, 100 + r, 1.0);
        want[static_cast<size_t>(r)] = g;
        comm.allreduce_sum(want[static_cast<size_t>(r)].data(), n);
        GradBuckets buckets(comm, layout, g.data());
        for (int pass = 0; pass < 2; pass++) {  // a second backward reuses the buckets
          if (pass == 1) {                      // (in place: the buckets hold g's address)
            const std::vector<float> again = attnres::testing::randn(n, 100 + r, 1.0);
            std::copy(again.begin(), again.end(), g.begin());
          }
          buckets.begin();
          for (int k : {8, 2, 5, 7, 0, 1, 6, 4, 3}) {
            const ParamEntry& e = layout.entries()[static_cast<size_t>(k)];
            buckets.ready(e.offset, e.numel);
          }
          buckets.finish();
        }
      });
    }
    for (auto& th : ranks) th.join();
    for (int r = 0; r < 3; r++) {
      EXPECT_TRUE(got[static_cast<size_t>(r)] == want[0]) << "bucket " << bucket << " rank " << r;
    }
  }
}

// split(): groups by color, ranked by key; collectives within a group see only its ranks.
TEST(Dist, SplitFormsGroupsByColorRankedByKey) {
  auto world = dist::make_local_group(4);
  std::vector<std::string> seen(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; r++) {
    ranks.emplace_back([&, r] {
      dist::Communicator& w = *world[static_cast<size_t>(r)];
      w.set_timeout(60);
      auto sub = w.split(r % 2, -r);  // colors 0: {0, 2}, 1: {1, 3}; key -r: reversed order
      double v = r;
      sub->allreduce_sum(&v, 1);
      seen[static_cast<size_t>(r)] = std::to_string(sub->rank()) + "/" +
                                     std::to_string(sub->size()) + " sum " + std::to_string(v);
    });
  }
  for (auto& th : ranks) th.join();
  EXPECT_EQ(seen[0], "1/2 sum 2.000000");
  EXPECT_EQ(seen[2], "0/2 sum 2.000000");
  EXPECT_EQ(seen[1], "1/2 sum 4.000000");
  EXPECT_EQ(seen[3], "0/2 sum 4.000000");
}

// Data parallel with the gradient sum overlapping the backward pass (small buckets, so there are
// many): bit-identical to summing after the backward, on 3 ranks (where the order of the sums
// matters), and to one process up to summation order.
TEST(Dist, OverlappedGradientSumIsBitIdenticalToSummingAfterTheBackward) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const std::string args = " --log-every 1 --grad-bucket-mib 0.01";
  const CliRun one = shell("exec " + cli() + train_args(data, dir / "one", 6, 12) + args);
  ASSERT_EQ(one.code, 0) << one.out;
  for (const char* overlap : {"true", "false"}) {
    const CliRun r = shell(mpirun(3) + cli() + train_args(data, dir / overlap, 6, 12) + args +
                           " --grad-overlap " + overlap);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string when = std::string(overlap) == "true" ? "during" : "after";
    EXPECT_TRUE(contains(r.out, "in 13 bucket(s) of 0.01 MiB " + when + " the backward pass"))
        << r.out;
  }
  using attnres::testing::slurp;
  EXPECT_EQ(read_metrics(dir / "true" / "metrics.jsonl").loss,
            read_metrics(dir / "false" / "metrics.jsonl").loss);
  EXPECT_EQ(read_metrics(dir / "true" / "metrics.jsonl").grad_norm,
            read_metrics(dir / "false" / "metrics.jsonl").grad_norm);
  EXPECT_TRUE(slurp(dir / "true" / "model.safetensors") ==
              slurp(dir / "false" / "model.safetensors"));
  expect_close(read_metrics(dir / "true" / "metrics.jsonl").loss,
               read_metrics(dir / "one" / "metrics.jsonl").loss, 1e-5, "training loss at step");
  EXPECT_LT(weights_rel_diff(dir / "one" / "model.safetensors", dir / "true" / "model.safetensors"),
            1e-5);
}

// The simulated-hosts test bed, tools/netns_hosts.sh.
std::string bed_path() {
  return (fs::path(ATTNRES_FIXTURE_DIR).parent_path().parent_path() / "tools" / "netns_hosts.sh")
      .string();
}

// Every namespace and link the test bed whose command printed "bed <prefix>" made is gone
// (other tests' beds may run meanwhile).
void expect_bed_gone(const std::string& out) {
  const size_t at = out.rfind("bed ar");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string prefix = out.substr(at + 4, out.find_first_of(" \n", at + 4) - (at + 4));
  const CliRun left =
      shell("(ip netns list 2>/dev/null; ip -brief link) | grep -c '^" + prefix + "'");
  EXPECT_EQ(left.out, "0\n") << prefix << "\n" << shell("ip netns list; ip -brief link").out;
}

// Issue 21's test bed: two simulated hosts (network namespaces joined by veth links, shaped to
// 10 Gbit/s), one rank each, TCP only. The same global batch as one process: the same losses and
// weights (to summation order).
TEST(Dist, TwoSimulatedHostsOverTcpMatchOneRank) {
  SKIP_WITHOUT_MPIRUN();
  const std::string bed = bed_path();
  const CliRun can = shell("bash " + bed + " check");
  if (can.code != 0) GTEST_SKIP() << can.out;
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const CliRun one = shell("exec " + cli() + train_args(data, dir / "one", 10) + " --log-every 1");
  ASSERT_EQ(one.code, 0) << one.out;
  const CliRun two = shell(
      "bash " + bed + " run --hosts 2 --rate 10gbit -- sh -c 'echo bed $ATTNRES_NETNS_PREFIX; " +
      mpirun(2) + "$ATTNRES_MPI_NET --host $ATTNRES_HOSTS " + cli() +
      train_args(data, dir / "two", 10) + " --log-every 1'");
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_TRUE(contains(two.out, "2 ranks (mpi), 4 sequences per rank")) << two.out;
  const Metrics a = read_metrics(dir / "one" / "metrics.jsonl");
  const Metrics b = read_metrics(dir / "two" / "metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 10u);
  expect_close(b.loss, a.loss, 1e-5, "training loss at step");
  expect_close(b.val_loss, a.val_loss, 1e-5, "validation loss at evaluation");
  EXPECT_LT(weights_rel_diff(dir / "one" / "model.safetensors", dir / "two" / "model.safetensors"),
            1e-5);
  expect_bed_gone(two.out);
}

// Issue 21: a simulated host that dies (every process on it killed) or is cut off the network
// (its link down: a partition) during a 2-host run. The job ends within 30 s, the watchdog names
// the wait for a cut-off host, and the last checkpoint loads.
class DistHostLoss : public ::testing::TestWithParam<const char*> {};

TEST_P(DistHostLoss, EndsTheJobWithinThirtySecondsAndKeepsTheCheckpoint) {
  SKIP_WITHOUT_MPIRUN();
  const std::string bed = bed_path();
  const CliRun can = shell("bash " + bed + " check");
  if (can.code != 0) GTEST_SKIP() << can.out;
  const std::string how = GetParam();
  TempDir td;
  const fs::path dir = td.path, out = dir / "run", log = dir / "log";
  const std::string data = write_corpus(dir);
  // Inside the bed: the job in the background; at its first checkpoint, host 1 is lost; then
  // the seconds until the job ended (or "hung").
  std::ofstream(dir / "lose.sh")
      << mpirun(2) << "$ATTNRES_MPI_NET --host $ATTNRES_HOSTS " << cli()
      << train_args(data, out, 1000000, 8, 20) << " --save-every 20 --dist-timeout 5 > "
      << log.string() << " 2>&1 &\n"
      << "job=$!\n"
      << "for i in $(seq 300); do [ -e " << (out / "latest").string()
      << " ] && break; sleep 0.1; done\n"
      << "sleep 0.5; t0=$(date +%s%N)\n"
      << "bash " << bed << " " << how << " 1\n"
      << "for i in $(seq 450); do kill -0 $job 2>/dev/null || break; sleep 0.1; done\n"
      << "if kill -0 $job 2>/dev/null; then echo hung; kill -9 $job; fi\n"
      << "echo ended after $(( ($(date +%s%N) - t0) / 1000000 )) ms\n"
      << "echo bed $ATTNRES_NETNS_PREFIX\n";
  const CliRun r = shell("bash " + bed + " run --hosts 2 -- bash " + (dir / "lose.sh").string());
  const std::string job_log = attnres::testing::slurp(log);
  ASSERT_FALSE(contains(r.out, "hung")) << r.out << job_log;
  const size_t at = r.out.find("ended after ");
  ASSERT_NE(at, std::string::npos) << r.out << job_log;
  const double ms = std::atof(r.out.c_str() + at + 12);
  std::printf("host %s: the job ended %.1f s after\n", how == "cut" ? "cut off" : "killed",
              ms / 1000);
  EXPECT_LT(ms, 30000) << job_log;
  if (how == "cut") {
    EXPECT_TRUE(contains(job_log,
                         "for the other ranks: one of them died, hangs or cannot be "
                         "reached"))
        << job_log;
  }
  std::string latest;
  std::ifstream(out / "latest") >> latest;
  ASSERT_FALSE(latest.empty());
  Metadata meta;
  auto m = load_model((out / "checkpoints" / latest / "model.safetensors").string(), &meta);
  EXPECT_GT(m->num_params(), 0);
  expect_bed_gone(r.out);
}

INSTANTIATE_TEST_SUITE_P(Ways, DistHostLoss, ::testing::Values("kill", "cut"),
                         [](const auto& way) { return std::string(way.param); });

// Data parallel on a device backend (cuda-host: the CUDA backend's code on host memory): the
// gradients go through the device reducer, directly or staged through host buffers as on GPUs
// without NCCL, and the run matches one rank on that device.
TEST(Dist, TwoRanksOnADeviceMatchOneRank) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const std::string dev = " --device cuda-host --residual block --log-every 1";
  const CliRun one = shell("exec " + cli() + train_args(data, dir / "one", 6) + dev);
  ASSERT_EQ(one.code, 0) << one.out;
  const CliRun two = shell(mpirun(2) + cli() + train_args(data, dir / "two", 6) + dev);
  ASSERT_EQ(two.code, 0) << two.out;
  EXPECT_TRUE(contains(two.out, "gradients: summed over the ranks by direct")) << two.out;
  ::setenv("ATTNRES_DEVICE_REDUCE", "staged", 1);  // mpirun passes it on to the ranks
  const CliRun staged = shell(mpirun(2) + "-x ATTNRES_DEVICE_REDUCE " + cli() +
                              train_args(data, dir / "staged", 6) + dev);
  ::unsetenv("ATTNRES_DEVICE_REDUCE");
  ASSERT_EQ(staged.code, 0) << staged.out;
  EXPECT_TRUE(contains(staged.out, "gradients: summed over the ranks by staged")) << staged.out;
  // The device step's graphs, replayed on each rank with the gradients summed between them.
  const CliRun graphs =
      shell(mpirun(2) + cli() + train_args(data, dir / "graphs", 6) + dev + " --cuda-graphs");
  ASSERT_EQ(graphs.code, 0) << graphs.out;
  EXPECT_TRUE(contains(graphs.out, "CUDA graphs: ")) << graphs.out;
  const Metrics a = read_metrics(dir / "one" / "metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 6u);
  for (const char* run : {"two", "staged", "graphs"}) {
    const Metrics b = read_metrics(dir / run / "metrics.jsonl");
    expect_close(b.loss, a.loss, 1e-5, std::string(run) + ": training loss at step");
    // (AdamW barely sees a wrong gradient scale: the norm does)
    expect_close(b.grad_norm, a.grad_norm, 1e-4, std::string(run) + ": gradient norm at step");
    expect_close(b.val_loss, a.val_loss, 1e-5, std::string(run) + ": validation loss");
    EXPECT_LT(weights_rel_diff(dir / "one" / "model.safetensors", dir / run / "model.safetensors"),
              1e-5);
  }
}

TEST(Dist, BatchNotDivisibleByRanksIsAClearError) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const auto t0 = std::chrono::steady_clock::now();
  const CliRun r = shell(mpirun(2) + cli() + train_args(data, dir / "run", 3, 7));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(contains(r.out, "--batch-size 7 is not divisible by the 2 ranks")) << r.out;
  EXPECT_TRUE(contains(r.out, "use a multiple of 2 (e.g. 8)")) << r.out;
  EXPECT_LT(s, 30.0);
}

// --overwrite on several ranks prepares the new run's tokenizer in a staging directory that every
// rank reads (it was written over the old run's in --out: a job killed while preparing its data
// left the old model with the new tokenizer; seventeenth hostile pass), and moves it in at the
// start; the new run's checkpoints and final model read it.
TEST(Dist, OverwriteOnTwoRanksStagesItsTokenizer) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const fs::path out = dir / "run";
  CliRun r =
      shell(mpirun(2) + cli() + train_args(data, out, 2) + " --tokenizer bpe --vocab-size 300");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string old_tok = attnres::testing::slurp(out / "tokenizer.model");
  r = shell(mpirun(2) + cli() + train_args(data, out, 2) +
            " --tokenizer bpe --vocab-size 320 --overwrite");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(attnres::testing::slurp(out / "tokenizer.model"), old_tok);
  for (const auto& e : fs::directory_iterator(out)) {
    EXPECT_EQ(e.path().filename().string().find(".overwrite.tmp."), std::string::npos) << e.path();
  }
  r = shell(cli() + "eval --model " + (out / "model.safetensors").string() + " --batches 1");
  EXPECT_EQ(r.code, 0) << r.out;
  r = shell(cli() + "eval --model " +
            (out / "checkpoints" / "step_00000002" / "model.safetensors").string() +
            " --batches 1");
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(Dist, CheckpointFromTwoRanksResumesOnOne) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const std::string save = " --save-every 10 --keep-checkpoints 3 --log-every 1";
  const CliRun one = shell("exec " + cli() + train_args(data, dir / "one", 20) + save);
  ASSERT_EQ(one.code, 0) << one.out;
  const CliRun two = shell(mpirun(2) + cli() + train_args(data, dir / "two", 20) + save);
  ASSERT_EQ(two.code, 0) << two.out;

  // The step-10 checkpoints do not depend on the rank count: same tensors, same metadata.
  const fs::path c1 = dir / "one" / "checkpoints" / "step_00000010";
  const fs::path c2 = dir / "two" / "checkpoints" / "step_00000010";
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    auto r1 = SafetensorsReader::open((c1 / f).string());
    auto r2 = SafetensorsReader::open((c2 / f).string());
    EXPECT_EQ(r1.names(), r2.names()) << f;
    // (the data checksum differs with the bits, which differ up to summation order: below)
    auto m1 = r1.metadata(), m2 = r2.metadata();
    EXPECT_EQ(m1.erase(kDataChecksumKey), 1u) << f;
    EXPECT_EQ(m2.erase(kDataChecksumKey), 1u) << f;
    EXPECT_EQ(m1, m2) << f;
  }
  EXPECT_LT(weights_rel_diff(c1 / "model.safetensors", c2 / "model.safetensors"), 1e-5);

  // Resume the 2-rank run from its step-10 checkpoint on 1 rank, as if it had died after step 10.
  const CliRun resumed = resume_on_one_rank(dir, "two", 10, 20);
  EXPECT_TRUE(contains(resumed.out, "; 1 rank")) << resumed.out;
}

TEST(Dist, Zero1IsBitIdenticalToReplicatedAndResumes) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const std::string save = " --save-every 10 --keep-checkpoints 3 --log-every 1";
  const CliRun rep = shell(mpirun(2) + cli() + train_args(data, dir / "rep", 20) + save);
  ASSERT_EQ(rep.code, 0) << rep.out;
  const CliRun z = shell(mpirun(2) + cli() + train_args(data, dir / "z", 20) + save + " --zero1");
  ASSERT_EQ(z.code, 0) << z.out;
  EXPECT_TRUE(contains(z.out, "AdamW state sharded (ZeRO-1)")) << z.out;
  // Each rank updates its shard with the same arithmetic: identical bytes, including the
  // optimizer state rank 0 gathers for the checkpoint.
  using attnres::testing::slurp;
  EXPECT_EQ(read_metrics(dir / "z" / "metrics.jsonl").loss,
            read_metrics(dir / "rep" / "metrics.jsonl").loss);
  EXPECT_TRUE(slurp(dir / "z" / "model.safetensors") == slurp(dir / "rep" / "model.safetensors"));
  for (const char* step : {"step_00000010", "step_00000020"}) {
    const fs::path f = fs::path("checkpoints") / step / "optimizer.safetensors";
    EXPECT_TRUE(slurp(dir / "z" / f) == slurp(dir / "rep" / f)) << step;
  }
  // Resume the sharded run from step 10: each rank takes its shard of the saved moments.
  std::ofstream(dir / "z" / "latest") << "step_00000010\n";
  fs::remove(dir / "z" / "model.safetensors");
  const CliRun zr = shell(mpirun(2) + cli() + "train --resume --zero1 --sample-tokens 0 --out " +
                          (dir / "z").string());
  ASSERT_EQ(zr.code, 0) << zr.out;
  EXPECT_TRUE(contains(zr.out, "at step 10")) << zr.out;
  EXPECT_TRUE(slurp(dir / "z" / "model.safetensors") == slurp(dir / "rep" / "model.safetensors"));
}

// ZeRO-1 reduce-scatters the gradient buckets (each rank receives its shard's sums), during the
// backward or after it: with many small buckets, bit-identical to the replicated run on 2 ranks
// (where every sum is a + b), overlap on and off bit-identical on 3, and close to replicated there
// (MPI may add 3 ranks' values in another order in a reduce-scatter than in an all-reduce).
TEST(Dist, Zero1ReduceScattersInBuckets) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const std::string args = " --log-every 1 --grad-bucket-mib 0.01";
  auto run = [&](int ranks, const std::string& name, const std::string& flags) {
    const CliRun r =
        shell(mpirun(ranks) + cli() + train_args(data, dir / name, 6, 12) + args + flags);
    EXPECT_EQ(r.code, 0) << r.out;
    return read_metrics(dir / name / "metrics.jsonl");
  };
  using attnres::testing::slurp;
  const Metrics rep2 = run(2, "rep2", ""), z2 = run(2, "z2", " --zero1");
  EXPECT_EQ(z2.loss, rep2.loss);
  EXPECT_EQ(z2.grad_norm, rep2.grad_norm);
  EXPECT_TRUE(slurp(dir / "z2" / "model.safetensors") == slurp(dir / "rep2" / "model.safetensors"));
  const Metrics rep3 = run(3, "rep3", ""), on = run(3, "on", " --zero1"),
                off = run(3, "off", " --zero1 --grad-overlap false");
  EXPECT_EQ(on.loss, off.loss);
  EXPECT_EQ(on.grad_norm, off.grad_norm);
  EXPECT_TRUE(slurp(dir / "on" / "model.safetensors") == slurp(dir / "off" / "model.safetensors"));
  expect_close(on.loss, rep3.loss, 1e-5, "3 ranks, ZeRO-1 vs replicated: loss at step");
  expect_close(on.grad_norm, rep3.grad_norm, 1e-5, "3 ranks, ZeRO-1 vs replicated: norm at step");
  EXPECT_LT(weights_rel_diff(dir / "rep3" / "model.safetensors", dir / "on" / "model.safetensors"),
            1e-5);
}

// 27th hostile pass: the gradient bucket size decides the order of the sums on 3 or more ranks
// (and the collectives every rank calls): ranks started with other sizes (or one overlapping,
// one not) are refused like other differing options (they crashed inside MPI or corrupted the
// heap), and a plain --resume continues with the run's recorded size (it took the default and
// differed from the uninterrupted run without a word); another size given is noted.
TEST(Dist, GradientBucketsAreComparedRecordedAndResumed) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  // (28th pass: --overwrite on one rank only made the ranks call different collectives)
  for (const char* other : {"--grad-bucket-mib 0.02", "--grad-bucket-mib 0.01 --grad-overlap false",
                            "--grad-bucket-mib 0.01 --overwrite"}) {
    const std::string base = cli() + train_args(data, dir / "mix", 2);
    const CliRun r = shell("exec " + find_mpirun() + " --oversubscribe --allow-run-as-root -np 1 " +
                           base + " --grad-bucket-mib 0.01 : -np 1 " + base + " " + other);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "the training options of rank(s) 1 differ from rank 0's"))
        << other << "\n"
        << r.out;
  }
  const std::string run = train_args(data, dir / "r", 6, 12) +
                          " --grad-bucket-mib 0.01 --save-every 3 --keep-checkpoints 3";
  const CliRun whole = shell(mpirun(3) + cli() + run);
  ASSERT_EQ(whole.code, 0) << whole.out;
  using attnres::testing::slurp;
  const std::string uninterrupted = slurp(dir / "r" / "model.safetensors");
  std::ofstream(dir / "r" / "latest") << "step_00000003\n";
  fs::remove(dir / "r" / "model.safetensors");
  const std::string resume = "train --resume --sample-tokens 0 --out " + (dir / "r").string();
  const CliRun plain = shell(mpirun(3) + cli() + resume);
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_FALSE(contains(plain.out, "note: the run trained as")) << plain.out;
  EXPECT_TRUE(slurp(dir / "r" / "model.safetensors") == uninterrupted);
  std::ofstream(dir / "r" / "latest") << "step_00000003\n";
  const CliRun other = shell(mpirun(3) + cli() + resume + " --grad-bucket-mib 16");
  ASSERT_EQ(other.code, 0) << other.out;
  EXPECT_TRUE(contains(other.out, "gradient buckets of 0.009998321533 MiB and continues as"))
      << other.out;
  EXPECT_TRUE(contains(other.out, "--grad-bucket-mib 0.009998321533 continues it exactly"))
      << other.out;
}

// Eighteenth hostile pass: at each save of a --zero1 run, rank 0 gathers the whole AdamW state,
// which the rehearsal before an --overwrite's claim did not cover: under a memory limit that fit
// the training, the old run was deleted and the first save ran out of memory (both lost). Under
// this limit the job either trains and saves or leaves the old run as it was.
TEST(Dist, Zero1OverwriteNeverLosesTheOldRunToTheSavesGather) {
#if defined(__SANITIZE_ADDRESS__) || ATTNRES_HAS_ASAN
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space";
#endif
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const fs::path run = dir / "run";
  ASSERT_EQ(shell(cli() + train_args(data, run, 4) + " --save-every 2").code, 0);
  using attnres::testing::slurp;
  const std::string weights = slurp(run / "model.safetensors");
  const CliRun r = shell("ulimit -v 600000; " + mpirun(2) + cli() + "train --data " + data +
                         " --out " + run.string() +
                         " --overwrite --zero1 --d-model 512 --n-layer 6 --n-head 8 --seq-len 16"
                         " --batch-size 2 --steps 3 --save-every 1 --eval-every 0"
                         " --eval-batches 1 --sample-tokens 0");
  if (r.code == 0) {  // (it fit on this machine: a whole new run in its place)
    EXPECT_TRUE(fs::exists(run / "checkpoints" / "step_00000003" / "optimizer.safetensors"));
    return;
  }
  EXPECT_TRUE(contains(r.out, "rank 0 gathers to save a --zero1 run")) << r.out;
  EXPECT_FALSE(contains(r.out, "deleted the previous run")) << r.out;
  EXPECT_TRUE(slurp(run / "model.safetensors") == weights);
  EXPECT_EQ(slurp(run / "latest"), "step_00000004\n");
}

// An mpirun job in the background, its output in a log file.
class Job {
 public:
  // `cmd` must exec mpirun, so the pid is mpirun's.
  Job(const std::string& cmd, const fs::path& log) : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      const std::string full = cmd + " >" + log.string() + " 2>&1";
      ::execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Job() {
    if (!done_ && pid_ > 0) {
      ::kill(-pid_, SIGKILL);
      wait(10);
    }
  }
  pid_t pid() const { return pid_; }
  std::string log() const { return attnres::testing::slurp(log_); }
  // Waits up to limit_s for mpirun to exit; true if it did (status() is then valid).
  bool wait(double limit_s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (!done_) {
      done_ = ::waitpid(pid_, &status_, WNOHANG) == pid_;
      if (done_ || seconds_since(t0) > limit_s) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return done_;
  }
  // Polls until the run in `out` has a checkpoint at step >= step; false on timeout or exit.
  bool wait_for_checkpoint(const fs::path& out, int64_t step, double limit_s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (seconds_since(t0) < limit_s && !wait(0)) {
      const std::string latest = attnres::testing::slurp(out / "latest");  // "step_%08d\n"
      if (latest.size() > 5 && std::atoll(latest.c_str() + 5) >= step) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  int status() const { return status_; }
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  int status_ = 0;
  bool done_ = false;
};

// The pid of the process launched by `parent` (mpirun) as MPI rank `rank`, or -1.
pid_t find_rank(pid_t parent, int rank) {
  const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = attnres::testing::slurp(e.path() / "stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) != 2 || ppid != parent) {
      continue;
    }
    const std::string env = attnres::testing::slurp(e.path() / "environ");
    size_t pos = 0;
    while (pos < env.size()) {
      const size_t end = std::min(env.find('\0', pos), env.size());
      if (env.compare(pos, end - pos, want) == 0) return static_cast<pid_t>(std::stoi(name));
      pos = end + 1;
    }
  }
  return -1;
}

// A long 2-rank run that checkpoints every 3 steps; data parallel, or one pipeline.
std::string long_run(const std::string& data, const fs::path& out, bool pipeline = false) {
  return mpirun(2) + cli() + train_args(data, out, 1000000, 8, 0) +
         " --save-every 3 --log-every 50" +
         (pipeline ? " --residual block --block-size 2 --pipeline 2 --virtual-stages 1" : "");
}

// The newest complete checkpoint of `out` loads (weights and optimizer); returns its step.
int64_t load_latest(const fs::path& out) {
  std::string latest = attnres::testing::slurp(out / "latest");
  while (!latest.empty() && latest.back() == '\n') latest.pop_back();
  EXPECT_FALSE(latest.empty());
  const fs::path ck = out / "checkpoints" / latest;
  Metadata meta;
  std::unique_ptr<Model> model;
  EXPECT_NO_THROW(model = load_model((ck / "model.safetensors").string(), &meta)) << ck;
  if (!model) return -1;
  AdamW opt(model->layout(), AdamWConfig{});
  EXPECT_NO_THROW(load_optimizer((ck / "optimizer.safetensors").string(), *model, opt));
  EXPECT_EQ(opt.steps_taken(), std::stoll(meta.at("step")));
  return opt.steps_taken();
}

class DistKill : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(DistKill, KilledRankEndsTheJobAndLeavesACheckpoint) {
  SKIP_WITHOUT_MPIRUN();
  const auto [victim, pipeline] = GetParam();
  TempDir td;
  const fs::path dir = td.path;
  const fs::path out = dir / "run";
  Job job(long_run(write_corpus(dir), out, pipeline), dir / "log.txt");
  ASSERT_TRUE(job.wait_for_checkpoint(out, 6, 60)) << "no checkpoint within 60 s:\n" << job.log();
  const pid_t pid = find_rank(job.pid(), victim);
  ASSERT_GT(pid, 0) << "rank " << victim << "'s process not found among mpirun's children";
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(job.wait(30)) << "the job still ran 30 s after rank " << victim << " was killed:\n"
                            << job.log();
  const int st = job.status();
  EXPECT_FALSE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << job.log();
  std::printf("job ended %.1f s after rank %d was killed (mpirun status %d)\n",
              Job::seconds_since(t0), victim, WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the other rank go
  EXPECT_GE(load_latest(out), 6);
}

TEST(Dist, SigusrToMpirunStopsEveryRankWithACheckpoint) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const fs::path out = dir / "run";
  Job job(long_run(write_corpus(dir), out), dir / "log.txt");
  ASSERT_TRUE(job.wait_for_checkpoint(out, 3, 60)) << "no checkpoint within 60 s:\n" << job.log();
  ASSERT_EQ(::kill(job.pid(), SIGUSR1), 0);  // mpirun forwards it to every rank
  ASSERT_TRUE(job.wait(30)) << job.log();
  EXPECT_TRUE(WIFEXITED(job.status()) && WEXITSTATUS(job.status()) == 0) << job.log();
  const std::string log = job.log();
  const size_t at = log.find("stopped at step ");
  ASSERT_NE(at, std::string::npos) << log;
  const int64_t stopped = std::atoll(log.c_str() + at + 16);
  EXPECT_EQ(load_latest(out), stopped);  // the stop wrote a checkpoint at that very step
  // (the command it prints runs the job again: it lacked `mpirun -np 2`; sixteenth pass)
  // (and the threads of each rank, which order the CPU's sums too; nineteenth pass)
  EXPECT_NE(log.find("continue with: mpirun -np 2 attnres --threads 1 train --resume --out " +
                     out.string()),
            std::string::npos)
      << log;
}

// Ranks 0 and 1, data parallel and pipeline (where the survivor waits in a stage transfer).
INSTANTIATE_TEST_SUITE_P(RankAndMode, DistKill,
                         ::testing::Combine(::testing::Values(0, 1), ::testing::Bool()));

// --------------------------------------------------------------------------- pipeline (SPEC 5)

// Block AttnRes, 8 sublayers in blocks of 2: up to 4 stages; 4 micro-batches per step.
std::string pipe_args(const std::string& data, const fs::path& out, int steps) {
  return "train --data " + data + " --out " + out.string() + " --steps " + std::to_string(steps) +
         " --n-layer 4 --d-model 32 --n-head 2 --n-kv-head 1 --seq-len 32 --batch-size 4"
         " --grad-accum 4 --lr 3e-3 --warmup 2 --eval-every 4 --eval-batches 3 --sample-tokens 0"
         " --residual block --block-size 2 --log-every 1";
}

// "sent 2.00 MiB per step ... (cached); the naive scheme would send 4.50 MiB" -> {2.00, 4.50}
std::pair<double, double> pipeline_bytes(const std::string& out) {
  const size_t at = out.find("pipeline: sent ");
  if (at == std::string::npos) return {-1, -1};
  const double sent = std::atof(out.c_str() + at + 15);
  const size_t w = out.find("would send ", at);
  return {sent, w == std::string::npos ? -1 : std::atof(out.c_str() + w + 11)};
}

// The pipeline executor over real MPI (isend/recv/test between processes): gradients equal one
// process for V = 1, 2 in both schemes; 4 stages of one block: cached sends 4 of naive's 9.
TEST(Dist, PipelineGradientsOverMpiMatchOneProcess) {
  SKIP_WITHOUT_MPIRUN();
  std::map<std::string, long long> sent;
  for (const char* v : {"1", "2"}) {
    for (const char* scheme : {"cached", "naive"}) {
      const CliRun r = shell(mpirun(2) + ATTNRES_DIST_CHECK_PATH + " pipeline " + v + " " + scheme);
      EXPECT_EQ(r.code, 0) << r.out;
      long long total = 0;
      for (const char* rank : {"rank 0: pipeline ok, ", "rank 1: pipeline ok, "}) {
        const size_t at = r.out.find(rank);
        ASSERT_NE(at, std::string::npos) << r.out;
        total += std::atoll(r.out.c_str() + at + std::strlen(rank));
      }
      sent[std::string(v) + scheme] = total;
    }
  }
  EXPECT_EQ(sent["1cached"], sent["1naive"]);
  EXPECT_EQ(sent["2naive"] * 4, sent["2cached"] * 9);
}

TEST(Dist, PipelineMatchesOneRankAndCachedSendsLess) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const CliRun one = shell("exec " + cli() + pipe_args(data, dir / "one", 8));
  ASSERT_EQ(one.code, 0) << one.out;
  const Metrics a = read_metrics(dir / "one" / "metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 8u);
  EXPECT_NE(a.loss.front(), a.loss.back());  // it trained
  struct Case {
    const char* name;
    std::string flags;
  };
  std::map<std::string, std::pair<double, double>> bytes;
  for (const Case& c :
       {Case{"v1", " --pipeline 2"}, Case{"v2", " --pipeline 2 --virtual-stages 2"},
        Case{"v2naive", " --pipeline 2 --virtual-stages 2 --pipeline-comm naive"}}) {
    SCOPED_TRACE(c.name);
    const CliRun r = shell(mpirun(2) + cli() + pipe_args(data, dir / c.name, 8) + c.flags);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "2 ranks (mpi), pipeline parallel")) << r.out;
    EXPECT_TRUE(contains(r.out, "4 micro-batch(es) per step")) << r.out;
    EXPECT_TRUE(contains(r.out, "peak memory rank 0 ") && contains(r.out, " / rank 1 "))
        << r.out;  // every rank's peak, in rank 0's summary
    EXPECT_EQ(r.out.find("done:"), r.out.rfind("done:")) << r.out;
    bytes[c.name] = pipeline_bytes(r.out);
    const Metrics b = read_metrics(dir / c.name / "metrics.jsonl");
    expect_close(b.loss, a.loss, 1e-5, "training loss at step");
    expect_close(b.val_loss, a.val_loss, 1e-5, "validation loss");
    EXPECT_LT(
        weights_rel_diff(dir / "one" / "model.safetensors", dir / c.name / "model.safetensors"),
        1e-5);
  }
  // 2 x 2 stages of one block each, naive: 2 + 3 + 4 = 9 sources per micro-batch and direction;
  // cached: 2 + 1 + 1 = 4. One stage per rank: nothing to cache, both send the same.
  EXPECT_GT(bytes["v2"].first, 0);
  EXPECT_NEAR(bytes["v2naive"].first / bytes["v2"].first, 9.0 / 4.0, 0.01);
  EXPECT_EQ(bytes["v2"].second, bytes["v2naive"].first);  // the prediction printed beside it
  EXPECT_EQ(bytes["v1"].first, bytes["v1"].second);
}

// Pipeline x data parallel: 4 ranks as 2 pipelines of 2 stages, each pipeline on half of every
// micro-batch, the gradients summed over all 4: the one-process run's losses and weights; its
// checkpoint resumes on one process.
TEST(Dist, PipelineTimesDataParallelMatchesOneProcess) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const CliRun one = shell("exec " + cli() + pipe_args(data, dir / "one", 8));
  ASSERT_EQ(one.code, 0) << one.out;
  const CliRun r =
      shell(mpirun(4) + cli() + pipe_args(data, dir / "pp", 8) + " --pipeline 2 --save-every 4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "4 ranks (mpi), 2 data-parallel pipelines")) << r.out;
  EXPECT_TRUE(contains(r.out, "2 data-parallel pipelines of 2 sequences each")) << r.out;
  const Metrics a = read_metrics(dir / "one" / "metrics.jsonl");
  const Metrics b = read_metrics(dir / "pp" / "metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 8u);
  expect_close(b.loss, a.loss, 1e-5, "training loss at step");
  expect_close(b.val_loss, a.val_loss, 1e-5, "validation loss");
  EXPECT_LT(weights_rel_diff(dir / "one" / "model.safetensors", dir / "pp" / "model.safetensors"),
            1e-5);
  resume_on_one_rank(dir, "pp", 4, 8);
  // 3 ranks do not form pipelines of 2; the error says what would.
  const CliRun odd = shell(mpirun(3) + cli() + pipe_args(data, dir / "odd", 2) + " --pipeline 2");
  EXPECT_NE(odd.code, 0);
  EXPECT_TRUE(contains(odd.out, "not a multiple of it")) << odd.out;
}

TEST(Dist, PipelineCheckpointResumesOnOneRank) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const std::string save = " --save-every 4 --keep-checkpoints 3";
  const CliRun one = shell("exec " + cli() + pipe_args(data, dir / "one", 8) + save);
  ASSERT_EQ(one.code, 0) << one.out;
  const CliRun pp = shell(mpirun(2) + cli() + pipe_args(data, dir / "pp", 8) + save +
                          " --pipeline 2 --virtual-stages 2");
  ASSERT_EQ(pp.code, 0) << pp.out;
  // A plain --resume on as many ranks continues the pipeline it ran, bit for bit (it ran
  // data-parallel, and differed in the last bits; fifteenth hostile pass).
  fs::copy(dir / "pp", dir / "pp2", fs::copy_options::recursive);
  std::ofstream(dir / "pp2" / "latest") << "step_00000004\n";
  fs::remove(dir / "pp2" / "model.safetensors");
  const CliRun again =
      shell(mpirun(2) + cli() + "train --resume --sample-tokens 0 --out " + (dir / "pp2").string());
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_FALSE(contains(again.out, "continues as")) << again.out;
  auto a = load_model((dir / "pp" / "model.safetensors").string());
  auto b = load_model((dir / "pp2" / "model.safetensors").string());
  EXPECT_EQ(0, std::memcmp(a->params(), b->params(), sizeof(float) * a->layout().total()));
  // One layout option changes that one only (it dropped the whole recorded layout), and the
  // communication scheme, which orders the sums too, is noted (sixteenth hostile pass).
  fs::copy(dir / "pp", dir / "pp3", fs::copy_options::recursive);
  std::ofstream(dir / "pp3" / "latest") << "step_00000004\n";
  const CliRun naive = shell(mpirun(2) + cli() + "train --resume --sample-tokens 0 --out " +
                             (dir / "pp3").string() + " --pipeline-comm naive");
  ASSERT_EQ(naive.code, 0) << naive.out;
  EXPECT_TRUE(contains(naive.out,
                       "continues as a pipeline of 2 ranks x 2 virtual stages (naive "
                       "communication)"))
      << naive.out;
  // On one rank it continues closely, and says why not exactly.
  const CliRun one_rank = resume_on_one_rank(dir, "pp", 4, 8);
  EXPECT_TRUE(contains(one_rank.out,
                       "trained as a pipeline of 2 ranks x 2 virtual stages and "
                       "continues as 1 process"))
      << one_rank.out;
}

TEST(Dist, PipelineMisuseIsAClearError) {
  SKIP_WITHOUT_MPIRUN();
  TempDir td;
  const fs::path dir = td.path;
  const std::string data = write_corpus(dir);
  const CliRun ranks = shell(mpirun(2) + cli() + pipe_args(data, dir / "a", 2) + " --pipeline 3");
  EXPECT_EQ(ranks.code, 1) << ranks.out;
  EXPECT_TRUE(contains(ranks.out, "use mpirun -np 3")) << ranks.out;
  const CliRun mode = shell(mpirun(2) + cli() + train_args(data, dir / "b", 2) + " --pipeline 2");
  EXPECT_EQ(mode.code, 1) << mode.out;
  EXPECT_TRUE(contains(mode.out, "use --residual block or full")) << mode.out;
  const CliRun split =
      shell(mpirun(2) + cli() + pipe_args(data, dir / "c", 2) + " --pipeline 2 --virtual-stages 4");
  EXPECT_EQ(split.code, 1) << split.out;
  EXPECT_TRUE(contains(split.out, "use fewer ranks or virtual stages")) << split.out;
  const CliRun single = shell("exec " + cli() + pipe_args(data, dir / "d", 2) + " --pipeline 2");
  EXPECT_EQ(single.code, 1) << single.out;
  EXPECT_TRUE(contains(single.out, "use mpirun -np 2")) << single.out;
}

}  // namespace
