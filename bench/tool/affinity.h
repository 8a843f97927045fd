// Pins the calling thread to CPU `index` modulo the CPU count (best effort: a failure, e.g.
// a CPU outside the process's affinity mask, leaves the thread where the scheduler put it).
// The modes' --affinity flags use it so that runs with threads that hand work to each other
// (producer-consumer, add_del_on_diff_cpu) do not depend on where the scheduler places them.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <thread>

namespace grace::bench {

inline void pin_to_cpu(unsigned index) {
  static const unsigned kCpus = std::max(1u, std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(index % kCpus, &set);
  (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

}  // namespace grace::bench
