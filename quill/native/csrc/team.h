// The team's barrier, shared by the native decode step (step.cpp) and the expert group (moe.cpp):
// both run one OpenMP parallel region whose threads walk the same ops and meet between them.
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <atomic>

namespace quill {

// A spinning barrier of the team.  libgomp's own barrier sleeps on a futex as soon as it
// throttles its spinning -- which it does whenever the process holds more OpenMP threads than
// CPUs, e.g. once a second thread has started parallel work (a model loaded on one thread and
// stepped on another): ~420 barriers per token then cost ~10 ms.  This one spins (pausing),
// and yields the CPU only after a long wait, so an oversubscribed machine still makes progress.
// A team larger than the CPUs it may run on (taskset, a cpuset, --threads above them) yields at
// once: a spinning waiter would only hold the CPU the thread it waits for needs (a 2-thread team
// on one allowed CPU spent 6x longer per token spinning).
class SpinBarrier {
 public:
  void set_size(int n) {
    n_ = n;
    cpu_set_t set;
    const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : n;
    spin_limit_ = n > cpus ? 0 : (1 << 16);
  }
  void wait() {
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {  // the last one in releases the rest
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < spin_limit_)
        _mm_pause();
      else
        sched_yield();
    }
  }

 private:
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
  int n_ = 1;
  int spin_limit_ = 1 << 16;  // pauses before the first yield
};

}  // namespace quill
