// Lazy liburcu registration, unregistration at thread exit, and per-thread deferred work.
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "grace/reclaim/detail/urcu.h"
#include "fork_internal.h"
#include "reclaim_engine_internal.h"

// fork(): struct urcu_reader and the urcu_memb_reader thread_local, so that the child can take
// dead threads out of liburcu's registry (forget_other_threads_after_fork_child) with
// cds_list_del(), two stores. It depends on the layout of struct urcu_reader, like the
// inlined read side, so grace is rebuilt with each liburcu release.
#include <urcu/static/urcu-memb.h>

namespace grace::detail {
namespace {

// Room for emergency reclaims postponed to the end of a read section. Static storage: the
// emergency path runs precisely when memory cannot be had.
constexpr unsigned kDeferredReclaimRoom = 64;
// Distinct domains a thread can owe a wait to at once; beyond that the wait is skipped (the
// engine has been woken already, so this only weakens back-pressure, never safety).
constexpr unsigned kDeferredDomainRoom = 4;

struct deferred_reclaim {
  reclaim_engine* engine;
  void* object;
  void (*deleter)(void*);
  std::size_t bytes;
};

struct engine_set {
  reclaim_engine* engines[kDeferredDomainRoom];
  unsigned count = 0;

  // Adds `engine` unless it is in the set already or the set is full; a newly added engine
  // counts this thread among its deferred users until run_deferred_work_slow() runs it.
  // False when full.
  bool add(reclaim_engine* engine) noexcept {
    for (unsigned i = 0; i < count; ++i) {
      if (engines[i] == engine) return true;
    }
    if (count == kDeferredDomainRoom) return false;
    engine->deferred_use_begin();
    engines[count++] = engine;
    return true;
  }
  // Empties the set into `out`; returns how many.
  unsigned take(reclaim_engine** out) noexcept {
    const unsigned taken = count;
    for (unsigned i = 0; i < taken; ++i) out[i] = engines[i];
    count = 0;
    return taken;
  }
};

struct deferred_work {
  deferred_reclaim reclaims[kDeferredReclaimRoom];
  unsigned reclaim_count = 0;
  engine_set grace_periods;  // synchronize_when_unpinned()
  engine_set backpressure;   // hard limit crossed inside a read section
};

constinit thread_local deferred_work tls_deferred{};

// --- fork() support: the threads grace registered with liburcu ---------------------------
// In the child of fork() only the forking thread exists. liburcu's urcu-memb keeps the others
// in its registry (it has no fork support), and a grace period would wait for ever for one
// that was inside a read section; a new thread may also reuse a dead one's stack, overwriting
// the registry node in its thread_locals. So grace lists the threads it registered, with
// their liburcu entries, and the child takes every other one out. Changed only inside the
// fork gate (next to the liburcu call it mirrors), so never mid-change when fork() copies it.
struct thread_record {
  thread_record* prev;
  thread_record* next;
  urcu_reader* liburcu_reader;  // this thread's node in liburcu's registry
  deferred_work* deferred;      // its tls_deferred
};

constinit thread_local thread_record tls_record{nullptr, nullptr, nullptr, nullptr};
// Circular, with this sentinel.
constinit thread_record thread_list{&thread_list, &thread_list, nullptr, nullptr};
// Between gate holders (each holds the gate shared, so several may change the list at once).
// Unlocked whenever the gate is closed, so the child never inherits it locked.
constinit std::mutex thread_list_mutex;

void link_thread_record() noexcept {
  thread_record& record = tls_record;
  record.liburcu_reader = &urcu_memb_reader;
  record.deferred = &tls_deferred;
  std::lock_guard lock(thread_list_mutex);
  record.prev = &thread_list;
  record.next = thread_list.next;
  thread_list.next->prev = &record;
  thread_list.next = &record;
}

void unlink_thread_record() noexcept {
  thread_record& record = tls_record;
  std::lock_guard lock(thread_list_mutex);
  record.prev->next = record.next;
  record.next->prev = record.prev;
  record.prev = record.next = nullptr;
}
// --- end fork() support ---------------------------------------------------------------------

// Runs at thread exit after every C++ thread_local destructor (glibc runs pthread key
// destructors last), so a destructor that pins still finds the thread registered. If a key
// destructor pins again, registration sets the key again and this runs once more.
void unregister_at_thread_exit(void*) {
  reader_state& reader = tls_reader;
  if (reader.nesting != 0) {
    std::fprintf(stderr,
                 "grace: a thread exited inside a read section (%u read_guard(s) still held); "
                 "ending the section so grace periods can complete.\n",
                 reader.nesting);
    reader.nesting = 1;
    read_unlock();  // as the outermost guard's end would
  }
  if (reader.has_deferred_work) run_deferred_work_slow();
  {
    // fork(): liburcu's registry lock and our list, never mid-change.
    fork_gate_scope gate(fork_gate::registry);
    urcu_memb_unregister_thread();
    unlink_thread_record();
  }
  reader.registered = false;
}

#if !GRACE_URCU_LIBRARY_READ_SIDE
// detail/urcu.h speaks liburcu-memb's reader protocol on these fields and constants.
static_assert(kLiburcuNestingOne == URCU_GP_COUNT && kLiburcuNestingMask == URCU_GP_CTR_NEST_MASK,
              "liburcu's reader counter has another format than detail/urcu.h assumes");
static_assert(std::is_same_v<decltype(urcu_reader::ctr), unsigned long> &&
                  std::is_same_v<decltype(urcu_gp::ctr), unsigned long> &&
                  std::is_same_v<decltype(urcu_gp::futex), std::int32_t>,
              "liburcu's reader state has other field types than detail/urcu.h assumes");

void locate_liburcu_reader_state() noexcept {
  reader_state& reader = tls_reader;
  reader.liburcu_count = &urcu_memb_reader.ctr;
  reader.liburcu_phase = &urcu_memb_gp.ctr;
  reader.liburcu_waiter = &urcu_memb_gp.futex;
  // Set by liburcu's constructor (or the registration) before any reader runs; never changes.
  reader.liburcu_readers_fence = urcu_memb_has_sys_membarrier == 0;
}

// The static_asserts check the headers grace was built with; liburcu keeps its layout within
// a major version (the soname, liburcu-memb.so.8 for 0.13), and grace is rebuilt with each
// release. A smoke test of the library it runs with, once per thread: a section entered
// through the library must show in grace's view of the thread's counter, and one grace
// enters must show in the library's. It sees only the counter, not the grace-period word.
void check_read_side_matches_library() noexcept {
  if (liburcu_read_ongoing()) {
    std::fprintf(stderr,
                 "grace: the thread holds liburcu's read lock before its first read_guard; "
                 "take urcu_memb_read_lock() after grace has registered the thread (after its "
                 "first grace::pin())\n");
    std::abort();
  }
  urcu_memb_read_lock();
  const bool grace_sees_library = liburcu_read_ongoing();
  urcu_memb_read_unlock();
  const bool grace_sees_library_end = !liburcu_read_ongoing();
  liburcu_read_lock();
  const bool library_sees_grace = urcu_memb_read_ongoing() != 0;
  liburcu_read_unlock();
  const bool library_sees_grace_end = urcu_memb_read_ongoing() == 0;
  if (!grace_sees_library || !grace_sees_library_end || !library_sees_grace ||
      !library_sees_grace_end) {
    std::fprintf(stderr,
                 "grace: liburcu-memb's reader state does not have the layout grace was built "
                 "with (grace's view of a library section: entered %d, left %d; the library's "
                 "view of grace's: entered %d, left %d); rebuild grace against the installed "
                 "liburcu\n",
                 grace_sees_library, grace_sees_library_end, library_sees_grace,
                 library_sees_grace_end);
    std::abort();
  }
}
#endif

pthread_key_t registration_key() noexcept {
  static const pthread_key_t key = [] {
    pthread_key_t created;
    if (pthread_key_create(&created, &unregister_at_thread_exit) != 0) {
      std::fprintf(stderr, "grace: pthread_key_create failed; cannot track reader threads\n");
      std::abort();
    }
    return created;
  }();
  return key;
}

}  // namespace

void register_thread_slow() noexcept {
  // A process whose threads only pin (no domain yet) needs the fork handlers as well: the
  // child must forget the other readers.
  if (const int error = install_fork_handlers(); error != 0) {
    std::fprintf(stderr, "grace: pthread_atfork failed (error %d); cannot register readers\n",
                 error);
    std::abort();
  }
  pthread_key_t key;
  {
    // fork(): liburcu's registry lock and our list, never mid-change.
    fork_gate_scope gate(fork_gate::registry);
    if (urcu_memb_reader.registered) {
      // A second urcu_memb_register_thread() would link the thread into liburcu's registry
      // twice (liburcu checks only in its debug builds) and corrupt it.
      std::fprintf(stderr,
                   "grace: the thread taking its first read_guard is already registered with "
                   "liburcu (the program called urcu_memb_register_thread()); grace registers "
                   "the threads that take read_guards itself, so do not register them too\n");
      std::abort();
    }
    urcu_memb_register_thread();
#if !GRACE_URCU_LIBRARY_READ_SIDE
    locate_liburcu_reader_state();
    check_read_side_matches_library();
#endif
    link_thread_record();
    // Inside the gate: fork() never copies a thread that is creating the key (the static's
    // guard, which the child would wait on for ever).
    key = registration_key();
  }
  // Any non-null value arms the destructor. Outside the gate: it may allocate.
  pthread_setspecific(key, &tls_reader);
  tls_reader.registered = true;
}

#if !GRACE_URCU_LIBRARY_READ_SIDE
void wake_grace_period_slow(std::int32_t* waiter) noexcept {
  // Relaxed, as liburcu's own unlock: the waiter re-checks every reader after it wakes.
  std::atomic_ref<std::int32_t>(*waiter).store(0, std::memory_order_relaxed);
  // liburcu waits with a process-shared FUTEX_WAIT, so the wake must not be _PRIVATE.
  syscall(SYS_futex, waiter, FUTEX_WAKE, 1, nullptr, nullptr, 0);
}
#endif

bool defer_emergency_reclaim(reclaim_engine* engine, void* object, void (*deleter)(void*),
                             std::size_t bytes) noexcept {
  deferred_work& work = tls_deferred;
  if (work.reclaim_count == kDeferredReclaimRoom) return false;
  work.reclaims[work.reclaim_count] = deferred_reclaim{engine, object, deleter, bytes};
  // Signal fence (compiler order only): a fork() child adopts this thread's entries up to
  // reclaim_count from a snapshot taken at any instruction, so the entry is written before
  // the count that covers it. Only this thread writes either.
  std::atomic_signal_fence(std::memory_order_release);
  ++work.reclaim_count;
  tls_reader.has_deferred_work = true;
  return true;
}

void defer_backpressure_wait(reclaim_engine* engine) noexcept {
  if (tls_deferred.backpressure.add(engine)) tls_reader.has_deferred_work = true;
}

void defer_grace_period(reclaim_engine* engine) noexcept {
  if (tls_deferred.grace_periods.add(engine)) tls_reader.has_deferred_work = true;
}

void run_deferred_work_slow() noexcept {
  // The outermost guard ended inside liburcu's read lock that the program took itself: the
  // work would wait for that section. It stays due until a guard ends outside it.
  if (liburcu_read_ongoing()) return;
  deferred_work& work = tls_deferred;
  tls_reader.has_deferred_work = false;
  // Copy first: deleters may pin and retire, adding new deferred work.
  deferred_reclaim reclaims[kDeferredReclaimRoom];
  const unsigned reclaim_count = work.reclaim_count;
  for (unsigned i = 0; i < reclaim_count; ++i) reclaims[i] = work.reclaims[i];
  work.reclaim_count = 0;
  reclaim_engine* grace_periods[kDeferredDomainRoom];
  const unsigned grace_period_count = work.grace_periods.take(grace_periods);
  reclaim_engine* waits[kDeferredDomainRoom];
  const unsigned wait_count = work.backpressure.take(waits);

  for (unsigned i = 0; i < grace_period_count; ++i) {
    grace_periods[i]->run_grace_period();
    grace_periods[i]->deferred_use_end();  // the engine may be gone after this
  }
  if (reclaim_count != 0) {
    // One grace period covers every postponed object: each was retired inside the read
    // section that has just ended, so after it began.
    reclaims[0].engine->run_grace_period();
    for (unsigned i = 0; i < reclaim_count; ++i) {
      {
        deleter_scope running;  // publishes its retires before emergency_done() below
        reclaims[i].deleter(reclaims[i].object);
      }
      reclaims[i].engine->emergency_done(reclaims[i].bytes);
    }
  }
  for (unsigned i = 0; i < wait_count; ++i) {
    waits[i]->backpressure_wait();
    waits[i]->deferred_use_end();  // as above
  }
}

adopted_reclaim* forget_other_threads_after_fork_child(std::size_t& count) noexcept {
  // The child has one thread, this one; no other thread will ever change the list again, and
  // no grace period is in flight (the gate was closed), so liburcu's registry is not being
  // walked either: plain accesses suffice.
  const thread_record* self = &tls_record;
  std::size_t postponed = 0;
  for (thread_record* r = thread_list.next; r != &thread_list; r = r->next) {
    if (r != self) postponed += r->deferred->reclaim_count;
  }
  auto* adopted = postponed == 0 ? nullptr
                                 : static_cast<adopted_reclaim*>(
                                       std::malloc(postponed * sizeof(adopted_reclaim)));
  count = 0;
  for (thread_record* r = thread_list.next; r != &thread_list;) {
    thread_record* next = r->next;
    if (r != self) {
      // Objects a thread retired inside a read section while out of memory: the retire()
      // returned before the fork, so the child reclaims them too (if it has the memory to
      // list them; otherwise they leak in the child only). One that thread was reclaiming
      // at the fork instant (copied out of its list) is lost in the child.
      const deferred_work& work = *r->deferred;
      for (unsigned i = 0; adopted != nullptr && i < work.reclaim_count; ++i) {
        const deferred_reclaim& d = work.reclaims[i];
        adopted[count++] = adopted_reclaim{d.engine, d.object, d.deleter};
      }
      // What urcu_bp_after_fork_child() does for urcu-bp (urcu_bp_prune_registry): the dead
      // thread leaves liburcu's registry, so no grace period waits for it, and nothing points
      // into its stack any more.
      cds_list_del(&r->liburcu_reader->node);
      r->prev->next = r->next;
      r->next->prev = r->prev;
    }
    r = next;
  }
  return adopted;
}

}  // namespace grace::detail
