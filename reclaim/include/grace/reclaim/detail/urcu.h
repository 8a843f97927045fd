// Internal. Do not include directly.
//
// The only grace header that includes liburcu, and the per-thread reader state.
//
// grace's read side speaks liburcu-memb's reader protocol itself, inline: the outermost
// read_guard copies urcu_memb_gp.ctr (the current phase, with a nesting count of one) into
// the thread's urcu_memb_reader.ctr, or adds one to a count the thread already holds, and
// leaves by taking one off, waking a grace period that waits on urcu_memb_gp.futex once it
// reaches zero: a re-implementation of liburcu's read lock, unlock and wake-up on its data
// layout (urcu_memb_reader.ctr, urcu_memb_gp.ctr and .futex, urcu_memb_has_sys_membarrier),
// located once per thread by src/thread_registry.cc, which compiles liburcu's static header
// for their declarations and checks the counter's constants against it. grace::pin() costs
// 1.5 ns so, against 8.5 through liburcu-memb.so's urcu_memb_read_lock/unlock (two PLT calls
// with three __tls_get_addr). liburcu keeps the
// layout within a major version (its soname), grace is rebuilt with each liburcu release, and
// each thread checks when it registers that the library and grace see the same counter.
// GRACE_URCU_INLINE_READ_SIDE=OFF (CMake) calls the library instead. _LGPL_SOURCE is never
// defined, and none of liburcu's rcu_* macros leak (without URCU_API_MAP, <urcu/urcu-memb.h>
// clears them).
#pragma once

#include <urcu/urcu-memb.h>

#include <atomic>
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
#if !GRACE_URCU_LIBRARY_READ_SIDE
  // liburcu-memb's per-thread and global state, located by register_thread_slow().
  bool liburcu_readers_fence = false;         // liburcu lacks sys_membarrier: readers fence
  unsigned long* liburcu_count = nullptr;     // &urcu_memb_reader.ctr of this thread
  unsigned long* liburcu_phase = nullptr;     // &urcu_memb_gp.ctr
  std::int32_t* liburcu_waiter = nullptr;     // &urcu_memb_gp.futex: -1 while a GP sleeps
#endif
};

inline constinit thread_local reader_state tls_reader{};

// Registers the thread with liburcu and arms its unregistration at thread exit.
[[gnu::cold, gnu::noinline]] void register_thread_slow() noexcept;
// Work a thread postponed until it left its read sections: back-pressure waits and
// emergency reclamation (see domain::retire_slow).
[[gnu::cold, gnu::noinline]] void run_deferred_work_slow() noexcept;

// liburcu-memb's reader counter: the low half counts nested sections (0: outside any), the
// high half's lowest bit is the grace-period phase the outermost section began in
// (URCU_GP_COUNT, URCU_GP_CTR_NEST_MASK; checked in thread_registry.cc).
inline constexpr unsigned long kLiburcuNestingOne = 1;
inline constexpr unsigned long kLiburcuNestingMask = (1UL << (sizeof(unsigned long) * 4)) - 1;

// liburcu's read lock, unlock and "inside a section?" for grace's outermost guard: its
// protocol spoken inline, or calls into liburcu-memb.so.
#if GRACE_URCU_LIBRARY_READ_SIDE
inline void liburcu_read_lock() noexcept { urcu_memb_read_lock(); }
inline void liburcu_read_unlock() noexcept { urcu_memb_read_unlock(); }
inline bool liburcu_read_ongoing() noexcept { return urcu_memb_read_ongoing() != 0; }
#else
// Wakes the grace period that sleeps on urcu_memb_gp.futex (liburcu's FUTEX_WAKE of one).
[[gnu::cold, gnu::noinline]] void wake_grace_period_slow(std::int32_t* waiter) noexcept;

// The reader's half of liburcu-memb's fence pairing: a compiler barrier, which
// synchronize_rcu()'s sys_membarrier() makes a full fence on this CPU when it matters; a
// seq_cst fence where liburcu found no membarrier and its grace periods use plain fences.
inline void liburcu_reader_fence(const reader_state& reader) noexcept {
  if (reader.liburcu_readers_fence) [[unlikely]] {
    // SeqCst: pairs with synchronize_rcu()'s smp_mb_master(). TSan: at the exit, the edge
    // is grace_period_reader_exit()'s; elsewhere it orders a store before loads (no edge).
    atomic_fence(std::memory_order_seq_cst);
  } else {
    // Compiler order only: sys_membarrier() in synchronize_rcu() orders this CPU's side.
    std::atomic_signal_fence(std::memory_order_seq_cst);
  }
}
inline void liburcu_read_lock() noexcept {
  // Compiler order only: nothing before the section moves into its entry (liburcu's own
  // lock opens with the same barrier).
  std::atomic_signal_fence(std::memory_order_seq_cst);
  reader_state& reader = tls_reader;
  // Relaxed: only this thread writes its counter; synchronize_rcu() reads it.
  std::atomic_ref<unsigned long> count(*reader.liburcu_count);
  const unsigned long held = count.load(std::memory_order_relaxed);
  if ((held & kLiburcuNestingMask) == 0) {
    // Relaxed: the phase is written under liburcu's GP lock; the fence below orders this
    // thread's section after the store that announces it (pairs with synchronize_rcu's
    // membarrier, as liburcu's own lock does).
    const unsigned long phase =
        std::atomic_ref<unsigned long>(*reader.liburcu_phase).load(std::memory_order_relaxed);
    count.store(phase, std::memory_order_relaxed);
    liburcu_reader_fence(reader);
  } else {
    count.store(held + kLiburcuNestingOne, std::memory_order_relaxed);  // the program's section
  }
}
inline void liburcu_read_unlock() noexcept {
  reader_state& reader = tls_reader;
  std::atomic_ref<unsigned long> count(*reader.liburcu_count);
  const unsigned long held = count.load(std::memory_order_relaxed);  // Relaxed: as above
  if ((held & kLiburcuNestingMask) == kLiburcuNestingOne) {
    liburcu_reader_fence(reader);  // the section's accesses before the store that ends it
    count.store(held - kLiburcuNestingOne, std::memory_order_relaxed);
    // That store before the load of the waiter flag: pairs with the smp_mb_master() between
    // synchronize_rcu()'s setting the flag to -1 and its re-check of the readers, so either
    // it sees this thread gone or this thread sees the -1 and wakes it.
    liburcu_reader_fence(reader);
    // Relaxed: ordered after the counter store by the fence above.
    if (std::atomic_ref<std::int32_t>(*reader.liburcu_waiter).load(std::memory_order_relaxed) ==
        -1) [[unlikely]] {
      wake_grace_period_slow(reader.liburcu_waiter);
    }
  } else {
    count.store(held - kLiburcuNestingOne, std::memory_order_relaxed);  // the program's section
  }
  // Compiler order only: nothing after the section moves into its exit (as liburcu's unlock).
  std::atomic_signal_fence(std::memory_order_seq_cst);
}
// On a thread grace has not registered, which the program may have registered with liburcu
// itself and be holding liburcu's read lock on, asks the library.
inline bool liburcu_read_ongoing() noexcept {
  const reader_state& reader = tls_reader;
  if (reader.liburcu_count == nullptr) [[unlikely]] return urcu_memb_read_ongoing() != 0;
  // Relaxed: the thread's own counter.
  return (std::atomic_ref<unsigned long>(*reader.liburcu_count).load(std::memory_order_relaxed) &
          kLiburcuNestingMask) != 0;
}
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
