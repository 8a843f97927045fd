// The engine behind grace::domain: its grace-period thread, its reclaim worker, and the
// per-thread deferred work. Internal to reclaim/src; see detail/retire_block.h for the
// pipeline's invariants (I1)-(I4) and ordering sites (R1)-(R4).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <thread>

#include "grace/reclaim/domain.h"

namespace grace::detail {

class reclaim_engine {
 public:
  explicit reclaim_engine(domain& owner);
  // Stops and joins both threads after reclaiming everything still queued.
  ~reclaim_engine();

  // Hands a block or marker to the GP thread (R1); wakes it if it sleeps.
  void submit(batch_node* node) noexcept;
  // Stamps a full or flushed block, counts it, and submits it.
  void hand_in(retire_block* block) noexcept;
  // Submits every shard's open block now.
  void flush_shards() noexcept;

  // One grace period through liburcu, with a ticket for gp_cookie()/gp_elapsed().
  void run_grace_period() noexcept;
  // Asks for a grace period that ends after `cookie` was taken (see requested_gp_). Never
  // blocks. With claim_overdue, true tells the caller to answer it itself: an earlier
  // request has waited a quarter of requested_gp_delay, no grace period that answers it has
  // started, and no other caller claimed it within that quarter.
  bool request_gp(std::uint64_t cookie, bool claim_overdue) noexcept;
  // A thread deferred a grace period or back-pressure wait on this engine to the end of its
  // read section (begin), and ran it (end). The destructor waits for every such thread.
  void deferred_use_begin() noexcept;
  void deferred_use_end() noexcept;
  void request_flush() noexcept;
  // A retiring thread opened a new block: make sure the GP thread will drain it in time.
  void note_block_opened() noexcept;

  retire_block* take_block(unsigned shard) noexcept;
  void recycle_block(retire_block* block) noexcept;

  void barrier();
  // Blocks (outside any read section) until pending memory is back under the soft limits.
  void backpressure_wait() noexcept;
  void check_limits_after_submit() noexcept;
  // No block could be had: reclaim `object` on this thread, safely.
  void emergency_reclaim(void* object, void (*deleter)(void*), std::size_t bytes) noexcept;
  // An emergency object deferred to the end of a read section was reclaimed.
  void emergency_done(std::size_t bytes) noexcept;

  domain_stats stats() const noexcept;

  // fork() support (defined in fork.cc, which describes the protocol). Called by the fork
  // handlers with the engine list locked; `generation` is odd while a fork parks the threads.
  void request_park_for_fork(std::uint32_t generation) noexcept;
  void wait_parked_for_fork(std::uint32_t generation) noexcept;
  void hold_shards_for_fork() noexcept;
  void release_shards_after_fork() noexcept;
  void unpark_after_fork(std::uint32_t generation) noexcept;  // parent
  // Child, in order: make the state the threads left consistent (before any thread starts),
  // start new threads, run a reclamation a dead thread had postponed.
  void reset_after_fork_child(std::uint32_t generation) noexcept;
  void restart_after_fork_child() noexcept;
  void reclaim_adopted_after_fork_child(void* object, void (*deleter)(void*)) noexcept;
  // Links in the list of live engines (fork.cc), under that list's mutex.
  reclaim_engine* fork_prev_ = nullptr;
  reclaim_engine* fork_next_ = nullptr;

 private:
  // Parks the calling engine thread while a fork() is in progress; called only at points
  // where the thread holds no batch, block or lock (its worker backlog is in a member).
  void fork_park_point(std::atomic<std::uint32_t>& parked) noexcept;
  void gp_thread_main() noexcept;
  void worker_thread_main() noexcept;
  void process_batch(batch_node* newest) noexcept;
  void pass_to_worker(batch_node* newest, batch_node* oldest) noexcept;
  void reclaim_block(retire_block* block) noexcept;
  void deallocate_block(retire_block* block) noexcept;
  void wake_gp_thread() noexcept;
  // The GP thread's view of request_gp(): when it answers the pending request itself.
  struct request_timer {
    std::optional<std::chrono::steady_clock::time_point> deadline;  // set while one is pending
    std::uint64_t request = 0;  // the requested_gp_ value the deadline was set for
  };
  // Whether a request is pending (not yet answered by a completed grace period); starts,
  // keeps or clears the timer.
  bool track_request(request_timer& timer,
                     std::chrono::steady_clock::time_point now) const noexcept;
  // The GP thread's view of the submitted chain it leaves in submitted_ for now (hold_batch()).
  struct batch_hold {
    std::optional<std::chrono::steady_clock::time_point> until;  // set while holding
    const batch_node* newest = nullptr;  // submitted_'s head when last looked at
    std::uint64_t cookie = 0;            // the largest gp_cookie from `newest` down
  };
  // Whether to leave the submitted chain in submitted_ for now. While other threads run
  // grace periods (one completed within requested_gp_delay), a chain of blocks waits, at
  // most requested_gp_delay, for one of theirs that covers its cookies (run_grace_period()
  // wakes the GP thread for it), instead of the GP thread running one of its own, which
  // under load costs far more. Never with a barrier() marker in the chain, pending memory
  // over half the soft limits, a flush requested or a stop under way. Starts, keeps or
  // clears `hold`, and publishes its cookie in held_cookie_.
  bool hold_batch(batch_hold& hold, std::chrono::steady_clock::time_point now) noexcept;
  void end_hold(batch_hold& hold) noexcept;
  bool foreign_gp_recent() const noexcept;
  bool over_soft_limit() const noexcept;
  // Child of fork(): pending = what the child's blocks hold (reset_after_fork_child()).
  void recount_pending_after_fork_child() noexcept;
  std::uint64_t pending_objects() const noexcept;
  std::uint64_t pending_bytes() const noexcept;

  domain& owner_;

  // (R1)/(R2): blocks and markers waiting for the GP thread, newest first.
  alignas(64) std::atomic<batch_node*> submitted_{nullptr};
  // Wake-up protocol of the GP thread (a Dekker pair with submit(); see gp_thread_main).
  alignas(64) std::atomic<std::uint32_t> gp_wake_{0};
  std::atomic<bool> gp_sleeping_{false};
  std::atomic<bool> flush_requested_{false};
  // The largest cookie passed to request_gp(): the request is pending while it is above
  // gp_.completed. The GP thread answers a pending request requested_gp_delay after it first
  // sees it, unless a grace period run elsewhere answers it first.
  std::atomic<std::uint64_t> requested_gp_{0};
  // When the pending request began (coarse monotonic clock, ns), and how long it may wait
  // before the next requester answers it itself (a quarter of requested_gp_delay).
  std::atomic<std::int64_t> request_since_ns_{0};
  const std::int64_t gp_delay_ns_;  // requested_gp_delay
  const std::int64_t takeover_after_ns_;
  // When a thread other than the GP thread last completed a grace period (coarse monotonic
  // clock, ns; 0: never): while that is recent, the GP thread holds batches (hold_batch()).
  std::atomic<std::int64_t> foreign_gp_ns_{0};
  // The cookie of the chain the GP thread holds, 0 if none: a grace period that covers it
  // wakes the GP thread.
  std::atomic<std::uint64_t> held_cookie_{0};
  // Threads owing this engine deferred work (deferred_use_begin/end), plus kDeferredWaiter
  // once the destructor waits for them.
  static constexpr std::uint32_t kDeferredWaiter = std::uint32_t{1} << 31;
  std::atomic<std::uint32_t> deferred_users_{0};
  std::atomic<bool> open_blocks_possible_{false};
  std::atomic<bool> stopping_{false};

  // (R1)/(R2): batches past their grace period, newest first, for the worker.
  alignas(64) std::atomic<batch_node*> reclaim_queue_{nullptr};
  std::atomic<std::uint32_t> worker_wake_{0};
  std::atomic<bool> worker_sleeping_{false};
  std::atomic<bool> gp_thread_done_{false};
  // Bumped after every reclaimed block; back-pressure waiters sleep on it.
  std::atomic<std::uint32_t> progress_{0};
  // Threads in backpressure_wait(). While there is one, every thread that submits a block
  // with the backlog over the soft limits joins the wait: the waiter waits for the soft
  // limits, and a thread that kept the backlog between the limits would starve it.
  std::atomic<std::uint32_t> progress_waiters_{0};

  alignas(64) std::atomic<std::uint64_t> retired_objects_{0};
  std::atomic<std::uint64_t> retired_bytes_{0};
  std::atomic<std::uint64_t> peak_pending_objects_{0};
  std::atomic<std::uint64_t> peak_pending_bytes_{0};
  std::atomic<std::uint64_t> blocks_{0};
  std::atomic<std::uint64_t> forced_drains_{0};
  std::atomic<std::uint64_t> backpressure_waits_{0};
  std::atomic<std::uint64_t> emergency_frees_{0};
  std::atomic<std::uint64_t> emergency_outstanding_{0};
  alignas(64) std::atomic<std::uint64_t> reclaimed_objects_{0};
  std::atomic<std::uint64_t> reclaimed_bytes_{0};
  std::atomic<std::uint64_t> batches_{0};
  std::atomic<std::uint64_t> batches_without_own_gp_{0};
  std::atomic<std::uint64_t> grace_periods_{0};

  // fork() support (fork.cc). fork_park_ is odd while a fork parks the threads; each thread
  // acknowledges by storing that value into its word. The worker keeps the nodes it took but
  // has not reached yet in worker_backlog_ (oldest first; only the worker touches it, and the
  // forking thread while the worker is parked), so that it can park between two blocks.
  alignas(64) std::atomic<std::uint32_t> fork_park_{0};
  std::atomic<std::uint32_t> gp_parked_{0};
  std::atomic<std::uint32_t> worker_parked_{0};
  batch_node* worker_backlog_ = nullptr;
  // Each shard's open block while the fork holds the shards (one slot per shard).
  std::unique_ptr<retire_block*[]> fork_held_blocks_;

  std::thread gp_thread_;
  std::thread worker_thread_;
};

// Marks the calling thread as running deleters for its lifetime: barrier() and back-pressure
// waits are refused meanwhile, and retire() calls made by the deleters are published when it
// ends (after they have reached a shard or the engine), for barrier()'s chained-retire check.
class deleter_scope {
 public:
  deleter_scope() noexcept : was_running_(tls_reader.running_deleters) {
    tls_reader.running_deleters = true;
  }
  ~deleter_scope() {
    publish_retires_by_deleters();
    tls_reader.running_deleters = was_running_;
  }
  deleter_scope(const deleter_scope&) = delete;
  deleter_scope& operator=(const deleter_scope&) = delete;

  // Publishes the retire() calls deleters made so far on this thread.
  static void publish_retires_by_deleters() noexcept;

 private:
  bool was_running_;
};

// Per-thread work postponed to the end of the outermost read section
// (detail::run_deferred_work_slow runs it). Each returns false when its fixed room is full.
bool defer_emergency_reclaim(reclaim_engine* engine, void* object, void (*deleter)(void*),
                             std::size_t bytes) noexcept;
void defer_backpressure_wait(reclaim_engine* engine) noexcept;
void defer_grace_period(reclaim_engine* engine) noexcept;

}  // namespace grace::detail
