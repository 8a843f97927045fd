// grace::read_guard and grace::pin(): read-side critical sections.
//
// While a thread holds a read_guard, no object that it could reach through shared memory is
// reclaimed: every domain's reclamation waits for a grace period, and a grace period waits
// for every read_guard that began before it.
//
//   auto g = grace::pin();          // or: auto g = my_domain.pin();
//   const node* n = head.load(std::memory_order_acquire);
//   use(n->value);                  // n stays valid until g is destroyed
//
// Guards nest: an inner guard costs a thread-local increment. The first guard a thread takes
// registers it with liburcu; the thread unregisters when it exits. Users never call
// rcu_register_thread. A guard belongs to its thread: it cannot be copied or moved.
//
// Inside a read section, domain::synchronize() and domain::barrier() throw std::logic_error
// (they would wait for the caller itself).
#pragma once

#include "grace/reclaim/detail/urcu.h"

namespace grace {

class [[nodiscard]] read_guard {
 public:
  read_guard() noexcept { detail::read_lock(); }
  ~read_guard() { detail::read_unlock(); }

  read_guard(const read_guard&) = delete;
  read_guard& operator=(const read_guard&) = delete;
  read_guard(read_guard&&) = delete;
  read_guard& operator=(read_guard&&) = delete;
};

// Enters a read section for the calling thread. Grace periods are process-wide (they come
// from liburcu), so one guard protects objects of every domain.
[[nodiscard]] inline read_guard pin() noexcept { return read_guard(); }

// True while the calling thread holds at least one read_guard, or liburcu's read lock
// (urcu_memb_read_lock()) that the program took itself: grace's guards and liburcu's lock
// nest in one another, and either holds back every grace period.
inline bool in_read_section() noexcept { return detail::in_read_section(); }

}  // namespace grace
