// fork() support: grace's pthread_atfork handlers.
//
// liburcu 0.13's urcu-memb flavour has no fork support: <urcu/map/urcu-memb.h> names
// urcu_memb_before_fork() and urcu_memb_after_fork_parent/child(), but liburcu-memb.so
// defines none of them (only urcu-bp has them), and liburcu's README asks every other
// flavour's users to release all registrations before a fork() not followed by exec().
// grace does not use call_rcu or defer_rcu, so liburcu's call_rcu_before_fork() family does
// not apply to it (an application that uses them follows liburcu's rules for them). What
// urcu_bp_before_fork()/after_fork_child() do for urcu-bp, grace does here for the readers it
// registered, together with the same for its own engine threads.
//
// What can be mid-update when fork() copies the process, and what the handlers do about it:
//   - liburcu's rcu_gp_lock and rcu_registry_lock, taken by synchronize_rcu() and by
//     register/unregister_thread(): every such call is made inside a fork gate
//     (fork_gate_scope; one for grace periods, one for the registry, closed in that order),
//     which prepare closes; so no thread holds them at the copy.
//   - liburcu's registry in the child lists threads that do not exist there; one that was
//     inside a read section would stall every grace period, and a new thread may reuse a
//     dead one's stack and the registry node in it. The child removes them (thread list in
//     thread_registry.cc, changed only inside the gate).
//   - domain::global()'s build (a function-local static's guard, before): it runs under
//     global_domain_mutex, which prepare takes first, so the copy never holds a global domain
//     half built. pthread_atfork() itself is called through pthread_once(), which glibc
//     restarts in a child whose parent was inside it.
//   - Each engine's GP thread and worker hold batches in local variables while they work.
//     prepare parks both at a safe point (GP thread: the top of its loop, holding nothing,
//     a chain it holds for a grace period run elsewhere still in submitted_; worker: between
//     two nodes, the rest of its chain in worker_backlog_). So every block
//     is in submitted_, reclaim_queue_, worker_backlog_, a shard, or a spare slot. (With
//     batching::per_object the GP thread parks only after its whole batch, one grace period
//     per object: that mode is a reference, not a configuration to fork with.) A deleter
//     that creates a domain while another thread forks deadlocks (the worker waits for the
//     engine list, which the fork holds while it waits for the worker).
//   - A retiring thread holds a shard (shard_held() in `open`) for a few instructions. The
//     child would wait for ever for such a holder in flush_shards(), and lose its block.
//     prepare takes every shard itself (waiting for holders, who never wait while holding,
//     (I0)), keeps the open blocks in fork_held_blocks_, and puts them back after the copy.
//   - Treiber-stack pushes (submitted_, reclaim_queue_) and spare-slot exchanges are single
//     atomic steps: a node is in a stack or not. A barrier_marker in the child's stacks
//     lives on the stack of a thread that is gone: the child drops every marker (the
//     forking thread is in fork(), not in barrier()).
//   - std::thread objects of the parent's engine threads refer to threads that do not exist
//     in the child: never joined or detached there (pthread_join would wait for ever); new
//     std::thread objects are constructed over them and the threads started again.
//   - Counters a dead thread may have left behind: emergency_outstanding_ (recounted from
//     the postponed reclaims the child adopts, see thread_registry.cc), progress_waiters_,
//     the sleeping flags, and the hint of grace periods run elsewhere (foreign_gp_ns_,
//     held_cookie_): reset in the child. A domain's count of the pools built on it (users_) is
//     not: the parent's pools are in the child's memory too, and a domain destroyed before
//     them aborts (domain.cc). Tickets (gp_.started/completed) are changed
//     only inside the gate. The pending counts are recounted from what the child holds
//     (back-pressure waits for them to fall); other statistics may be off by what was in
//     flight.
//
// In flight at the copy and so lost in the child (the parent is unaffected): an object whose
// retire() call had not returned (its thread was between taking a block of its own and
// pushing it), an emergency reclaim its thread had already taken out of its list, and a
// deleter that was running on another thread than the worker. Objects whose retire()
// returned before fork() are reclaimed exactly once in the parent and exactly once in the
// child (each in its own copy of the address space).
//
// The forking thread must hold no read_guard: a grace period in flight (which prepare waits
// for) would wait for that very read section. It must not be running a deleter either (on the
// worker, prepare would wait for itself). Both abort with a message.
#include <pthread.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <new>
#include <thread>

#include "fork_internal.h"
#include "grace/reclaim/detail/fork.h"
#include "futex_internal.h"
#include "reclaim_engine_internal.h"

namespace grace::detail {

// --- the global domain ------------------------------------------------------------------------
// See fork_internal.h. Locked by prepare before anything else, unlocked by the parent's
// handler last; the child gets a fresh one.
constinit std::mutex global_domain_mutex;

namespace {

// --- the fork gates ---------------------------------------------------------------------------
// Each word: the number of threads inside, plus kForkClosing while a fork() holds it closed.
constexpr std::uint32_t kForkClosing = std::uint32_t{1} << 31;
constinit std::atomic<std::uint32_t> gp_gate_word{0};
constinit std::atomic<std::uint32_t> registry_gate_word{0};

void close_gate(std::atomic<std::uint32_t>& gate_word) noexcept {
  // Acquire: every liburcu call made inside the gate is complete before the copy; pairs with
  // the Release decrement in ~fork_gate_scope().
  std::uint32_t seen = gate_word.fetch_or(kForkClosing, std::memory_order_acquire) | kForkClosing;
  while (seen != kForkClosing) {
    futex_wait(gate_word, seen);
    // Acquire: as above.
    seen = gate_word.load(std::memory_order_acquire);
  }
}

void open_gate(std::atomic<std::uint32_t>& gate_word) noexcept {
  // Release: the parent's handlers are done before a waiting thread enters; pairs with the
  // Acquire CAS in fork_gate_scope().
  gate_word.fetch_and(~kForkClosing, std::memory_order_release);
  futex_wake_all(gate_word);
}

// --- the process's fork generation (detail/fork.h) --------------------------------------------
// Not fork_generation below, which counts fork cycles in the parent and the child alike.
// Relaxed: written by the child's handler before it starts grace's threads, which (like any
// thread created later) are ordered after their creation. See detail/fork.h for threads
// that other libraries' earlier handlers start.
constinit std::atomic<std::uint32_t> forks_in_lineage{0};

// --- registering the handlers -----------------------------------------------------------------
// pthread_once, not a function-local static or a CAS flag: glibc's pthread_once restarts, in
// the child of fork(), an initialization that a thread of the parent was running. Lazily, at
// the first domain or reader thread (README's fork rules order other handlers by it).
constinit pthread_once_t registration_once = PTHREAD_ONCE_INIT;
constinit int registration_result = 0;  // written by register_handlers(), read after pthread_once()
// Set by prepare_fork(): grace's handlers are in glibc's list. A child forked after the list
// got them but before pthread_once() finished runs register_handlers() again: not twice.
// Relaxed: written and read by the forking thread and the child's only thread.
constinit std::atomic<bool> handlers_listed{false};

// --- the layers' hooks (detail/fork.h) --------------------------------------------------------
// The layer's hooks, one set: published whole by set_fork_hooks(), loaded once by prepare
// into hooks_this_fork, which the parent's and the child's handlers use, so a fork never
// releases what it did not hold. Release (set_fork_hooks) / Acquire (prepare): the layer is
// set up before its hooks are called.
constinit std::atomic<const fork_hooks*> layer_hooks{nullptr};
// Written by prepare, read by the parent's or the child's handler: the forking thread only.
constinit const fork_hooks* hooks_this_fork = nullptr;

// --- the engine list --------------------------------------------------------------------------
// Held from prepare to the parent's or the child's handler, so engines neither come nor go
// during a fork. Engine threads never take it.
constinit std::mutex engines_mutex;
reclaim_engine* engines = nullptr;
// Odd while a fork is in progress (the value the engines' fork_park_ takes), even otherwise.
// Written only with engines_mutex held.
std::uint32_t fork_generation = 0;

template <class Fn>
void for_each_engine(Fn fn) noexcept {
  for (reclaim_engine* e = engines; e != nullptr; e = e->fork_next_) fn(*e);
}

[[noreturn]] void die(const char* message) noexcept {
  std::fputs(message, stderr);
  std::abort();
}

// --- the handlers -----------------------------------------------------------------------------

void prepare_fork() noexcept {
  if (in_read_section()) {
    die("grace: fork() called inside a read section: fork() waits for the grace periods in "
        "flight, and they wait for this thread's read_guard. Destroy every read_guard (and "
        "pinned view) of the thread before fork(); posix_spawn() does not need it.\n");
  }
  if (tls_reader.running_deleters) {
    die("grace: fork() called from a deleter: fork() waits for the reclaim worker to finish "
        "its block, which includes this deleter. Fork from another thread.\n");
  }
  // Relaxed: see handlers_listed.
  handlers_listed.store(true, std::memory_order_relaxed);
  // First: a global domain being built is finished before the copy, and none starts (see
  // fork_internal.h). Its builder waits for nothing this fork holds.
  global_domain_mutex.lock();
  engines_mutex.lock();
  const std::uint32_t generation = fork_generation + 1;
  fork_generation = generation;
  // Park first, then close the gates: a parking GP thread may still need one to finish
  // its grace period.
  for_each_engine([&](reclaim_engine& e) { e.request_park_for_fork(generation); });
  for_each_engine([&](reclaim_engine& e) { e.wait_parked_for_fork(generation); });
  // Grace periods first: closing that gate waits for read sections. Then registrations, which
  // wait for nothing once no grace period runs (see fork_gate in fork_internal.h): a thread
  // that registers or exits meanwhile is never held up while this thread waits for a reader.
  close_gate(gp_gate_word);
  close_gate(registry_gate_word);
  for_each_engine([](reclaim_engine& e) { e.hold_shards_for_fork(); });
  // Last: the layer's holds wait only for their holders, whom nothing above holds up.
  // Acquire: see layer_hooks.
  hooks_this_fork = layer_hooks.load(std::memory_order_acquire);
  if (hooks_this_fork != nullptr) hooks_this_fork->hold();
}

void parent_after_fork() noexcept {
  // First: the reverse of prepare.
  if (hooks_this_fork != nullptr) hooks_this_fork->release_in_parent();
  const std::uint32_t generation = fork_generation;
  for_each_engine([](reclaim_engine& e) { e.release_shards_after_fork(); });
  open_gate(registry_gate_word);
  open_gate(gp_gate_word);
  for_each_engine([&](reclaim_engine& e) { e.unpark_after_fork(generation); });
  fork_generation = generation + 1;
  engines_mutex.unlock();
  global_domain_mutex.unlock();
}

void child_after_fork() noexcept {
  // Relaxed: see forks_in_lineage. First, before any thread starts.
  forks_in_lineage.store(forks_in_lineage.load(std::memory_order_relaxed) + 1,
                         std::memory_order_relaxed);
  // This thread is the only one. The gates were closed by this thread with nobody inside.
  // Relaxed: no other thread exists to observe them.
  gp_gate_word.store(0, std::memory_order_relaxed);
  registry_gate_word.store(0, std::memory_order_relaxed);
  // Before any thread starts or any deleter runs (a deleter may construct a pool).
  if (hooks_this_fork != nullptr) hooks_this_fork->release_in_child();
  // Before any thread is created: a new thread may reuse a dead one's stack.
  std::size_t adopted_count = 0;
  adopted_reclaim* adopted = forget_other_threads_after_fork_child(adopted_count);
  const std::uint32_t generation = fork_generation;
  // Locked by this thread in prepare; a fresh (unlocked) mutex in its place rather than an
  // unlock from a thread with another id. Before the engine threads restart and the adopted
  // deleters run: a deleter may create a domain.
  new (&engines_mutex) std::mutex();
  new (&global_domain_mutex) std::mutex();
  for_each_engine([&](reclaim_engine& e) { e.reset_after_fork_child(generation + 1); });
  for_each_engine([](reclaim_engine& e) { e.restart_after_fork_child(); });
  fork_generation = generation + 1;
  for (std::size_t i = 0; i < adopted_count; ++i) {
    const adopted_reclaim& a = adopted[i];
    a.engine->reclaim_adopted_after_fork_child(a.object, a.deleter);
  }
  std::free(adopted);
}

void register_handlers() noexcept {
  // Relaxed: see handlers_listed.
  registration_result = handlers_listed.load(std::memory_order_relaxed)
                            ? 0
                            : pthread_atfork(&prepare_fork, &parent_after_fork, &child_after_fork);
}

// Every batch_node of the chain that is not a barrier_marker, in the same order.
batch_node* drop_barrier_markers(batch_node* chain) noexcept {
  batch_node* kept = nullptr;
  batch_node** tail = &kept;
  for (batch_node* node = chain; node != nullptr;) {
    batch_node* next = node->next;
    if (node->node_kind == batch_node::kind::objects) {
      *tail = node;
      tail = &node->next;
    }
    node = next;
  }
  *tail = nullptr;
  return kept;
}

}  // namespace

std::uint32_t process_fork_generation() noexcept {
  // Relaxed: see forks_in_lineage.
  return forks_in_lineage.load(std::memory_order_relaxed);
}

void set_fork_hooks(const fork_hooks* hooks) noexcept {
  // Release: see layer_hooks.
  layer_hooks.store(hooks, std::memory_order_release);
}

int install_fork_handlers() noexcept {
  pthread_once(&registration_once, &register_handlers);
  return registration_result;
}

void add_engine_for_fork(reclaim_engine* engine) noexcept {
  std::lock_guard lock(engines_mutex);
  engine->fork_prev_ = nullptr;
  engine->fork_next_ = engines;
  if (engines != nullptr) engines->fork_prev_ = engine;
  engines = engine;
}

void remove_engine_for_fork(reclaim_engine* engine) noexcept {
  std::lock_guard lock(engines_mutex);
  if (engine->fork_prev_ != nullptr) {
    engine->fork_prev_->fork_next_ = engine->fork_next_;
  } else {
    engines = engine->fork_next_;
  }
  if (engine->fork_next_ != nullptr) engine->fork_next_->fork_prev_ = engine->fork_prev_;
  engine->fork_prev_ = engine->fork_next_ = nullptr;
}

fork_gate_scope::fork_gate_scope(fork_gate which) noexcept
    : word_(which == fork_gate::grace_period ? gp_gate_word : registry_gate_word) {
  // Relaxed: only a guess for the CAS below, which orders the entry.
  std::uint32_t seen = word_.load(std::memory_order_relaxed);
  for (;;) {
    if ((seen & kForkClosing) != 0) {
      futex_wait(word_, seen);
      // Relaxed: as above.
      seen = word_.load(std::memory_order_relaxed);
      continue;
    }
    // Acquire: enters after the previous fork's parent handler was done; pairs with the
    // Release fetch_and in open_gate(). Only when the gate is open: a closing fork never
    // sees a thread come in after it looked.
    if (word_.compare_exchange_weak(seen, seen + 1, std::memory_order_acquire,
                                    std::memory_order_relaxed)) {
      return;
    }
  }
}

fork_gate_scope::~fork_gate_scope() {
  // Release: the liburcu call is complete before a fork() sees this thread leave; pairs with
  // the Acquire loads in close_gate().
  if (word_.fetch_sub(1, std::memory_order_release) == (kForkClosing | 1)) {
    futex_wake_all(word_);
  }
}

// --- the engine's side --------------------------------------------------------------------------

void reclaim_engine::fork_park_point(std::atomic<std::uint32_t>& parked) noexcept {
  // Acquire: pairs with the SeqCst store in request_park_for_fork() (only the value matters).
  const std::uint32_t generation = fork_park_.load(std::memory_order_acquire);
  if ((generation & 1) == 0) return;
  // Release: this thread's state (worker_backlog_, what it took from the stacks) is complete
  // before the forking thread copies the process; pairs with the Acquire load in
  // wait_parked_for_fork().
  parked.store(generation, std::memory_order_release);
  futex_wake_all(parked);
  // Acquire: the parent's handler (the shards put back) happens-before this thread resumes;
  // pairs with the Release store in unpark_after_fork(). A later fork() stores a newer odd
  // value, which also ends this wait; the thread then parks again at its next safe point.
  while (fork_park_.load(std::memory_order_acquire) == generation) {
    futex_wait(fork_park_, generation);
  }
}

void reclaim_engine::request_park_for_fork(std::uint32_t generation) noexcept {
  // SeqCst: Dekker pair with each thread's sleep path (its sleeping-flag store, then its
  // SeqCst load of fork_park_), together with the SeqCst bumps of the wake words below: a
  // thread about to sleep either sees the request or finds its wake word changed.
  fork_park_.store(generation, std::memory_order_seq_cst);
  wake_gp_thread();
  // SeqCst: as in wake_gp_thread(), for the worker.
  worker_wake_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(worker_wake_);
}

void reclaim_engine::wait_parked_for_fork(std::uint32_t generation) noexcept {
  for (std::atomic<std::uint32_t>* parked : {&gp_parked_, &worker_parked_}) {
    // Acquire: pairs with the Release store in fork_park_point().
    for (std::uint32_t seen = parked->load(std::memory_order_acquire); seen != generation;
         seen = parked->load(std::memory_order_acquire)) {
      futex_wait(*parked, seen);
    }
  }
}

void reclaim_engine::hold_shards_for_fork() noexcept {
  for (unsigned i = 0; i <= owner_.shard_mask_; ++i) {
    retire_shard& shard = owner_.shards_[i];
    retire_block* block;
    // Acquire (R3): take the shard and its block; pairs with the holder's Release (R4). A
    // holder hands its block in or puts it back without waiting for anything (I0).
    while ((block = shard.open.exchange(shard_held(), std::memory_order_acquire)) ==
           shard_held()) {
      std::this_thread::yield();
    }
    fork_held_blocks_[i] = block;
  }
}

void reclaim_engine::release_shards_after_fork() noexcept {
  for (unsigned i = 0; i <= owner_.shard_mask_; ++i) {
    // Release (R4): end the fork's hold; pairs with (R3). The same block (or nullptr) that
    // was open before, so open_blocks_possible_ needs no update.
    owner_.shards_[i].open.store(fork_held_blocks_[i], std::memory_order_release);
  }
}

void reclaim_engine::unpark_after_fork(std::uint32_t generation) noexcept {
  // Release: pairs with the Acquire loads in fork_park_point().
  fork_park_.store(generation + 1, std::memory_order_release);
  futex_wake_all(fork_park_);
}

void reclaim_engine::reset_after_fork_child(std::uint32_t generation) noexcept {
  // Relaxed throughout: the child has one thread (this one) until restart_after_fork_child().
  release_shards_after_fork();
  submitted_.store(drop_barrier_markers(submitted_.load(std::memory_order_relaxed)),
                   std::memory_order_relaxed);
  reclaim_queue_.store(drop_barrier_markers(reclaim_queue_.load(std::memory_order_relaxed)),
                       std::memory_order_relaxed);
  worker_backlog_ = drop_barrier_markers(worker_backlog_);
  recount_pending_after_fork_child();
  gp_sleeping_.store(false, std::memory_order_relaxed);
  worker_sleeping_.store(false, std::memory_order_relaxed);
  progress_waiters_.store(0, std::memory_order_relaxed);
  // The threads that ran the parent's grace periods are gone: hold nothing for them.
  foreign_gp_ns_.store(0, std::memory_order_relaxed);
  held_cookie_.store(0, std::memory_order_relaxed);
  // Only the forking thread exists, and it holds no read_guard, so it owes no deferred work.
  deferred_users_.store(0, std::memory_order_relaxed);
  // Threads that had postponed reclaims are gone; the child adopts their lists instead and
  // runs them at once (child_after_fork), counted as reclaimed already (above).
  emergency_outstanding_.store(0, std::memory_order_relaxed);
  // The restored open blocks are drained on the usual schedule.
  open_blocks_possible_.store(true, std::memory_order_relaxed);
  fork_park_.store(generation, std::memory_order_relaxed);
  // The parent's threads do not exist here: forget them without join() or detach(), which
  // would look for them (a std::thread holds nothing but the handle).
  new (&gp_thread_) std::thread();
  new (&worker_thread_) std::thread();
}

void reclaim_engine::recount_pending_after_fork_child() noexcept {
  // Objects whose retire() or postponed reclaim another thread was in the middle of at the
  // copy are counted as retired, and never reclaimed here. Count every retired object as
  // reclaimed but those the child's blocks hold (barrier markers are dropped already), so
  // that back-pressure, which waits for the backlog to fall, waits only for what can.
  // Relaxed: the child has one thread (this one).
  std::uint64_t held_objects = 0;
  std::uint64_t held_bytes = 0;
  for (batch_node* chain : {submitted_.load(std::memory_order_relaxed),
                            reclaim_queue_.load(std::memory_order_relaxed), worker_backlog_}) {
    for (batch_node* node = chain; node != nullptr; node = node->next) {
      const auto* block = static_cast<const retire_block*>(node);
      held_objects += block->count;
      held_bytes += block->bytes;
    }
  }
  // Every held block was counted before it was pushed: retired >= reclaimed + held.
  reclaimed_objects_.store(retired_objects_.load(std::memory_order_relaxed) - held_objects,
                           std::memory_order_relaxed);
  reclaimed_bytes_.store(retired_bytes_.load(std::memory_order_relaxed) - held_bytes,
                         std::memory_order_relaxed);
}

void reclaim_engine::restart_after_fork_child() noexcept {
  try {
    worker_thread_ = std::thread([this] { worker_thread_main(); });
    gp_thread_ = std::thread([this] { gp_thread_main(); });
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "grace: cannot restart a domain's threads in the child of fork() (%s); the "
                 "domain cannot reclaim there.\n",
                 e.what());
    std::abort();
  }
}

void reclaim_engine::reclaim_adopted_after_fork_child(void* object,
                                                      void (*deleter)(void*)) noexcept {
  // No grace period needed: the object was retired inside a read section of a thread that
  // does not exist here, and the only thread that does (this one) holds no read_guard.
  // Counted as reclaimed already: see recount_pending_after_fork_child().
  deleter_scope running;
  deleter(object);
}

}  // namespace grace::detail
