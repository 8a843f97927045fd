// fork() support: grace's pthread_atfork handlers and what they coordinate. Internal to
// reclaim/src; the protocol is described at the top of fork.cc.
#pragma once

#include <cstddef>

namespace grace::detail {

class reclaim_engine;

// Installs grace's pthread_atfork handlers, once per process (the first domain or the first
// registered reader thread does). Returns 0, or the error pthread_atfork() returned.
int install_fork_handlers() noexcept;

// The engines the handlers park and restart. An engine adds itself once its threads run and
// removes itself before it stops them; both wait while a fork() is in progress.
void add_engine_for_fork(reclaim_engine* engine) noexcept;
void remove_engine_for_fork(reclaim_engine* engine) noexcept;

// The fork gate, held (shared) across every call that takes liburcu's internal mutexes
// (urcu_memb_synchronize_rcu, urcu_memb_register_thread, urcu_memb_unregister_thread) and
// across changes to grace's thread list. fork() closes it: it waits until no thread is inside
// and keeps new ones out, so the child never inherits one of those mutexes locked by a
// thread that does not exist there. Entering waits while a fork() is in progress, so it is
// never entered inside a read section (the fork may be waiting for a grace period that waits
// for that section). Not reentrant: nothing runs inside it but the liburcu call.
class fork_gate_scope {
 public:
  fork_gate_scope() noexcept;
  ~fork_gate_scope();
  fork_gate_scope(const fork_gate_scope&) = delete;
  fork_gate_scope& operator=(const fork_gate_scope&) = delete;
};

// An emergency reclamation that a thread postponed to the end of its read section (see
// reclaim_engine::emergency_reclaim) and that the child of fork() takes over from it.
struct adopted_reclaim {
  reclaim_engine* engine;
  void* object;
  void (*deleter)(void*);
  std::size_t bytes;
};

// thread_registry.cc. In the child, before any thread is created there (a new thread may
// reuse a dead one's stack, and with it its thread_locals): removes every thread but the
// calling one from liburcu's registry and from grace's thread list, and returns the
// emergency reclamations those threads had postponed, in memory from std::malloc that the
// caller frees (nullptr and `count` 0 if there are none, or if that memory is not there).
adopted_reclaim* forget_other_threads_after_fork_child(std::size_t& count) noexcept;

}  // namespace grace::detail
