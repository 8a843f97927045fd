// Internal. Do not include directly.
//
// The only grace header that includes liburcu, and the per-thread reader state.
//
// grace's read side is liburcu's own, inlined: _urcu_memb_read_lock() and
// _urcu_memb_read_unlock() from <urcu/static/urcu-memb.h>. liburcu writes them to meet
// LGPL-2.1's ten-line criterion (section 5: object code that uses a library header's data
// layouts and inline functions of ten lines or less is unrestricted) so that code under any
// license may inline them; their header says so. _LGPL_SOURCE stays undefined: every other
// liburcu function grace calls goes through the shared library, and none of liburcu's rcu_*
// macros leak into the application (without URCU_API_MAP, <urcu/urcu-memb.h> clears them).
// The inlined code depends on the layout of liburcu's reader state, so grace is rebuilt with
// each liburcu release; register_thread_slow() checks the layout against the library's.
#pragma once

#include <urcu/urcu-memb.h>
#include <urcu/static/urcu-memb.h>

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

inline void read_lock() noexcept {
  reader_state& reader = tls_reader;
  if (!reader.registered) [[unlikely]] register_thread_slow();
  // liburcu's read lock orders the section's loads after it (memb: compiler barrier, paired
  // with sys_membarrier in synchronize_rcu); nested guards need no second entry.
  if (reader.nesting++ == 0) {
    const liburcu_accesses hidden_from_tsan;
    _urcu_memb_read_lock();
  }
}

inline void read_unlock() noexcept {
  reader_state& reader = tls_reader;
  if (--reader.nesting == 0) {
    grace_period_reader_exit();  // TSan: the section's accesses precede the grace period's end
    {
      const liburcu_accesses hidden_from_tsan;
      _urcu_memb_read_unlock();  // orders the section before it (pairs as the lock does)
    }
    if (reader.has_deferred_work) [[unlikely]] run_deferred_work_slow();
  }
}

}  // namespace grace::detail
