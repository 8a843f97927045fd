// Internal. Do not include directly.
#pragma once

#include <sched.h>
#include <sys/rseq.h>

#include <cstddef>

namespace grace::detail {

// The CPU the calling thread runs on now, or -1 if it cannot be told; a hint only (the
// thread may migrate at once), so per-CPU data indexed by it must stay correct when several
// threads share an index. glibc >= 2.35 registers an rseq area for every thread, in which
// the kernel keeps the current CPU: reading it is two loads, where sched_getcpu() is a
// library call. A negative value there means rseq is unavailable (registration refused, or
// disabled by tunable), and sched_getcpu() answers.
inline int current_cpu_if_known() noexcept {
  if (__rseq_size != 0) {
    const auto* area = reinterpret_cast<const volatile struct rseq*>(
        static_cast<const char*>(__builtin_thread_pointer()) + __rseq_offset);
    const int cpu = static_cast<int>(area->cpu_id);
    if (cpu >= 0) return cpu;
  }
  return sched_getcpu();
}

// current_cpu_if_known() as an index: an unknown CPU counts as CPU 0.
inline unsigned current_cpu() noexcept {
  const int cpu = current_cpu_if_known();
  return cpu < 0 ? 0u : static_cast<unsigned>(cpu);
}

// Whether the calling thread runs on CPU `cpu` at the time of the call; false when the CPU
// cannot be told.
inline bool running_on(unsigned cpu) noexcept {
  const int now = current_cpu_if_known();
  return now >= 0 && static_cast<unsigned>(now) == cpu;
}

// Number of shards for per-CPU data: enough for every possible CPU's number (the highest
// possible CPU number + 1, which exceeds the count of CPUs where numbers are sparse), rounded
// up to a power of two, so that each CPU has a shard of its own.
unsigned cpu_shard_count() noexcept;

}  // namespace grace::detail
