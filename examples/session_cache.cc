// A session cache shared by request threads: lookups copy nothing and take no lock, updates
// replace whole values (readers holding the old one keep a consistent view), and an
// expiry thread erases idle sessions while everything runs. A session owns a std::string,
// so the map is told to let the request threads destroy replaced sessions, a batch at a
// time after their grace period (element_destruction::by_updaters).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "grace/map/hash_map.h"

struct session {
  std::string user;
  std::uint64_t requests = 0;
  std::uint64_t last_seen = 0;  // logical clock
};

int main() {
  // Replaced and expired sessions are destroyed by the request threads rather than one by one
  // on the reclaim worker: 2-3x the update rate for values that own memory. ~session() only
  // frees memory, as this mode asks (map/README.md, "Destroying erased elements").
  grace::hash_map_options options;
  options.destruction = grace::element_destruction::by_updaters;
  grace::hash_map<std::uint64_t, session> sessions(options);
  std::atomic<std::uint64_t> clock{0};
  std::atomic<bool> stop{false};
  constexpr std::uint64_t kSessions = 10'000;

  for (std::uint64_t id = 0; id < kSessions; ++id) {
    sessions.insert(id, session{"user" + std::to_string(id), 0, 0});
  }

  std::vector<std::thread> request_threads;
  std::atomic<std::uint64_t> served{0};
  for (int t = 0; t < 2; ++t) {
    request_threads.emplace_back([&, t] {
      std::uint64_t id = static_cast<std::uint64_t>(t) * 7919;
      for (int i = 0; i < 200'000; ++i) {
        id = (id * 6364136223846793005ull + 1442695040888963407ull) % kSessions;
        // Relaxed: a logical clock; no data hangs off it.
        const std::uint64_t now = clock.fetch_add(1, std::memory_order_relaxed);
        // Read without copying: the reference is valid inside the callback.
        bool known = sessions.visit(id, [&](const session& s) {
          if (s.user != "user" + std::to_string(id)) std::abort();  // never another's value
        });
        if (!known) {
          sessions.insert(id, session{"user" + std::to_string(id), 0, now});
        } else {
          // Atomic read-modify-write: every request is counted exactly once.
          sessions.update(id, [&](const session& s) {
            return session{s.user, s.requests + 1, now};
          });
        }
        served.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a counter.
      }
    });
  }

  std::thread expiry([&] {
    // Acquire: pairs with the Release store of stop below.
    while (!stop.load(std::memory_order_acquire)) {
      const std::uint64_t horizon = clock.load(std::memory_order_relaxed);  // Relaxed: a clock.
      std::vector<std::uint64_t> idle;
      sessions.for_each([&](std::uint64_t id, const session& s) {
        if (s.last_seen + 50'000 < horizon) idle.push_back(id);
      });
      for (std::uint64_t id : idle) {
        // Erase only if still idle: a request may have touched it since the scan.
        sessions.erase_if(id, [&](const session& s) { return s.last_seen + 50'000 < horizon; });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });

  for (auto& thread : request_threads) thread.join();
  // Release: pairs with the expiry thread's Acquire load.
  stop.store(true, std::memory_order_release);
  expiry.join();

  // Every session replaced or expired so far is destroyed when this returns.
  sessions.destroy_erased();
  const grace::hash_map_stats stats = sessions.stats();
  std::printf(
      "served=%llu sessions=%llu buckets=%llu pool_reused=%llu destroyed=%llu of %llu "
      "grace_periods=%llu\n",
      static_cast<unsigned long long>(served.load(std::memory_order_relaxed)),
      static_cast<unsigned long long>(stats.size), static_cast<unsigned long long>(stats.buckets),
      static_cast<unsigned long long>(stats.pool.reused_after_gp),
      static_cast<unsigned long long>(stats.pool.destroyed),
      static_cast<unsigned long long>(stats.pool.deallocated),
      static_cast<unsigned long long>(stats.reclamation.grace_periods));
  const bool all_destroyed = stats.pool.destroyed == stats.pool.deallocated;
  return served.load(std::memory_order_relaxed) == 400'000 && all_destroyed ? 0 : 1;
}
