// fork() support: grace's pthread_atfork handlers and what they coordinate. Internal to
// reclaim/src; the protocol is described at the top of fork.cc.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace grace::detail {

class reclaim_engine;

// Installs grace's pthread_atfork handlers, once per process (the first domain or the first
// registered reader thread does). Returns 0, or the error pthread_atfork() returned.
int install_fork_handlers() noexcept;

// Held while domain::global() builds the global domain, and by fork() from the start of its
// prepare handler to the end of the parent's: the child never inherits a global domain half
// built by a thread that does not exist there. (A function-local static would leave the
// child's first domain::global() waiting for ever on the static's guard.) The builder calls
// install_fork_handlers() before taking it: pthread_atfork() waits for a fork() in progress.
extern std::mutex global_domain_mutex;

// The engines the handlers park and restart. An engine adds itself once its threads run and
// removes itself before it stops them; both wait while a fork() is in progress.
void add_engine_for_fork(reclaim_engine* engine) noexcept;
void remove_engine_for_fork(reclaim_engine* engine) noexcept;

// The fork gates, each held (shared) across the calls that take one of liburcu's internal
// mutexes, so that the child never inherits one locked by a thread that does not exist there.
// fork() closes each: it waits until no thread is inside and keeps new ones out.
//   - grace_period: urcu_memb_synchronize_rcu() (rcu_gp_lock, and rcu_registry_lock while it
//     scans). Closing it waits for the grace periods in flight, hence for read sections.
//   - registry: urcu_memb_register_thread()/unregister_thread() (rcu_registry_lock) and
//     changes to grace's thread list. Closed only once the grace_period gate is closed and
//     empty: these calls then wait for nothing, so closing it never waits for a reader.
// Two gates, not one (review fix): with one, a thread's first pin() (or its exit) waited
// behind a fork() that was itself waiting for a grace period; a reader that waited for that
// thread (a mutex it held, a join) then deadlocked the fork, although the same program never
// deadlocks without fork(). Entering a gate waits while a fork() is in progress, so neither
// is ever entered inside a read section. Not reentrant: nothing runs inside but the call (and,
// at registration, check_read_side_matches_library()'s sections, which wait for nothing).
enum class fork_gate { grace_period, registry };

class fork_gate_scope {
 public:
  explicit fork_gate_scope(fork_gate which) noexcept;
  ~fork_gate_scope();
  fork_gate_scope(const fork_gate_scope&) = delete;
  fork_gate_scope& operator=(const fork_gate_scope&) = delete;

 private:
  std::atomic<std::uint32_t>& word_;
};

// An emergency reclamation that a thread postponed to the end of its read section (see
// reclaim_engine::emergency_reclaim) and that the child of fork() takes over from it.
struct adopted_reclaim {
  reclaim_engine* engine;
  void* object;
  void (*deleter)(void*);
};

// thread_registry.cc. In the child, before any thread is created there (a new thread may
// reuse a dead one's stack, and with it its thread_locals): removes every thread but the
// calling one from liburcu's registry and from grace's thread list, and returns the
// emergency reclamations those threads had postponed, in memory from std::malloc that the
// caller frees (nullptr and `count` 0 if there are none, or if that memory is not there).
adopted_reclaim* forget_other_threads_after_fork_child(std::size_t& count) noexcept;

}  // namespace grace::detail
