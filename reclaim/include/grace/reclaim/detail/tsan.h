// Internal. Do not include directly.
//
// ThreadSanitizer support: what TSan cannot see of grace's ordering, told to it in grace's
// own code. Everything here compiles to nothing outside TSan builds (the tsan preset).
//
// TSan knows happens-before only from atomics, mutexes and the calls it intercepts. It misses
// two orders grace relies on:
//   - Grace periods. liburcu (urcu-memb) is not instrumented: its read lock/unlock are plain
//     accesses to a per-thread counter, and synchronize_rcu() orders them with
//     sys_membarrier(). So TSan sees no edge from a reader's last access to an object to the
//     code that destroys or reuses the object after a grace period, and reports a race.
//     grace_period_reader_exit() and grace_period_elapsed() below supply that edge.
//   - Fences. TSan does not model std::atomic_thread_fence. Each fence is written through
//     atomic_fence() with a `// TSan:` comment. Where the fence carries a happens-before
//     edge (a release or acquire fence), the atomic operation it orders takes its order from
//     tsan_order(), so TSan sees the edge on the operation itself; a SeqCst fence that only
//     orders a store before a load carries none, and TSan needs no stand-in for it.
#pragma once

#include <atomic>

#if defined(__SANITIZE_THREAD__)
#define GRACE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRACE_TSAN 1
#endif
#endif
#ifndef GRACE_TSAN
#define GRACE_TSAN 0
#endif

#if GRACE_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace grace::detail {

inline constexpr bool kTsan = GRACE_TSAN != 0;

// `under_tsan` in a TSan build, `otherwise` elsewhere: for the atomic operation next to a
// fence, which TSan does not model (xenium's TSAN_MEMORY_ORDER).
constexpr std::memory_order tsan_order(std::memory_order under_tsan,
                                       std::memory_order otherwise) noexcept {
  return kTsan ? under_tsan : otherwise;
}

// std::atomic_thread_fence(order). Under TSan the fence still runs (the runtime issues a
// real one) but TSan ignores it, which GCC warns about (-Wtsan); the warning is silenced
// here only, since each caller states in a `// TSan:` comment what stands in for the fence.
#if GRACE_TSAN && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wtsan"
#endif
inline void atomic_fence(std::memory_order order) noexcept {
  __atomic_thread_fence(static_cast<int>(order));
}
#if GRACE_TSAN && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic pop
#endif

// The grace-period edge, on one process-wide sync object: every reader releases it as it
// leaves its outermost read section, and every grace period acquires it once
// urcu_memb_synchronize_rcu() has returned. Process-wide rather than per domain because
// liburcu's grace periods are process-wide and a read_guard names no domain: every
// synchronize_rcu() waits for every reader.
//
// Sound in one direction only: extra happens-before edges can hide races, never invent
// them. What it can hide: the acquire takes in every read section that ended before the
// grace period did, where liburcu orders only those that began before it started. So TSan
// misses a race between code after a grace period and a read section that began after
// that grace period started and ended before it finished, e.g. an object retired (or
// deallocated to a pool) while still reachable, read only by such readers. Still reported:
// a reader still inside when the object is destroyed or reused, a reader that comes later,
// and a destroy or reuse that waits for no grace period at all. Through such readers the
// edge also orders anything they did before leaving, not only their reads of RCU-protected
// objects.
inline constinit char grace_period_sync = 0;

// Called by a reader right before liburcu's read unlock of its outermost read section (so
// that it precedes the end of any grace period that waits for the section).
inline void grace_period_reader_exit() noexcept {
#if GRACE_TSAN
  __tsan_release(&grace_period_sync);
#endif
}

// Called once a grace period has elapsed, after urcu_memb_synchronize_rcu() returned. Code
// that learns of the grace period another way (domain::gp_elapsed(), a batch handed on by
// the GP thread) is ordered after this call by the atomics that tell it.
inline void grace_period_elapsed() noexcept {
#if GRACE_TSAN
  __tsan_acquire(&grace_period_sync);
#endif
}

}  // namespace grace::detail
