// The engine behind grace::domain: grace-period thread, reclaim worker, barrier, limits.
#include "reclaim_engine_internal.h"

#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <optional>
#include <stdexcept>
#include <system_error>

#include "fork_internal.h"
#include "futex_internal.h"

namespace grace::detail {
namespace {

// The clock of request hand-overs and of foreign_gp_ns_: CLOCK_MONOTONIC_COARSE, a few ns to
// read where steady_clock costs ~25 (it is read on every pool request while one is pending),
// at the kernel tick's resolution (1-4 ms), which only rounds those times.
std::int64_t coarse_now_ns() noexcept {
  timespec now;
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

// How long a back-pressure or emergency waiter sleeps between checks of its condition; the
// worker wakes a back-pressure waiter sooner, once the backlog is under the soft limits.
constexpr std::chrono::milliseconds kRecheckInterval{1};

// retire() calls made by deleters, in every domain, published after each deleter returned.
// barrier() repeats while it grows: a deleter may retire into any domain.
std::atomic<std::uint64_t> retires_by_deleters{0};

// `retired - reclaimed`, or 0: `retired` may be a snapshot older than `reclaimed` (the thread
// was preempted between the two reads while later objects were retired and reclaimed).
std::uint64_t backlog(std::uint64_t retired, std::uint64_t reclaimed) noexcept {
  return retired > reclaimed ? retired - reclaimed : 0;
}

void raise_to(std::atomic<std::uint64_t>& peak, std::uint64_t value) noexcept {
  std::uint64_t seen = peak.load(std::memory_order_relaxed);
  // Relaxed: a statistic.
  while (seen < value &&
         !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Names the calling engine thread (top -H, gdb, perf) and, for a `nice` above 0, raises its
// nice value to `nice` if that is above the one it inherited; 0 keeps the inherited one,
// which may be below 0. On Linux, PRIO_PROCESS with who = 0 is the calling thread alone.
void set_up_engine_thread(const char* name, int nice) noexcept {
  ::pthread_setname_np(::pthread_self(), name);  // at most 15 characters; cannot fail then
  if (nice <= 0) return;
  errno = 0;
  const int inherited = ::getpriority(PRIO_PROCESS, 0);
  if (errno != 0 || nice <= inherited) return;
  if (::setpriority(PRIO_PROCESS, 0, nice) != 0) {
    std::fprintf(stderr,
                 "grace: cannot set the %s thread's nice value to %d (%s); it runs at %d.\n",
                 name, nice, std::strerror(errno), inherited);
  }
}

// The engine whose GP thread the calling thread is, if any: its grace periods are not the
// "run elsewhere" ones that hold_batch() waits for.
constinit thread_local const reclaim_engine* tls_gp_thread_of = nullptr;

// What a chain of submitted nodes holds, from `newest` down to, not including, `end`.
struct chain_summary {
  batch_node* oldest = nullptr;
  std::uint64_t newest_cookie = 0;  // the largest gp_cookie of its blocks
  bool has_objects = false;
  bool has_marker = false;  // a barrier_marker
};
chain_summary summarize(batch_node* newest, const batch_node* end = nullptr) noexcept {
  chain_summary summary;
  for (batch_node* node = newest; node != end && node != nullptr; node = node->next) {
    summary.oldest = node;
    if (node->node_kind == batch_node::kind::objects) {
      summary.has_objects = true;
      summary.newest_cookie =
          std::max(summary.newest_cookie, static_cast<retire_block*>(node)->gp_cookie);
    } else {
      summary.has_marker = true;
    }
  }
  return summary;
}

// Pushes the chain newest..oldest onto a Treiber stack; returns the previous head.
batch_node* push_chain(std::atomic<batch_node*>& stack, batch_node* newest,
                       batch_node* oldest) noexcept {
  batch_node* head = stack.load(std::memory_order_relaxed);
  do {
    oldest->next = head;
    // SeqCst (R1): publishes the chain's fields to the taker (Release would do for that);
    // SeqCst also orders this push before the caller's load of the sleeping flag (a Dekker
    // pair with the sleeper's flag store and stack load).
  } while (!stack.compare_exchange_weak(head, newest, std::memory_order_seq_cst,
                                        std::memory_order_relaxed));
  return head;
}

}  // namespace

reclaim_engine::reclaim_engine(domain& owner)
    : owner_(owner),
      gp_delay_ns_(
          std::chrono::duration_cast<std::chrono::nanoseconds>(owner.options_.requested_gp_delay)
              .count()),
      takeover_after_ns_(gp_delay_ns_ / 4),
      fork_held_blocks_(std::make_unique<retire_block*[]>(owner.shard_mask_ + 1)) {
  if (const int error = install_fork_handlers(); error != 0) {
    throw std::system_error(error, std::generic_category(),
                            "grace::domain: pthread_atfork (fork() support)");
  }
  try {
    worker_thread_ = std::thread([this] { worker_thread_main(); });
    gp_thread_ = std::thread([this] { gp_thread_main(); });
  } catch (...) {
    stopping_.store(true, std::memory_order_seq_cst);  // SeqCst: see ~reclaim_engine
    gp_thread_done_.store(true, std::memory_order_seq_cst);
    worker_wake_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(worker_wake_);
    if (worker_thread_.joinable()) worker_thread_.join();
    throw;
  }
  add_engine_for_fork(this);  // from here on, fork() parks and restarts the threads
}

reclaim_engine::~reclaim_engine() {
  // A thread may still owe this engine a grace period or a back-pressure wait at the end of
  // its read section (thread_registry.cc); it runs that on the engine, so wait for it.
  // Acquire: whatever the last user's work did happens before the engine goes; pairs with
  // the Release decrement in deferred_use_end(). The waiter bit asks the last user to wake us.
  std::uint32_t users =
      deferred_users_.fetch_or(kDeferredWaiter, std::memory_order_acquire) | kDeferredWaiter;
  const auto warn_at = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  bool warned = false;
  while (users != kDeferredWaiter) {
    futex_wait(deferred_users_, users, kRecheckInterval);
    if (!warned && std::chrono::steady_clock::now() >= warn_at) {
      warned = true;
      std::fprintf(stderr,
                   "grace: a domain is being destroyed while %u thread(s) owe it a grace "
                   "period or back-pressure wait at the end of their read section; waiting "
                   "for those sections to end.\n",
                   users & ~kDeferredWaiter);
    }
    users = deferred_users_.load(std::memory_order_acquire);  // Acquire: as above
  }
  remove_engine_for_fork(this);  // before the threads stop: fork() no longer parks them
  // SeqCst: the GP thread checks stopping_ after its sleeping-flag store (Dekker pair).
  stopping_.store(true, std::memory_order_seq_cst);
  wake_gp_thread();
  gp_thread_.join();
  worker_thread_.join();
}

void reclaim_engine::submit(batch_node* node) noexcept {
  node->next = nullptr;
  push_chain(submitted_, node, node);
  // SeqCst: Dekker pair with gp_thread_main's gp_sleeping_ store and submitted_ load; one
  // of the two sides sees the other, so a push is never left asleep.
  if (gp_sleeping_.load(std::memory_order_seq_cst)) wake_gp_thread();
}

void reclaim_engine::wake_gp_thread() noexcept {
  // SeqCst: a waiter that read the old value before sleeping is woken; pairs with the load
  // in gp_thread_main that precedes futex_wait.
  gp_wake_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(gp_wake_);
}

void reclaim_engine::hand_in(retire_block* block) noexcept {
  block->gp_cookie = owner_.gp_cookie();
  const std::uint64_t objects =
      retired_objects_.fetch_add(block->count, std::memory_order_relaxed) + block->count;
  const std::uint64_t bytes =
      retired_bytes_.fetch_add(block->bytes, std::memory_order_relaxed) + block->bytes;
  blocks_.fetch_add(1, std::memory_order_relaxed);
  raise_to(peak_pending_objects_,
           backlog(objects, reclaimed_objects_.load(std::memory_order_relaxed)));
  raise_to(peak_pending_bytes_, backlog(bytes, reclaimed_bytes_.load(std::memory_order_relaxed)));
  submit(block);
}

std::uint64_t reclaim_engine::pending_objects() const noexcept {
  // Relaxed: an estimate; reclaimed may be read ahead of retired, hence the clamp.
  const std::uint64_t reclaimed = reclaimed_objects_.load(std::memory_order_relaxed);
  return backlog(retired_objects_.load(std::memory_order_relaxed), reclaimed);
}

std::uint64_t reclaim_engine::pending_bytes() const noexcept {
  const std::uint64_t reclaimed = reclaimed_bytes_.load(std::memory_order_relaxed);
  return backlog(retired_bytes_.load(std::memory_order_relaxed), reclaimed);
}

bool reclaim_engine::over_soft_limit() const noexcept {
  return pending_objects() > owner_.options_.soft_limit_objects ||
         pending_bytes() > owner_.options_.soft_limit_bytes;
}

void reclaim_engine::check_limits_after_submit() noexcept {
  const domain_options& options = owner_.options_;
  const std::uint64_t objects = pending_objects();
  const std::uint64_t bytes = pending_bytes();
  if (objects <= options.soft_limit_objects && bytes <= options.soft_limit_bytes) return;
  request_flush();
  // A thread waits past the hard limits, or while another waits (see progress_waiters_).
  // Relaxed: a hint; the hard limits alone bound the backlog.
  if (objects <= options.hard_limit_objects && bytes <= options.hard_limit_bytes &&
      progress_waiters_.load(std::memory_order_relaxed) == 0) {
    return;
  }
  // A deleter must never wait: on the worker it would wait for itself.
  if (tls_reader.running_deleters) return;
  if (in_read_section()) {
    defer_backpressure_wait(this);  // never wait inside a read section
  } else {
    backpressure_wait();
  }
}

void reclaim_engine::request_flush() noexcept {
  // Relaxed: the flag is only a hint; wake_gp_thread()'s SeqCst RMW orders it for the sleeper.
  if (!flush_requested_.exchange(true, std::memory_order_relaxed)) {
    forced_drains_.fetch_add(1, std::memory_order_relaxed);
    wake_gp_thread();
  }
}

bool reclaim_engine::request_gp(std::uint64_t cookie, bool claim_overdue) noexcept {
  std::uint64_t previous = requested_gp_.load(std::memory_order_relaxed);
  // SeqCst: the caller's cookie read happens-before a GP thread that reads this value, so
  // the grace period it runs takes a ticket >= cookie (Release would do for that); SeqCst
  // also orders the raise before the `completed` load below, against the GP thread's
  // publication of `completed` and its load of this word (a Dekker pair): either it sees
  // this request after its grace period, or we see the previous request answered and wake it.
  while (previous < cookie &&
         !requested_gp_.compare_exchange_weak(previous, cookie, std::memory_order_seq_cst,
                                              std::memory_order_relaxed)) {
  }
  const bool raised = previous < cookie;
  // SeqCst: the other half of the Dekker pair above.
  if (previous <= owner_.gp_.completed.load(std::memory_order_seq_cst)) {
    if (!raised) return false;  // cookie <= previous: already answered
    // A new request: its clock starts now. Relaxed: a hint (a stale stamp only moves a
    // takeover earlier or later).
    request_since_ns_.store(coarse_now_ns(), std::memory_order_relaxed);
    // An awake GP thread looks again before it sleeps, so only a sleeping one needs waking.
    // SeqCst: with gp_sleeping_'s store, the same Dekker pair as in submit().
    if (gp_sleeping_.load(std::memory_order_seq_cst)) wake_gp_thread();
    return false;
  }
  // An earlier request is pending, and covers ours or will be answered with it. Suggest a
  // takeover once it has waited a quarter of the delay, unless a grace period that answers
  // it has started, or the caller runs deleters (the worker must not stall in a wait).
  if (!claim_overdue || takeover_after_ns_ == 0 || tls_reader.running_deleters) return false;
  // Relaxed: a hint; a ticket taken after the raise is >= the request.
  const std::uint64_t requested = raised ? cookie : previous;
  if (owner_.gp_.started.load(std::memory_order_relaxed) >= requested) return false;
  std::int64_t since = request_since_ns_.load(std::memory_order_relaxed);  // Relaxed: a hint
  const std::int64_t now = coarse_now_ns();
  if (now - since < takeover_after_ns_) return false;
  // One taker per quarter delay: restarting the clock claims it. Relaxed: a hint.
  return request_since_ns_.compare_exchange_strong(since, now, std::memory_order_relaxed);
}

void reclaim_engine::deferred_use_begin() noexcept {
  // Relaxed: the destructor reads the count only after this thread's decrement
  // (deferred_use_end), which orders everything before it.
  deferred_users_.fetch_add(1, std::memory_order_relaxed);
}

void reclaim_engine::deferred_use_end() noexcept {
  // Release: the deferred work is done before the destructor sees the count drop; pairs with
  // its Acquire loads. The waiter bit comes back in the same step, so nothing of the engine
  // is read after the decrement that may let the destructor free it; futex_wake_all() uses
  // the address only as a key.
  if (deferred_users_.fetch_sub(1, std::memory_order_release) == (kDeferredWaiter | 1)) {
    futex_wake_all(deferred_users_);
  }
}

void reclaim_engine::note_block_opened() noexcept {
  // SeqCst: the second half of the Dekker pair begun by retire_slow()'s SeqCst store of the
  // block, against flush_shards()'s flag store and scan: either the scan sees the block, or
  // this load sees the flag cleared and re-arms it.
  if (open_blocks_possible_.load(std::memory_order_seq_cst)) return;
  // SeqCst: Dekker pair with the GP thread's gp_sleeping_ store and its load of this flag
  // before an untimed sleep: either it sleeps only until the drain deadline, or we wake it.
  open_blocks_possible_.store(true, std::memory_order_seq_cst);
  if (gp_sleeping_.load(std::memory_order_seq_cst)) wake_gp_thread();
}

void reclaim_engine::flush_shards() noexcept {
  // SeqCst: cleared before the scan, so a block opened after the scan re-arms it (pairs
  // with note_block_opened()).
  open_blocks_possible_.store(false, std::memory_order_seq_cst);
  const unsigned count = owner_.shard_mask_ + 1;
  for (unsigned i = 0; i < count; ++i) {
    retire_shard& shard = owner_.shards_[i];
    // SeqCst: the scan half of the Dekker pair with retire_slow()'s SeqCst store.
    if (shard.open.load(std::memory_order_seq_cst) == nullptr) continue;
    retire_block* block;
    // Acquire (R3): take the shard and its block; pairs with the holder's Release (R4). While
    // another thread holds it, wait: it hands its block in or puts it back first (I0).
    while ((block = shard.open.exchange(shard_held(), std::memory_order_acquire)) ==
           shard_held()) {
      std::this_thread::yield();
    }
    if (block != nullptr) hand_in(block);
    // Release (R4): end our hold.
    shard.open.store(nullptr, std::memory_order_release);
  }
}

void reclaim_engine::run_grace_period() noexcept {
  // fork(): never copied with liburcu's grace-period lock held, nor with a ticket taken and
  // not completed. Never inside a read section (callers check), so it may wait for a fork.
  fork_gate_scope gate(fork_gate::grace_period);
  // SeqCst: the ticket is ordered after every cookie read that returned a smaller value
  // (pairs with the SeqCst fence in domain::gp_cookie()); synchronize_rcu() then begins
  // after the ticket.
  const std::uint64_t ticket = owner_.gp_.started.fetch_add(1, std::memory_order_seq_cst) + 1;
  urcu_memb_synchronize_rcu();
  // TSan: every reader that could see an object retired before the ticket has left; the
  // Release below passes this on to gp_elapsed() callers, and the batch push to the worker.
  grace_period_elapsed();
  std::uint64_t seen = owner_.gp_.completed.load(std::memory_order_relaxed);
  // SeqCst: publishes that grace period `ticket` completed; pairs with the Acquire load in
  // domain::gp_elapsed() (Release would do for that), and is the store that request_gp()'s
  // and the GP thread's SeqCst `completed` loads order against. A max, so a late finisher
  // never moves it backwards.
  while (seen < ticket &&
         !owner_.gp_.completed.compare_exchange_weak(seen, ticket, std::memory_order_seq_cst,
                                                     std::memory_order_relaxed)) {
  }
  grace_periods_.fetch_add(1, std::memory_order_relaxed);
  if (tls_gp_thread_of == this) return;
  // Relaxed: a hint for hold_batch(); what it lets through still waits for `completed`.
  foreign_gp_ns_.store(coarse_now_ns(), std::memory_order_relaxed);
  // SeqCst: a Dekker pair with hold_batch()'s store of the cookie and its `completed` load:
  // either the GP thread sees this grace period, or we see its cookie. (When our CAS did not
  // run, the thread whose CAS raised `completed` past our ticket made this check, or is the
  // GP thread, which looks again in hold_batch().)
  const std::uint64_t held = held_cookie_.load(std::memory_order_seq_cst);
  if (held != 0 && held <= ticket) wake_gp_thread();
}

bool reclaim_engine::foreign_gp_recent() const noexcept {
  // Relaxed: a hint; an old time only lets a batch go at once, as it always went.
  const std::int64_t at = foreign_gp_ns_.load(std::memory_order_relaxed);
  return at != 0 && coarse_now_ns() - at < gp_delay_ns_;
}

bool reclaim_engine::hold_batch(batch_hold& hold,
                                std::chrono::steady_clock::time_point now) noexcept {
  const domain_options& options = owner_.options_;
  // Acquire: a look at the chain without taking it; pairs with the SeqCst pushes (R1), whose
  // release sequence every later push continues. Only this thread takes from submitted_, so
  // the nodes below the head stay as they were pushed while it looks.
  batch_node* newest = submitted_.load(std::memory_order_acquire);
  // Relaxed: hints; each only lets the chain go at once, as it always went.
  const bool hold_allowed =
      newest != nullptr && options.batching != batching::per_object &&
      !flush_requested_.load(std::memory_order_relaxed) &&
      !stopping_.load(std::memory_order_relaxed) &&
      pending_objects() <= options.soft_limit_objects / 2 &&
      pending_bytes() <= options.soft_limit_bytes / 2 && foreign_gp_recent();
  // Only the nodes pushed since the last look: those below them have not changed.
  const chain_summary added = hold_allowed ? summarize(newest, hold.newest) : chain_summary{};
  if (!hold_allowed || added.has_marker) {  // a barrier() waits for its marker
    end_hold(hold);
    return false;
  }
  hold.cookie = std::max(hold.cookie, added.newest_cookie);
  hold.newest = newest;
  // SeqCst: the other half of run_grace_period()'s Dekker pair, with the load below.
  held_cookie_.store(hold.cookie, std::memory_order_seq_cst);
  if (!hold.until) hold.until = now + options.requested_gp_delay;
  // SeqCst: observes a foreign grace period's completion (the Dekker pair above). A covered
  // chain goes now, and process_batch() runs no grace period for it unless nodes pushed
  // since raise its cookie.
  if (owner_.gp_.completed.load(std::memory_order_seq_cst) >= hold.cookie || now >= *hold.until) {
    end_hold(hold);
    return false;
  }
  return true;
}

void reclaim_engine::end_hold(batch_hold& hold) noexcept {
  if (!hold.until) return;  // no store, so the hot paths that read this line keep it shared
  held_cookie_.store(0, std::memory_order_relaxed);  // Relaxed: a stale cookie costs one wake
  hold = {};
}

bool reclaim_engine::track_request(request_timer& timer,
                                   std::chrono::steady_clock::time_point now) const noexcept {
  // SeqCst, and `completed` first, which is load-bearing: the GP-thread half of
  // request_gp()'s Dekker pair. Whatever completion we read precedes a later requester's
  // `completed` load, so a requester whose raise we miss sees the request we read answered,
  // and wakes us. A request read here has its cookie ordered before the ticket
  // run_grace_period() then takes.
  const std::uint64_t completed = owner_.gp_.completed.load(std::memory_order_seq_cst);
  const std::uint64_t requested = requested_gp_.load(std::memory_order_seq_cst);
  if (requested <= completed) {
    timer.deadline.reset();  // answered, perhaps by a grace period run elsewhere
    return false;
  }
  // A new request, or a newer one after the one the deadline was set for was answered: its
  // delay starts now.
  if (!timer.deadline || completed >= timer.request) {
    timer.deadline = now + owner_.options_.requested_gp_delay;
    timer.request = requested;
  }
  return true;
}

void reclaim_engine::gp_thread_main() noexcept {
  set_up_engine_thread("grace-gp", 0);
  tls_gp_thread_of = this;
  using clock = std::chrono::steady_clock;
  const auto drain_interval = owner_.options_.drain_interval;
  auto last_flush = clock::now();
  request_timer request;
  batch_hold hold;
  for (;;) {
    // fork(): the safe point, holding no batch and no shard (a held chain stays in
    // submitted_). Relaxed: a hint; fork_park_point() reads it again with Acquire.
    if (fork_park_.load(std::memory_order_relaxed) & 1) [[unlikely]] fork_park_point(gp_parked_);
    batch_node* batch = nullptr;
    if (!hold_batch(hold, clock::now())) {
      // Acquire (R2): take every submitted node with the fields its pusher wrote; pairs with
      // the SeqCst push (R1) in submit().
      batch = submitted_.exchange(nullptr, std::memory_order_acquire);
    }
    if (batch != nullptr) process_batch(batch);

    const auto now = clock::now();
    // Relaxed: flush_requested_ is a hint; see request_flush().
    if (flush_requested_.exchange(false, std::memory_order_relaxed) ||
        (now - last_flush >= drain_interval &&
         open_blocks_possible_.load(std::memory_order_relaxed))) {
      flush_shards();
      last_flush = now;
      continue;
    }
    if (batch != nullptr) continue;
    if (track_request(request, now) && now >= *request.deadline) {
      run_grace_period();
      request.deadline.reset();
      continue;
    }
    // Acquire: everything submitted before stop was requested is in submitted_ now.
    if (stopping_.load(std::memory_order_acquire)) {
      flush_shards();
      // Acquire (R2): see above.
      batch = submitted_.exchange(nullptr, std::memory_order_acquire);
      if (batch == nullptr) break;
      process_batch(batch);
      continue;
    }

    // Sleep until a push, a request, the drain deadline of an open block, or a grace period
    // that covers a held chain. Acquire: pairs with the SeqCst fetch_add in
    // wake_gp_thread(); from run_grace_period(), it makes the covering completion visible.
    const std::uint32_t seen = gp_wake_.load(std::memory_order_acquire);
    // SeqCst: Dekker pair with submit()/note_block_opened(): after this store, either we see
    // their push/flag below or they see us asleep and bump gp_wake_.
    gp_sleeping_.store(true, std::memory_order_seq_cst);
    // SeqCst: the other half of the Dekker pair above. A held chain is no work until a
    // push adds to it, a grace period covers it, or its hold ends. The `completed` load
    // observes a covering grace period whose wake `seen` already counts: the Acquire load of
    // gp_wake_ made its completion visible (Relaxed would do).
    const batch_node* submitted = submitted_.load(std::memory_order_seq_cst);
    const bool work_waiting = (submitted != nullptr && submitted != hold.newest) ||
                              (hold.until && owner_.gp_.completed.load(
                                                 std::memory_order_seq_cst) >= hold.cookie) ||
                              flush_requested_.load(std::memory_order_seq_cst) ||
                              stopping_.load(std::memory_order_seq_cst) ||
                              // SeqCst (fork): a Dekker pair with request_park_for_fork()'s
                              // store, then its bump of gp_wake_.
                              (fork_park_.load(std::memory_order_seq_cst) & 1) != 0;
    if (!work_waiting) {
      // Wake by the drain deadline of an open block and by a pending request's deadline.
      std::optional<clock::time_point> deadline;
      // SeqCst: see note_block_opened().
      if (open_blocks_possible_.load(std::memory_order_seq_cst)) {
        deadline = last_flush + drain_interval;
      }
      // A request made after this check sees its predecessor answered and bumps gp_wake_.
      if (track_request(request, clock::now())) {
        deadline = deadline ? std::min(*deadline, *request.deadline) : *request.deadline;
      }
      if (hold.until) deadline = deadline ? std::min(*deadline, *hold.until) : *hold.until;
      if (!deadline) {
        futex_wait(gp_wake_, seen);
      } else if (const auto left = *deadline - clock::now(); left > clock::duration::zero()) {
        futex_wait(gp_wake_, seen, left);
      }
    }
    // Relaxed: only this thread reads its own flag back; wakers tolerate a stale true.
    gp_sleeping_.store(false, std::memory_order_relaxed);
  }
  // Release: the worker may exit once it sees this and an empty queue; pairs with its Acquire.
  gp_thread_done_.store(true, std::memory_order_release);
  // SeqCst: as in wake_gp_thread().
  worker_wake_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(worker_wake_);
}

void reclaim_engine::process_batch(batch_node* newest) noexcept {
  // The chain runs newest -> oldest.
  if (owner_.options_.batching == batching::per_object) {
    // One grace period per object: reverse to oldest first and hand over one node at a time.
    batch_node* oldest_first = nullptr;
    while (newest != nullptr) {
      batch_node* next = newest->next;
      newest->next = oldest_first;
      oldest_first = newest;
      newest = next;
    }
    while (oldest_first != nullptr) {
      batch_node* next = oldest_first->next;
      if (oldest_first->node_kind == batch_node::kind::objects) {
        run_grace_period();
        batches_.fetch_add(1, std::memory_order_relaxed);
      }
      pass_to_worker(oldest_first, oldest_first);
      oldest_first = next;
    }
    return;
  }
  const chain_summary chain = summarize(newest);
  if (chain.has_objects) {
    // (I3): a grace period that began after every block in the chain was submitted, unless
    // one already did: run by synchronize(), a back-pressured retirer, or a pool's thread
    // (synchronize_when_unpinned()) while hold_batch() held the chain.
    if (!owner_.gp_elapsed(chain.newest_cookie)) {
      run_grace_period();
    } else {
      batches_without_own_gp_.fetch_add(1, std::memory_order_relaxed);
    }
    batches_.fetch_add(1, std::memory_order_relaxed);
  }
  pass_to_worker(newest, chain.oldest);
}

void reclaim_engine::pass_to_worker(batch_node* newest, batch_node* oldest) noexcept {
  push_chain(reclaim_queue_, newest, oldest);
  // SeqCst: Dekker pair with worker_thread_main's sleeping store and queue load.
  if (worker_sleeping_.load(std::memory_order_seq_cst)) {
    // SeqCst: pairs with the worker's load of worker_wake_ before futex_wait.
    worker_wake_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(worker_wake_);
  }
}

void reclaim_engine::worker_thread_main() noexcept {
  set_up_engine_thread("grace-reclaim", owner_.options_.worker_nice);
  deleter_scope running_deleters;  // for the worker's whole life
  for (;;) {
    // fork(): the safe point, between two nodes (the rest of the chain is in
    // worker_backlog_, which the child's worker resumes). Relaxed: a hint;
    // fork_park_point() reads it again with Acquire.
    if (fork_park_.load(std::memory_order_relaxed) & 1) [[unlikely]] {
      fork_park_point(worker_parked_);
    }
    if (batch_node* node = worker_backlog_) {
      worker_backlog_ = node->next;  // read before a marker's owner may return
      if (node->node_kind == batch_node::kind::objects) {
        reclaim_block(static_cast<retire_block*>(node));
      } else {
        auto* marker = static_cast<barrier_marker*>(node);
        // Release: everything reclaimed so far happens-before barrier() returns; pairs with
        // the Acquire load in barrier(). The marker is not touched after this store.
        marker->done.store(1, std::memory_order_release);
        futex_wake_all(marker->done);
      }
      continue;
    }
    // Acquire (R2): pairs with the SeqCst push (R1) in pass_to_worker().
    batch_node* chain = reclaim_queue_.exchange(nullptr, std::memory_order_acquire);
    if (chain == nullptr) {
      // Acquire: pairs with the Release store at the GP thread's exit.
      if (gp_thread_done_.load(std::memory_order_acquire)) {
        // Acquire (R2): a last take, in case the final batch raced with the flag.
        chain = reclaim_queue_.exchange(nullptr, std::memory_order_acquire);
        if (chain == nullptr) break;
      } else {
        // Acquire: pairs with the SeqCst fetch_add of a waker.
        const std::uint32_t seen = worker_wake_.load(std::memory_order_acquire);
        // SeqCst: Dekker pair with pass_to_worker()'s push and flag load.
        worker_sleeping_.store(true, std::memory_order_seq_cst);
        // SeqCst: the other half of the pair (and, for fork_park_, with
        // request_park_for_fork()'s store, then its bump of worker_wake_).
        if (reclaim_queue_.load(std::memory_order_seq_cst) == nullptr &&
            !gp_thread_done_.load(std::memory_order_seq_cst) &&
            (fork_park_.load(std::memory_order_seq_cst) & 1) == 0) {
          futex_wait(worker_wake_, seen);
        }
        // Relaxed: only read by wakers, who tolerate a stale true.
        worker_sleeping_.store(false, std::memory_order_relaxed);
        continue;
      }
    }
    // (I4): reverse newest-first into oldest-first; the top of the loop takes them in turn.
    batch_node* oldest_first = nullptr;
    while (chain != nullptr) {
      batch_node* next = chain->next;
      chain->next = oldest_first;
      oldest_first = chain;
      chain = next;
    }
    worker_backlog_ = oldest_first;
  }
}

void reclaim_engine::reclaim_block(retire_block* block) noexcept {
  retire_entry* entries = block->entries();
  const std::uint32_t count = block->count;
  const std::uint64_t bytes = block->bytes;
  for (std::uint32_t i = 0; i < count; ++i) entries[i].deleter(entries[i].object);
  deleter_scope::publish_retires_by_deleters();  // before any later barrier marker is reached
  recycle_block(block);
  reclaimed_objects_.fetch_add(count, std::memory_order_relaxed);
  reclaimed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  // SeqCst: Dekker pair with backpressure_wait()'s waiter count and progress load.
  progress_.fetch_add(1, std::memory_order_seq_cst);
  // SeqCst: as above. Waiters wait for the soft limits: wake them only once those are met.
  if (progress_waiters_.load(std::memory_order_seq_cst) != 0 && !over_soft_limit()) {
    futex_wake_all(progress_);
  }
}

retire_block* reclaim_engine::take_block(unsigned shard_index) noexcept {
  retire_shard& shard = owner_.shards_[shard_index];
  for (auto& slot : shard.spare) {
    if (slot.load(std::memory_order_relaxed) == nullptr) continue;
    // Acquire (R3): the block's reset header, written by recycle_block(); pairs with (R4).
    if (retire_block* block = slot.exchange(nullptr, std::memory_order_acquire)) return block;
  }
  const std::size_t size = retire_block::bytes_for(owner_.block_capacity_);
  const system_allocator& allocator = owner_.options_.allocator;
  void* memory = allocator.allocate(size, alignof(retire_block), allocator.context);
  if (memory == nullptr) return nullptr;
  return new (memory) retire_block(owner_.block_capacity_, shard_index);
}

void reclaim_engine::recycle_block(retire_block* block) noexcept {
  block->count = 0;
  block->bytes = 0;
  block->next = nullptr;
  retire_shard& shard = owner_.shards_[block->home_shard];
  for (auto& slot : shard.spare) {
    retire_block* expected = nullptr;
    // Release (R4): the reset header is visible to the next taker; pairs with (R3).
    if (slot.compare_exchange_strong(expected, block, std::memory_order_release,
                                     std::memory_order_relaxed)) {
      return;
    }
  }
  deallocate_block(block);
}

void reclaim_engine::deallocate_block(retire_block* block) noexcept {
  const std::size_t size = retire_block::bytes_for(block->capacity);
  block->~retire_block();
  const system_allocator& allocator = owner_.options_.allocator;
  allocator.deallocate(block, size, allocator.context);
}

void reclaim_engine::backpressure_wait() noexcept {
  backpressure_waits_.fetch_add(1, std::memory_order_relaxed);
  // SeqCst: Dekker pair with reclaim_block()'s progress bump and waiter-count load. Before
  // the grace period, so that threads submitting meanwhile join the wait.
  progress_waiters_.fetch_add(1, std::memory_order_seq_cst);
  request_flush();
  // The waiting thread pays for a grace period itself: on a busy machine the GP thread may
  // not get a core, and the worker can then take the blocks without waiting for one
  // (process_batch sees their cookies elapsed).
  run_grace_period();
  // Down to the soft limits, not just under the hard ones: one wait per episode instead of
  // one per block the worker frees, each with a grace period and two futex calls.
  while (over_soft_limit() && !stopping_.load(std::memory_order_relaxed)) {
    // SeqCst: as above.
    const std::uint32_t seen = progress_.load(std::memory_order_seq_cst);
    if (!over_soft_limit()) break;
    futex_wait(progress_, seen, kRecheckInterval);
  }
  // Relaxed: the count gates wake-ups and recruits; a stale non-zero costs one spare
  // syscall, or one thread a wait it would have joined a moment earlier.
  progress_waiters_.fetch_sub(1, std::memory_order_relaxed);
}

void reclaim_engine::emergency_reclaim(void* object, void (*deleter)(void*),
                                       std::size_t bytes) noexcept {
  emergency_frees_.fetch_add(1, std::memory_order_relaxed);
  retired_objects_.fetch_add(1, std::memory_order_relaxed);
  retired_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  if (!in_read_section()) {
    run_grace_period();
    {
      deleter_scope running;
      deleter(object);
    }
    reclaimed_objects_.fetch_add(1, std::memory_order_relaxed);
    reclaimed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    return;
  }
  // Inside a read section the grace period would wait for this very thread: postpone it to
  // the outermost guard's end. barrier() waits for emergency_outstanding_ to reach zero.
  emergency_outstanding_.fetch_add(1, std::memory_order_relaxed);
  if (!defer_emergency_reclaim(this, object, deleter, bytes)) {
    std::fprintf(stderr,
                 "grace: out of memory for retire() inside a read section, and the thread's "
                 "deferred-reclaim room is full; cannot reclaim safely. Retire fewer objects "
                 "per read section or free memory.\n");
    std::abort();
  }
}

void reclaim_engine::emergency_done(std::size_t bytes) noexcept {
  reclaimed_objects_.fetch_add(1, std::memory_order_relaxed);
  reclaimed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  // Release: the deleter ran before barrier() sees the count drop; pairs with its Acquire.
  emergency_outstanding_.fetch_sub(1, std::memory_order_release);
}

void reclaim_engine::barrier() {
  if (in_read_section()) {
    throw std::logic_error(
        "grace::domain::barrier() called inside a read section: it would wait for the "
        "caller's own read_guard. Call it after the guard is destroyed.");
  }
  if (tls_reader.running_deleters) {
    throw std::logic_error(
        "grace::domain::barrier() called from inside a deleter: the reclaim worker would "
        "wait for itself. Retire from the deleter instead; barrier() covers that.");
  }
  for (;;) {
    // Acquire: retires published by deleters before we read this reached their shards
    // first, so the flush below sees them; pairs with the Release in
    // publish_retires_by_deleters().
    const std::uint64_t chained_before = retires_by_deleters.load(std::memory_order_acquire);
    flush_shards();
    barrier_marker marker;
    submit(&marker);
    wake_gp_thread();
    // Acquire: pairs with the worker's Release store of done (I4).
    while (marker.done.load(std::memory_order_acquire) == 0) futex_wait(marker.done, 0);
    // Acquire: pairs with the Release decrement in emergency_done().
    while (emergency_outstanding_.load(std::memory_order_acquire) != 0) {
      std::this_thread::sleep_for(kRecheckInterval);
    }
    // Acquire: as above. A deleter that ran before the marker (or an emergency deleter) retired
    // more, possibly after our flush: go again.
    if (retires_by_deleters.load(std::memory_order_acquire) == chained_before) return;
  }
}

void deleter_scope::publish_retires_by_deleters() noexcept {
  const std::uint32_t count = tls_reader.retires_by_deleters;
  if (count == 0) return;
  tls_reader.retires_by_deleters = 0;
  // Release: the retired entries reached their shard or the engine first; pairs with the
  // Acquire loads in barrier().
  retires_by_deleters.fetch_add(count, std::memory_order_release);
}

domain_stats reclaim_engine::stats() const noexcept {
  domain_stats s;
  // Relaxed throughout: an approximate snapshot, documented as such.
  s.grace_periods = grace_periods_.load(std::memory_order_relaxed);
  s.reclaimed = reclaimed_objects_.load(std::memory_order_relaxed);
  s.retired = retired_objects_.load(std::memory_order_relaxed);
  s.pending_objects = pending_objects();
  s.pending_bytes = pending_bytes();
  s.peak_pending_objects = peak_pending_objects_.load(std::memory_order_relaxed);
  s.peak_pending_bytes = peak_pending_bytes_.load(std::memory_order_relaxed);
  s.batches = batches_.load(std::memory_order_relaxed);
  s.batches_without_own_gp = batches_without_own_gp_.load(std::memory_order_relaxed);
  s.blocks = blocks_.load(std::memory_order_relaxed);
  s.forced_drains = forced_drains_.load(std::memory_order_relaxed);
  s.backpressure_waits = backpressure_waits_.load(std::memory_order_relaxed);
  s.emergency_frees = emergency_frees_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace grace::detail
