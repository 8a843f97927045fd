// Internal. Do not include directly.
//
// The only grace header that includes liburcu, and the per-thread reader state.
//
// grace's read side is liburcu's own read lock and unlock, inlined by default:
// _urcu_memb_read_lock(), _urcu_memb_read_unlock() and _urcu_memb_read_ongoing() from
// <urcu/static/urcu-memb.h>, 8.5 ns a section cheaper than the calls into liburcu-memb.so.
// That header is LGPL-2.1: it says it may be included only in LGPL-2.1-compatible source
// (grace's is MIT), and of the lock and unlock that each is meant to meet section 5's
// ten-line criterion for inline functions, so that non-LGPL code may invoke them directly.
// The application that compiles this header decides whether that reading suits it; one
// that wants no liburcu code in its object files builds grace with
// GRACE_URCU_INLINE_READ_SIDE=OFF (CMake), which calls the library instead. _LGPL_SOURCE is
// never defined: every other liburcu function is a library call, and none of liburcu's rcu_*
// macros leak (without URCU_API_MAP, <urcu/urcu-memb.h> clears them); the static header does
// bring its own names (cds_list_*, URCU_*, FUTEX_*, futex()). Inlined code reads liburcu's
// reader state by the layout of the headers grace was built with, which liburcu keeps
// within a major version (the soname): grace is rebuilt with each liburcu release.
#pragma once

#include <urcu/urcu-memb.h>
#if !GRACE_URCU_LIBRARY_READ_SIDE
#include <urcu/static/urcu-memb.h>
#endif

#include <cstdint>

#include "grace/reclaim/detail/tsan.h"

namespace grace::detail {

// One per thread, shared by every domain (grace periods are process-wide). Plain fields: only
// the owning thread touches them.
struct reader_state {
  std::uint32_t nesting = 0;        // read_guards held; liburcu is entered at 0 -> 1 only
  bool registered = false;          // registered with liburcu (urcu_memb_register_thread)
  bool has_deferred_work = false;   // run_deferred_work_slow() at the outermost unlock
  bool running_deleters = false;    // inside deleters (a domain's worker, or emergency work)
  std::uint32_t retires_by_deleters = 0;  // retire() calls made meanwhile, not yet published
};

inline constinit thread_local reader_state tls_reader{};

// Registers the thread with liburcu and arms its unregistration at thread exit.
[[gnu::cold, gnu::noinline]] void register_thread_slow() noexcept;
// Work a thread postponed until it left its read sections: back-pressure waits and
// emergency reclamation (see domain::retire_slow).
[[gnu::cold, gnu::noinline]] void run_deferred_work_slow() noexcept;

// liburcu's read lock, unlock and "inside a section?" for grace's outermost guard: inlined
// (their accesses hidden from TSan, see liburcu_accesses), or calls into liburcu-memb.so.
#if GRACE_URCU_LIBRARY_READ_SIDE
inline void liburcu_read_lock() noexcept { urcu_memb_read_lock(); }
inline void liburcu_read_unlock() noexcept { urcu_memb_read_unlock(); }
inline bool liburcu_read_ongoing() noexcept { return urcu_memb_read_ongoing() != 0; }
#else
inline void liburcu_read_lock() noexcept {
  const liburcu_accesses hidden_from_tsan;
  _urcu_memb_read_lock();
}
inline void liburcu_read_unlock() noexcept {
  const liburcu_accesses hidden_from_tsan;
  _urcu_memb_read_unlock();
}
inline bool liburcu_read_ongoing() noexcept { return _urcu_memb_read_ongoing() != 0; }
#endif

// True while the calling thread is inside a read section: a read_guard, or liburcu's read
// lock taken by the program itself. Both count in liburcu's per-thread counter, which grace's
// outermost guard enters, so each nests inside the other; what would wait for a grace period
// must check both.
inline bool in_read_section() noexcept {
  return tls_reader.nesting != 0 || liburcu_read_ongoing();
}

inline void read_lock() noexcept {
  reader_state& reader = tls_reader;
  if (!reader.registered) [[unlikely]] register_thread_slow();
  // liburcu's read lock orders the section's loads after it (memb: compiler barrier, paired
  // with sys_membarrier in synchronize_rcu); nested guards need no second entry.
  if (reader.nesting++ == 0) liburcu_read_lock();
}

inline void read_unlock() noexcept {
  reader_state& reader = tls_reader;
  if (--reader.nesting == 0) {
    grace_period_reader_exit();  // TSan: the section's accesses precede the grace period's end
    liburcu_read_unlock();  // orders the section before it (pairs as the lock does)
    if (reader.has_deferred_work) [[unlikely]] run_deferred_work_slow();
  }
}

}  // namespace grace::detail
