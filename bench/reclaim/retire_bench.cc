// The cost of domain::retire() on the retiring thread: a preallocated object into a domain
// whose deleter does nearly nothing, from one and two threads; beside malloc+free and the
// full malloc + retire (deleter frees) for reference. The domain's grace-period thread and
// reclaim worker run concurrently and compete for the same cores, as in real use; timing
// covers the retire calls only (the final barrier() is outside the timed loop).
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "grace/reclaim/domain.h"

namespace {

// Distinct addresses for the retired "objects": more than the default hard limit of pending
// objects (2^21), so no address is retired again while still pending.
constexpr std::size_t kSlots = std::size_t{1} << 22;
constexpr std::size_t kSlotMask = kSlots - 1;
constexpr std::size_t kObjectBytes = 40;

std::atomic<std::uint64_t> g_deleted{0};

void count_delete(void*) {
  // Relaxed: a statistic (keeps the deleter from being empty).
  g_deleted.fetch_add(1, std::memory_order_relaxed);
}

std::unique_ptr<grace::domain> g_domain;
std::vector<char> g_slots(kSlots);

// Setup/Teardown run once per benchmark run, before the threads start and after they end.
void make_domain(const benchmark::State&) { g_domain = std::make_unique<grace::domain>(); }
void drop_domain(const benchmark::State&) {
  g_domain->barrier();
  g_domain.reset();
}

void BM_retire_preallocated(benchmark::State& state) {
  grace::domain& d = *g_domain;
  std::size_t slot = static_cast<std::size_t>(state.thread_index()) * (kSlots / 2);
  for (auto _ : state) {
    d.retire(&g_slots[slot++ & kSlotMask], count_delete, kObjectBytes);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_retire_preallocated)
    ->Setup(make_domain)
    ->Teardown(drop_domain)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

struct small_object {
  std::uint64_t words[kObjectBytes / sizeof(std::uint64_t)];
};

// malloc + retire, the deleter frees: the whole life of a retired object on this thread.
void BM_new_and_retire(benchmark::State& state) {
  grace::domain& d = *g_domain;
  for (auto _ : state) {
    auto* object = new small_object;
    benchmark::DoNotOptimize(object);
    d.retire(object);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_new_and_retire)
    ->Setup(make_domain)
    ->Teardown(drop_domain)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();

// Reference: malloc + free of the same size on the same thread.
void BM_malloc_free(benchmark::State& state) {
  for (auto _ : state) {
    void* p = std::malloc(kObjectBytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_malloc_free)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
