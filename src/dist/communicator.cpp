// The backend-independent part of attnres/dist.hpp, the single-process communicator, and
// init_world() for builds without MPI.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attnres/dist.hpp"
#include "attnres/error.hpp"

namespace attnres::dist {

bool Communicator::any(bool flag) {
  if (size() == 1) return flag;
  double v = flag ? 1.0 : 0.0;
  allreduce_sum(&v, 1);
  return v > 0.0;
}

std::string Communicator::broadcast_string(const std::string& s, int root) {
  if (size() == 1) return s;
  uint64_t n = s.size();
  broadcast(&n, sizeof n, root);
  std::string out = rank() == root ? s : std::string(n, '\0');
  if (n > 0) broadcast(out.data(), static_cast<int64_t>(n), root);
  return out;
}

void Communicator::require_same(uint64_t value, const std::string& what, const std::string& fix) {
  if (size() == 1) return;
  uint64_t root_value = value;
  broadcast(&root_value, sizeof root_value, 0);
  std::vector<double> differs(static_cast<size_t>(size()), 0.0);
  differs[static_cast<size_t>(rank())] = value == root_value ? 0.0 : 1.0;
  allreduce_sum(differs.data(), size());
  std::string ranks;
  for (int r = 0; r < size(); r++) {
    if (differs[static_cast<size_t>(r)] > 0)
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!ranks.empty()) {
    throw Error("the " + what + " of rank(s) " + ranks + " differ from rank 0's; " + fix);
  }
}

void SingleCommunicator::send(const float*, int64_t, int peer, int) {
  throw Error("cannot send to rank " + std::to_string(peer) +
              ": this is a single-process run; launch with mpirun -np N for N ranks");
}

void SingleCommunicator::recv(float*, int64_t, int peer, int) {
  throw Error("cannot receive from rank " + std::to_string(peer) +
              ": this is a single-process run; launch with mpirun -np N for N ranks");
}

void SingleCommunicator::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

int local_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID",
                          "PMIX_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"}) {
    if (const char* v = std::getenv(var)) {
      const int n = std::atoi(v);
      if (n >= 0) return n;
    }
  }
  return 0;
}

int launched_world_size() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* v = std::getenv(var)) {
      const int n = std::atoi(v);
      if (n >= 1) return n;
    }
  }
  return 1;
}

#ifndef ATTNRES_WITH_MPI
bool mpi_compiled() { return false; }

std::unique_ptr<Communicator> init_world() {
  const int n = launched_world_size();
  check(n == 1, "this process was launched as one of " + std::to_string(n) +
                    " ranks, but attnres was built without MPI, so the ranks could not cooperate; "
                    "install libopenmpi-dev (scripts/setup.sh) and rebuild with -DATTNRES_MPI=ON, "
                    "or run without mpirun");
  return std::make_unique<SingleCommunicator>();
}
#endif

}  // namespace attnres::dist
