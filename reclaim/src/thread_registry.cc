// Lazy liburcu registration, unregistration at thread exit, and per-thread deferred work.
#include <pthread.h>

#include <cstdio>
#include <cstdlib>

#include "grace/reclaim/detail/urcu.h"
#include "reclaim_engine_internal.h"

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

  bool add(reclaim_engine* engine) noexcept {
    for (unsigned i = 0; i < count; ++i) {
      if (engines[i] == engine) return true;
    }
    if (count == kDeferredDomainRoom) return false;
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
    reader.nesting = 0;
    urcu_memb_read_unlock();
  }
  if (reader.has_deferred_work) run_deferred_work_slow();
  urcu_memb_unregister_thread();
  reader.registered = false;
}

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
  urcu_memb_register_thread();
  // Any non-null value arms the destructor.
  pthread_setspecific(registration_key(), &tls_reader);
  tls_reader.registered = true;
}

bool defer_emergency_reclaim(reclaim_engine* engine, void* object, void (*deleter)(void*),
                             std::size_t bytes) noexcept {
  deferred_work& work = tls_deferred;
  if (work.reclaim_count == kDeferredReclaimRoom) return false;
  work.reclaims[work.reclaim_count++] = deferred_reclaim{engine, object, deleter, bytes};
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

  for (unsigned i = 0; i < grace_period_count; ++i) grace_periods[i]->run_grace_period();
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
  for (unsigned i = 0; i < wait_count; ++i) waits[i]->backpressure_wait();
}

}  // namespace grace::detail
