// grace::pin() cost (grace speaking liburcu's reader protocol inline, unless built with
// GRACE_URCU_INLINE_READ_SIDE=OFF), against liburcu's read lock and unlock alone: its own
// inline functions from <urcu/static/urcu-memb.h>, and the calls into the shared library
// that a program including <urcu/urcu-memb.h> without _LGPL_SOURCE makes.
#include <benchmark/benchmark.h>
#include <urcu/static/urcu-memb.h>

#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"

namespace {

// Registers the calling thread with liburcu the way grace does (lazily, on the first pin), so
// the raw reference below can use urcu_memb_read_lock without registering a second time.
void ensure_registered() { auto g = grace::pin(); }

// One read section: pin() and the guard's destruction.
void BM_pin(benchmark::State& state) {
  ensure_registered();
  for (auto _ : state) {
    auto g = grace::pin();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_pin)->Threads(1)->Threads(2);

// The member spelling, on a domain: the same read section.
void BM_domain_pin(benchmark::State& state) {
  grace::domain& d = grace::domain::global();
  ensure_registered();
  for (auto _ : state) {
    auto g = d.pin();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_domain_pin);

// A guard nested inside one already held: a thread-local increment and decrement.
void BM_pin_nested(benchmark::State& state) {
  auto outer = grace::pin();
  for (auto _ : state) {
    auto g = grace::pin();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_pin_nested);

// An outer and an inner guard per iteration.
void BM_pin_outer_and_nested(benchmark::State& state) {
  ensure_registered();
  for (auto _ : state) {
    auto outer = grace::pin();
    auto inner = grace::pin();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_pin_outer_and_nested);

// Reference: liburcu's read lock and unlock with nothing around them.
template <void (*Lock)(), void (*Unlock)()>
void BM_urcu_read_lock_unlock(benchmark::State& state) {
  ensure_registered();
  for (auto _ : state) {
    Lock();
    benchmark::ClobberMemory();
    Unlock();
  }
}
// Its own inline functions from <urcu/static/urcu-memb.h> (what _LGPL_SOURCE code gets).
BENCHMARK(BM_urcu_read_lock_unlock<_urcu_memb_read_lock, _urcu_memb_read_unlock>)
    ->Name("BM_urcu_read_lock_unlock_inlined")->Threads(1)->Threads(2);
// Through liburcu-memb.so, as grace called them until session 17.
BENCHMARK(BM_urcu_read_lock_unlock<urcu_memb_read_lock, urcu_memb_read_unlock>)
    ->Name("BM_urcu_read_lock_unlock_library_call")->Threads(1)->Threads(2);

}  // namespace
