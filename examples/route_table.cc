// A route table keyed by std::string, read by request threads with std::string_view slices of
// their request lines (heterogeneous lookup: no std::string is built per request), while a
// reloader replaces every route's target in batches, one read section per batch.
#include <absl/hash/hash.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "grace/map/hash_map.h"
#include "grace/reclaim/read_guard.h"

// Transparent hash and equality: both take std::string_view, so a std::string key and a
// string_view of the same characters hash and compare alike.
struct route_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view path) const {
    return absl::Hash<std::string_view>{}(path);
  }
};
struct route_equal {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};

struct route {
  std::string backend;
  std::uint64_t generation = 0;  // which reload wrote it
};

using route_table = grace::hash_map<std::string, route, route_hash, route_equal>;

std::string path_of(int i) { return "/api/v1/resource-" + std::to_string(i); }

int main() {
  constexpr int kRoutes = 2'000;
  constexpr std::uint64_t kReloads = 50;
  route_table routes;
  for (int i = 0; i < kRoutes; ++i) routes.insert(path_of(i), route{"backend-a", 0});

  // Request lines as a server would hold them: the path is a slice of a longer buffer.
  std::vector<std::string> requests;
  for (int i = 0; i < kRoutes; ++i) requests.push_back("GET " + path_of(i) + " HTTP/1.1");

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> served{0};
  std::vector<std::thread> servers;
  for (int t = 0; t < 2; ++t) {
    servers.emplace_back([&, t] {
      std::uint64_t n = 0;
      std::uint64_t last_generation[kRoutes] = {};
      // Acquire: pairs with the Release store of stop below.
      while (!stop.load(std::memory_order_acquire)) {
        const std::size_t index = (n * 7 + static_cast<std::uint64_t>(t)) % kRoutes;
        const std::string& line = requests[index];
        // "GET " + path + " HTTP/1.1": the path is the slice between.
        const std::string_view path = std::string_view(line).substr(4, line.size() - 13);
        // Found by a string_view: no std::string is built for the lookup.
        const bool found = routes.visit(path, [&](const route& r) {
          // A route's generation never goes back, and its backend matches its generation.
          if (r.generation < last_generation[index]) std::abort();
          if (r.backend != (r.generation % 2 == 0 ? "backend-a" : "backend-b")) std::abort();
          last_generation[index] = r.generation;
        });
        if (!found) std::abort();  // every route stays present through the reloads
        ++n;
      }
      served.fetch_add(n, std::memory_order_relaxed);  // Relaxed: read after the join.
    });
  }

  // Reloads: every route gets the next generation's backend. Each batch of 100 updates runs
  // under one read_guard, so the updates inside it nest instead of each entering liburcu.
  for (std::uint64_t generation = 1; generation <= kReloads; ++generation) {
    for (int first = 0; first < kRoutes; first += 100) {
      auto batch = grace::pin();
      for (int i = first; i < first + 100; ++i) {
        const std::string path = path_of(i);
        const bool replaced = routes.assign(
            path, route{generation % 2 == 0 ? "backend-a" : "backend-b", generation});
        if (!replaced) std::abort();
      }
    }
  }
  // Release: every reload before the servers' last look; pairs with their Acquire load.
  stop.store(true, std::memory_order_release);
  for (auto& server : servers) server.join();

  // Erase by string_view too, then check what is left.
  for (int i = 0; i < kRoutes; i += 2) {
    const std::string line = "DELETE " + path_of(i);
    if (!routes.erase(std::string_view(line).substr(7))) std::abort();
  }
  if (routes.size() != kRoutes / 2) std::abort();
  if (routes.contains(std::string_view("/api/v1/resource-0"))) std::abort();
  if (routes.find(std::string_view("/api/v1/resource-1"))->generation != kReloads) std::abort();

  std::printf("served=%llu routes=%zu reloads=%llu\n",
              static_cast<unsigned long long>(served.load(std::memory_order_relaxed)),
              routes.size(), static_cast<unsigned long long>(kReloads));
  return 0;
}
