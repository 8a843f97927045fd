// Internal. Do not include directly.
#pragma once

#include <sched.h>
#include <sys/rseq.h>

#include <cstddef>

namespace grace::detail {

// The CPU the calling thread runs on now; a hint only (the thread may migrate at once), so
// per-CPU data indexed by it must stay correct when several threads share an index.
// glibc >= 2.35 registers an rseq area for every thread, in which the kernel keeps the
// current CPU: reading it is two loads, where sched_getcpu() is a library call. A negative
// value means rseq is unavailable (registration refused, or disabled by tunable), and
// sched_getcpu() answers; -1 from it maps to 0.
inline unsigned current_cpu() noexcept {
  if (__rseq_size != 0) {
    const auto* area = reinterpret_cast<const volatile struct rseq*>(
        static_cast<const char*>(__builtin_thread_pointer()) + __rseq_offset);
    const int cpu = static_cast<int>(area->cpu_id);
    if (cpu >= 0) return static_cast<unsigned>(cpu);
  }
  const int cpu = sched_getcpu();
  return cpu < 0 ? 0u : static_cast<unsigned>(cpu);
}

// Number of shards for per-CPU data: the configured CPUs rounded up to a power of two.
unsigned cpu_shard_count() noexcept;

}  // namespace grace::detail
