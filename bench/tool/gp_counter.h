// Counts liburcu grace periods started anywhere in this process.
//
// grace-bench defines urcu_memb_synchronize_rcu() itself: the definition counts the call and
// forwards to liburcu's (found with dlsym(RTLD_NEXT)). liburcu's own call_rcu worker calls
// synchronize_rcu() through its PLT, so the executable's definition interposes on it too;
// that is how `grace-bench retire --mode call_rcu` reports grace periods, which liburcu 0.13
// does not count. grace's library calls land here as well (one count per
// reclaim_engine::run_grace_period()). If a liburcu build bound its internal calls directly,
// a call_rcu run would count 0 grace periods; grace-bench then reports `na`.
#pragma once

#include <cstdint>

namespace grace::bench {

// synchronize_rcu() calls so far, by threads not excluded below.
std::uint64_t urcu_grace_periods() noexcept;

// While alive, the calling thread's synchronize_rcu() calls are not counted (a latency
// measuring thread, whose grace periods are the measurement, not reclamation work).
class scoped_gp_count_exclusion {
 public:
  scoped_gp_count_exclusion() noexcept;
  ~scoped_gp_count_exclusion();
  scoped_gp_count_exclusion(const scoped_gp_count_exclusion&) = delete;
  scoped_gp_count_exclusion& operator=(const scoped_gp_count_exclusion&) = delete;
};

}  // namespace grace::bench
