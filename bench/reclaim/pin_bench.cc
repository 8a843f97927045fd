// grace::pin() cost. Built twice (bench/CMakeLists.txt): pin_bench calls liburcu's read side
// through the shared library; pin_bench_lgpl_inline links a variant of grace::reclaim built
// with _LGPL_SOURCE, so urcu_memb_read_lock/unlock are inlined. Each benchmark's label names
// the variant.
#include <benchmark/benchmark.h>

#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"

namespace {

#ifdef _LGPL_SOURCE
constexpr const char* kVariant = "lgpl_inline";
#else
constexpr const char* kVariant = "library_call";
#endif

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
  state.SetLabel(kVariant);
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
  state.SetLabel(kVariant);
}
BENCHMARK(BM_domain_pin);

// A guard nested inside one already held: a thread-local increment and decrement.
void BM_pin_nested(benchmark::State& state) {
  auto outer = grace::pin();
  for (auto _ : state) {
    auto g = grace::pin();
    benchmark::ClobberMemory();
  }
  state.SetLabel(kVariant);
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
  state.SetLabel(kVariant);
}
BENCHMARK(BM_pin_outer_and_nested);

// Reference: liburcu's read lock and unlock with nothing around them (inlined in the
// lgpl_inline build, library calls otherwise).
void BM_urcu_read_lock_unlock(benchmark::State& state) {
  ensure_registered();
  for (auto _ : state) {
    urcu_memb_read_lock();
    benchmark::ClobberMemory();
    urcu_memb_read_unlock();
  }
  state.SetLabel(kVariant);
}
BENCHMARK(BM_urcu_read_lock_unlock)->Threads(1)->Threads(2);

}  // namespace
