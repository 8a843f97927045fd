// Starts worker threads together: each worker arrives and waits; the coordinator waits until
// all have arrived, takes the start time, and opens the gate. The start time is taken before
// any worker runs, so wake-up delays count against the benchmark, not for it.
#pragma once

#include <atomic>
#include <cstdint>
#include <latch>

#include "tool/latency.h"

namespace grace::bench {

class start_gate {
 public:
  explicit start_gate(std::ptrdiff_t workers) : arrived_(workers) {}

  void arrive_and_wait() noexcept {
    arrived_.count_down();
    // Acquire: the coordinator's setup before open() is visible; pairs with the Release
    // store in open().
    open_.wait(false, std::memory_order_acquire);
  }

  bench_clock::time_point open() noexcept {
    arrived_.wait();
    const bench_clock::time_point start = bench_clock::now();
    // Release: publishes the setup done before open(); pairs with the Acquire wait above.
    open_.store(true, std::memory_order_release);
    open_.notify_all();
    return start;
  }

 private:
  std::latch arrived_;
  std::atomic<bool> open_{false};
};

}  // namespace grace::bench
