// grace::domain: grace-period reclamation with per-CPU batched retire.
//
// A domain takes objects that were unlinked from a shared structure and destroys them once
// every reader that could still see them has left its read section. It batches them per CPU
// into page-sized blocks, hands each batch of blocks to one grace period, and destroys the
// batch in bulk on a worker thread (the Linux kfree_rcu() batching).
//
//   grace::domain& d = grace::domain::global();
//   node* old = head.exchange(fresh, std::memory_order_acq_rel);  // unlink
//   d.retire(old);                                                // deleted after a GP
//   ...
//   d.barrier();   // every object retired before this call has now been deleted
//
// Threads: each domain runs a grace-period thread (runs liburcu's synchronize_rcu() for
// whole batches, never more than needed, with no limit of one grace period in flight: the
// next begins as soon as one ends while work is waiting; but while other threads run grace
// periods, a batch waits up to requested_gp_delay for one of theirs) and a reclaim worker
// (runs the deleters, oldest batch first). Retiring threads never run deleters, except on the
// emergency path (no memory for a block). The grace-period thread answers request_gp()
// only when no other grace period has within requested_gp_delay: under load, one run by a
// thread between its read sections is far cheaper (reclaim/README.md, "Grace periods on
// request").
//
// Guarantees:
//   - An object passed to retire() is deleted exactly once, after a grace period that began
//     after the retire() call; never while a read_guard taken before the call is held.
//   - barrier(): when it returns, every object retired (by any thread) before the call has
//     been deleted, including objects retired meanwhile by deleters.
//   - synchronize(): one full grace period; it is never queued behind reclamation work.
//   - Pending memory is bounded: above the soft limits the engine drains at once; above the
//     hard limits a retiring thread waits (outside its read sections) until the backlog
//     falls back under the soft limits, and meanwhile so does every thread whose retire()
//     hands the engine a block while the backlog is over them. So any retire() may wait:
//     never call it holding a lock that a deleter of the same domain takes.
//
// fork() (without exec()) is supported; the child keeps using every domain it inherited.
// Rules (details in reclaim/README.md, "fork()"):
//   - Fork from a thread that holds no read_guard and is not running a deleter; either
//     aborts with a message (fork() waits for the grace periods in flight, which would wait
//     for that thread).
//   - fork() waits for the grace periods in flight and for each worker to finish its current
//     block, then parks the domains' threads; the child starts new ones.
//   - Each object whose retire() returned before fork() is deleted exactly once in the parent
//     and exactly once in the child (each in its own copy of memory). Only the forking thread
//     exists in the child: other threads' read sections end there, and what they were doing
//     at that instant (a retire() that had not returned) is lost in the child only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "grace/reclaim/detail/cpu.h"
#include "grace/reclaim/detail/retire_block.h"
#include "grace/reclaim/detail/tsan.h"
#include "grace/reclaim/read_guard.h"
#include "grace/reclaim/system_allocator.h"

namespace grace {

namespace detail {
class reclaim_engine;
class domain_user;
}  // namespace detail

// How retired objects are grouped into grace periods.
enum class batching {
  // Per-CPU page-sized blocks; one grace period serves every block waiting. The default.
  per_cpu_blocks,
  // Each object is its own batch with its own grace period: no batching at all. Costs one
  // grace period per object; exists as the reference that shows what batching buys.
  per_object,
};

struct domain_options {
  // A partially filled block is handed to the engine at most this long after it was opened.
  // Range: 1 ms to 10 s.
  std::chrono::milliseconds drain_interval{20};
  // Pending (retired, not yet reclaimed) objects and bytes above which the engine drains
  // every shard at once. Bytes count only what callers pass to retire().
  std::size_t soft_limit_objects = std::size_t{1} << 15;
  std::size_t soft_limit_bytes = std::size_t{64} << 20;
  // Above these, a retiring thread waits, outside its read sections, until the backlog is
  // back under the soft limits (back-pressure); a thread that hands the engine a block over
  // the soft limits meanwhile waits with it. Must be >= the soft limits: raise them together.
  std::size_t hard_limit_objects = std::size_t{1} << 17;
  std::size_t hard_limit_bytes = std::size_t{256} << 20;
  // How long the engine lets a request_gp() wait before running the grace period itself.
  // A grace period that ends meanwhile (synchronize(), one a pool's deallocating thread runs,
  // a batch's) answers the request, and the engine runs none; after a quarter of it,
  // request_gp_claiming_overdue() hands it to one caller. Under load, a thread that makes
  // garbage pays for a grace period at its quiescent point with ~2 membarrier() calls, where
  // the engine's thread, competing with it for a core and woken by every reader that leaves,
  // can need hundreds. For the same reason, while a thread other than the engine's has
  // completed a grace period within this delay, a batch of retired objects waits, at most
  // this long, for a grace period run elsewhere (never one a barrier() waits for, nor with
  // pending memory over half the soft limits). Range: 0 (at once) to 10 s.
  std::chrono::microseconds requested_gp_delay{10000};
  enum batching batching = batching::per_cpu_blocks;
  // The reclaim worker's nice value, 0 to 19. The worker runs the deleters; on a busy
  // machine it competes for a core with the grace-period thread, and a synchronize() that
  // liburcu folds into the GP thread's grace period waits while that thread waits behind the
  // worker. 19 makes freeing background work that grace periods never wait behind; under a
  // flood the backlog then reaches the hard limits, and back-pressure makes the retiring
  // threads wait for the starved worker (reclaim/MEASUREMENTS.md, "Freeing as background work").
  // The worker starts at the nice value of the thread that creates the domain (after
  // fork(), of the forking thread); 0 keeps that one, whatever it is, and a higher value
  // raises it to this if it is lower. Never lowered: that needs CAP_SYS_NICE.
  int worker_nice = 0;
  // Where retire blocks come from; failing allocations take the emergency path.
  system_allocator allocator{};
};

// Approximate snapshot; fields are not mutually consistent. Never reset.
struct domain_stats {
  std::uint64_t grace_periods = 0;         // synchronize_rcu() calls run through this domain
  std::uint64_t retired = 0;               // objects handed to the engine (open blocks lag)
  std::uint64_t reclaimed = 0;             // objects whose deleter has run
  std::uint64_t pending_objects = 0;       // retired - reclaimed
  std::uint64_t pending_bytes = 0;
  std::uint64_t peak_pending_objects = 0;
  std::uint64_t peak_pending_bytes = 0;
  std::uint64_t batches = 0;               // groups of blocks reclaimed after one wait
  std::uint64_t batches_without_own_gp = 0;  // of those, freed after a grace period another
                                             // thread ran: the engine ran none for them
  std::uint64_t blocks = 0;                // blocks handed to the engine
  std::uint64_t forced_drains = 0;         // soft limit crossed: shards drained at once
  std::uint64_t backpressure_waits = 0;    // a retiring thread waited (back-pressure)
  std::uint64_t emergency_frees = 0;       // no block memory: reclaimed by the retiring thread
};

class domain {
 public:
  // Throws std::invalid_argument naming the option if options are out of range, and
  // std::system_error if the engine's threads cannot start.
  explicit domain(domain_options options = {});
  // Runs barrier(), waits for threads that owe the domain work at the end of their read
  // section (synchronize_when_unpinned(), back-pressure), then stops the engine. Requires:
  // no thread uses the domain otherwise any more, and every object_pool built on it (each
  // grace::hash_map has one) is gone: one that is not aborts the process with a message
  // that says so, where the pool's destructor and trim passes would use a destroyed domain.
  ~domain();

  domain(const domain&) = delete;
  domain& operator=(const domain&) = delete;

  // The process-wide domain. Never destroyed; it is flushed (barrier()) at process exit.
  static domain& global() noexcept;

  // A read section (see read_guard.h). Grace periods are process-wide, so this is the same
  // as grace::pin(); the member form reads better next to the domain it protects.
  [[nodiscard]] read_guard pin() const noexcept { return read_guard(); }
  // BasicLockable, so std::scoped_lock<grace::domain> works.
  void lock() noexcept { detail::read_lock(); }
  void unlock() noexcept { detail::read_unlock(); }

  // Deletes `object` after a grace period. Requires: object is unreachable from shared
  // memory, and is retired once. May be called inside a read section. Never throws.
  // When no retire block can be allocated at all, the retiring thread reclaims the object
  // itself after a grace period; inside a read section it postpones that to the end of its
  // outermost guard, with room for 64 objects per thread (static storage, since memory is
  // what is missing): a 65th such object in one read section aborts with a message.
  template <class T>
  void retire(T* object) noexcept {
    if (object == nullptr) return;
    retire(static_cast<void*>(object), [](void* p) { delete static_cast<T*>(p); }, sizeof(T));
  }
  // Calls deleter(object) after a grace period; `bytes` counts toward the byte limits.
  void retire(void* object, void (*deleter)(void*), std::size_t bytes = 0) noexcept;
  // Runs fn(argument) after a grace period, like retire(), for an owner's periodic
  // bookkeeping (object_pool's trim pass) rather than an object. barrier() waits for such
  // calls made before it, but when one is made from inside a deleter, barrier() does not
  // chase it the way it chases chained retirements: otherwise bookkeeping rescheduled by
  // every deleter would keep barrier() looping while other threads work. The owner waits
  // for its own bookkeeping before it goes away.
  void defer_housekeeping(void (*fn)(void*), void* argument) noexcept {
    retire(argument, fn);
    if (detail::tls_reader.running_deleters) --detail::tls_reader.retires_by_deleters;
  }

  // Waits for one full grace period. Concurrent callers share grace periods. Throws
  // std::logic_error inside a read section.
  void synchronize();
  // Waits until every object retired before the call has been reclaimed. Throws
  // std::logic_error inside a read section or from inside a deleter.
  void barrier();

  // Grace-period polling (what liburcu 0.14 calls start/poll_state_synchronize_rcu).
  // gp_elapsed(gp_cookie()) becomes true once a full grace period has passed since the
  // cookie was taken. Neither call blocks.
  std::uint64_t gp_cookie() const noexcept;
  bool gp_elapsed(std::uint64_t cookie) const noexcept;
  // Asks for a grace period to end soon, even with nothing to reclaim (for callers that poll
  // cookies, such as grace::object_pool): gp_elapsed(c) becomes true for every c taken
  // before the call, by a grace period someone else runs meanwhile, or else by one the
  // engine runs about options().requested_gp_delay after its thread sees the request (up to
  // twice that when the request joins an earlier one that another grace period answered,
  // and later while the engine is busy with batches). Never blocks.
  void request_gp() noexcept;
  // request_gp(), and true when the caller should answer the request itself, which it then
  // must do with synchronize() or synchronize_when_unpinned(): an earlier request has waited
  // a quarter of requested_gp_delay, no grace period that answers it has started, the caller
  // runs no deleter, and no other caller claimed it within that quarter (timed with the
  // coarse monotonic clock, so at the kernel tick's resolution, 1-4 ms). Under load a
  // thread that makes garbage answers far cheaper than the engine's thread. Never blocks.
  [[nodiscard]] bool request_gp_claiming_overdue() noexcept;
  // Runs a grace period on the calling thread now if it holds no read_guard, otherwise when
  // its outermost guard ends. Never blocks inside a read section. For a thread whose garbage
  // outruns the engine's grace periods: it pays for one itself, at a quiescent point.
  void synchronize_when_unpinned() noexcept;

  domain_stats stats() const noexcept;
  const domain_options& options() const noexcept { return options_; }

 private:
  friend class detail::reclaim_engine;
  friend class detail::domain_user;

  // The shard had no open block (`taken` is nullptr, and this thread now holds the shard),
  // or another thread holds it (`taken` is shard_held(): use a block of our own).
  [[gnu::cold, gnu::noinline]] void retire_slow(detail::retire_shard& shard,
                                                detail::retire_block* taken, void* object,
                                                void (*deleter)(void*),
                                                std::size_t bytes) noexcept;
  // Hands a full (or over-budget) block to the engine, then releases the shard.
  [[gnu::cold, gnu::noinline]] void submit_slow(detail::retire_shard& shard,
                                                detail::retire_block* block) noexcept;

  domain_options options_;
  std::unique_ptr<detail::retire_shard[]> shards_;
  unsigned shard_mask_;
  std::uint32_t block_capacity_;
  std::uint64_t block_bytes_budget_;  // a block is submitted once its objects weigh this much
  detail::gp_sequence gp_;
  std::unique_ptr<detail::reclaim_engine> engine_;
  // Live detail::domain_user objects (one per object_pool built on this domain). Relaxed:
  // a correct program destroys every pool before the domain, which orders the decrements
  // before ~domain()'s check; only a program that breaks that order is reported.
  std::atomic<std::size_t> users_{0};
};

namespace detail {
// Its owner's reference to a domain (an object_pool's), counted as a user of that domain for
// as long as it lives, so that a domain destroyed first says so instead of crashing in its
// own teardown.
class domain_user {
 public:
  explicit domain_user(domain& reclamation) noexcept : domain_(reclamation) {
    domain_.users_.fetch_add(1, std::memory_order_relaxed);  // Relaxed: see domain::users_.
  }
  ~domain_user() {
    domain_.users_.fetch_sub(1, std::memory_order_relaxed);  // Relaxed: see domain::users_.
  }
  domain_user(const domain_user&) = delete;
  domain_user& operator=(const domain_user&) = delete;

  domain& operator*() const noexcept { return domain_; }
  domain* operator->() const noexcept { return &domain_; }

 private:
  domain& domain_;
};
}  // namespace detail

inline void domain::retire(void* object, void (*deleter)(void*), std::size_t bytes) noexcept {
  // Counted here, published only after the deleter returns (see reclaim_engine::barrier()).
  if (detail::tls_reader.running_deleters) [[unlikely]] ++detail::tls_reader.retires_by_deleters;
  detail::retire_shard& shard = shards_[detail::current_cpu() & shard_mask_];
  // Acquire (R3): own the shard's open block, with the entries its previous owner wrote;
  // pairs with the Release store (R4) that ended that ownership.
  detail::retire_block* block =
      shard.open.exchange(detail::shard_held(), std::memory_order_acquire);
  if (block == nullptr || block == detail::shard_held()) [[unlikely]] {
    retire_slow(shard, block, object, deleter, bytes);
    return;
  }
  block->push(object, deleter, bytes);
  if (block->full() || block->bytes >= block_bytes_budget_) [[unlikely]] {
    submit_slow(shard, block);
    return;
  }
  // Release (R4): publish this thread's entry to the shard's next owner; pairs with (R3).
  shard.open.store(block, std::memory_order_release);
}

inline std::uint64_t domain::gp_cookie() const noexcept {
  // SeqCst fence: the caller's unlink is ordered before the ticket read, so a grace period
  // whose ticket is >= the cookie began after the unlink; pairs with the SeqCst ticket
  // fetch_add in reclaim_engine::run_grace_period(). A load alone may be satisfied before
  // the unlink store is visible (store-load reordering).
  // TSan: ignores fences, and needs no stand-in for this one: it orders a store before a
  // load, which TSan does not check, and no happens-before edge rests on it (reuse after the
  // grace period is ordered for TSan by detail::grace_period_elapsed()). It still runs.
  detail::atomic_fence(std::memory_order_seq_cst);
  return gp_.started.load(std::memory_order_relaxed) + 1;
}

inline bool domain::gp_elapsed(std::uint64_t cookie) const noexcept {
  // Acquire: what follows (reuse, delete) happens after the grace period completed; pairs
  // with the Release max-update of `completed` in run_grace_period().
  return gp_.completed.load(std::memory_order_acquire) >= cookie;
}

}  // namespace grace
