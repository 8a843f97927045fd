// Internal. Do not include directly.
#pragma once

#include <sched.h>

namespace grace::detail {

// The CPU the calling thread runs on now; a hint only (the thread may migrate at once), so
// per-CPU data indexed by it must stay correct when several threads share an index.
// sched_getcpu() reads the rseq area in glibc >= 2.35 (~2-5 ns); -1 on failure maps to 0.
inline unsigned current_cpu() noexcept {
  const int cpu = sched_getcpu();
  return cpu < 0 ? 0u : static_cast<unsigned>(cpu);
}

// Number of shards for per-CPU data: the configured CPUs rounded up to a power of two.
unsigned cpu_shard_count() noexcept;

}  // namespace grace::detail
