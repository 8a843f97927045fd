// grace::object_pool's fast paths alone: allocate() and deallocate() on one CPU's cache,
// with the restartable sequences (pool_options::restartable_sequences, the default where the
// machine offers them) and with the cache's flag taken by an exchange. Each iteration is two
// allocations and two deallocations (items: 4), so that the loaded magazine neither empties
// nor fills. The label names the fast path the pool runs; where the machine has no rseq,
// both rows run the flag.
//   BM_fast_paths/rseq:R/after_gp:0  reuse_after_gp = false: every operation on the one
//                                    magazine, never a slow path (the pure fast path)
//   BM_fast_paths/rseq:R/after_gp:1  the default pool: deallocations fill magazines that
//                                    wait for a grace period, so slow paths and grace
//                                    periods are in the figure too
// rseq:1 asks for the restartable sequences, rseq:0 for the flag.
#include <benchmark/benchmark.h>
#include <pthread.h>
#include <sched.h>

#include <cstdint>

#include "grace/alloc/object_pool.h"

namespace {

void BM_fast_paths(benchmark::State& state) {
  // One cache throughout: the thread stays on the CPU it starts on.
  if (const int cpu = sched_getcpu(); cpu >= 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(static_cast<unsigned>(cpu), &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
  }
  grace::pool_options options;
  options.restartable_sequences = state.range(0) != 0;
  options.reuse_after_gp = state.range(1) != 0;
  grace::object_pool pool(64, options);
  for (auto _ : state) {
    void* first = pool.allocate();
    void* second = pool.allocate();
    benchmark::DoNotOptimize(first);
    benchmark::DoNotOptimize(second);
    pool.deallocate(second);
    pool.deallocate(first);
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * 4);
  state.SetLabel(pool.uses_restartable_sequences() ? "rseq" : "held");
}
BENCHMARK(BM_fast_paths)
    ->ArgNames({"rseq", "after_gp"})
    ->Args({1, 0})
    ->Args({0, 0})
    ->Args({1, 1})
    ->Args({0, 1});

}  // namespace
