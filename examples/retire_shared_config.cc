// A configuration object read by many threads and replaced by one, with no lock on the read
// side: readers pin, load the pointer and use it; the writer swaps in a new version and
// retires the old one, which is deleted once no reader can still hold it.
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "grace/reclaim/domain.h"

struct config {
  int version;
  std::string greeting;
};

int main() {
  grace::domain& reclamation = grace::domain::global();
  // Release/Acquire: readers see a fully built config through the pointer.
  std::atomic<config*> current{new config{0, "hello v0"}};
  std::atomic<bool> stop{false};

  std::vector<std::thread> readers;
  std::atomic<long> reads{0};
  for (int i = 0; i < 2; ++i) {
    readers.emplace_back([&] {
      // Acquire: pairs with the Release store of stop below.
      while (!stop.load(std::memory_order_acquire)) {
        auto guard = grace::pin();
        // Acquire: the config's fields were written before the Release exchange below.
        const config* c = current.load(std::memory_order_acquire);
        if (c->greeting != "hello v" + std::to_string(c->version)) {
          std::fprintf(stderr, "torn config read\n");
          std::abort();
        }
        reads.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a counter for the report.
      }
    });
  }

  for (int version = 1; version <= 10000; ++version) {
    auto* next = new config{version, "hello v" + std::to_string(version)};
    // AcqRel: publish the new config (Release) and take ownership of the old (Acquire).
    config* old = current.exchange(next, std::memory_order_acq_rel);
    reclamation.retire(old);  // deleted after every reader that may hold it has left
  }
  // Release: pairs with the readers' Acquire loads of stop.
  stop.store(true, std::memory_order_release);
  for (auto& reader : readers) reader.join();

  reclamation.retire(current.exchange(nullptr, std::memory_order_acq_rel));
  reclamation.barrier();  // every retired config has been deleted now
  const grace::domain_stats stats = reclamation.stats();
  std::printf("reads=%ld retired=%llu reclaimed=%llu grace_periods=%llu\n",
              reads.load(std::memory_order_relaxed),
              static_cast<unsigned long long>(stats.retired),
              static_cast<unsigned long long>(stats.reclaimed),
              static_cast<unsigned long long>(stats.grace_periods));
  return stats.retired == stats.reclaimed && stats.retired == 10001 ? 0 : 1;
}
