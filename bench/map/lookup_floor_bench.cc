// What a lookup in a chained hash table costs on this machine before any map logic: the floor
// under grace-bench map's lookup case, and what a read section per lookup adds to it.
//
//   BM_bare_chain        bucket array (8-byte entries, like grace's dummies, twice as many as
//                        keys, as grace's default load factor gives) -> node chain; no read
//                        section, no hashing beyond the key's own bits
//   BM_bare_chain_split_key<reversed | multiplied>   the same walk comparing a split-order
//                        key first, as a split-ordered list does: the key's bits reversed
//                        (Shalev & Shavit's order, grace before session 11), or multiplied by
//                        2^64/phi (grace's order since): what computing the key costs
//   BM_chain_in_read_section   the same walk inside grace::pin(), one per lookup (grace's inline
//                        read side, which speaks liburcu's reader protocol)
//   BM_chain_in_urcu_read_section   the same with liburcu's urcu_memb_read_lock/unlock called
//                        through the shared library, as grace called them until it inlined
//                        them: what the calls cost
//   BM_grace_visit       grace::hash_map::visit() on the same keys and values
//   BM_libcuckoo_find    libcuckoo's find_fn() on the same keys and values, built as grace-bench
//                        map builds it (when libcuckoo is installed): the peer whose buckets
//                        hold their entries inline, so a lookup's misses (its two buckets and
//                        their locks) issue at once, and whose readers lock the two buckets'
//                        spinlocks instead of taking a read section
//
// Keys, values and the check of every value read are grace-bench map's (map_value.h); 2
// threads, uniform random keys, N = 10k and 1M present. At 1M keys each lookup waits on two
// dependent cache misses, and the rate depends on how many lookups the core overlaps: every
// instruction a lookup adds (a read section's library calls) leaves room for fewer of them.
#include <sys/mman.h>

#include <benchmark/benchmark.h>
#include <urcu/urcu-memb.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

#if GRACE_BENCH_HAVE_LIBCUCKOO
#include <libcuckoo/cuckoohash_map.hh>
#endif

#include "map/map_value.h"
#include "grace/map/hash_map.h"
#include "grace/reclaim/read_guard.h"

namespace grace::bench {
namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
constexpr unsigned kLookupsPerIteration = 64;

// How a split-ordered list orders its elements: by the bit-reversed hash (Shalev & Shavit),
// or by the hash times 2^64/phi (grace's element_so_key() for a Hash that does not avalanche).
enum class split_order { reversed, multiplied };

template <split_order Order>
std::uint64_t split_key(std::uint64_t key) noexcept {
  if constexpr (Order == split_order::reversed) {
    std::uint64_t x = key | (std::uint64_t{1} << 63);
    x = ((x >> 1) & 0x5555555555555555ull) | ((x & 0x5555555555555555ull) << 1);
    x = ((x >> 2) & 0x3333333333333333ull) | ((x & 0x3333333333333333ull) << 2);
    x = ((x >> 4) & 0x0F0F0F0F0F0F0F0Full) | ((x & 0x0F0F0F0F0F0F0F0Full) << 4);
    return __builtin_bswap64(x);
  } else {
    return grace::detail::element_so_key(key, /*avalanching=*/false);
  }
}

// The bare table: a node per key, chained from 8-byte bucket entries (the first node), twice
// as many buckets as keys rounded up to a power of two, as grace's default grow load factor
// (0.5) gives.
struct chain_node {
  chain_node* next;
  std::uint64_t so_key;  // read by check_split_key() only; gives the node grace's layout
  std::uint64_t key;
  value64 value;
};
struct bucket_entry {
  chain_node* first;
};

template <split_order Order>
class bare_table {
 public:
  explicit bare_table(std::size_t keys)
      : mask_(2 * std::bit_ceil(keys) - 1), nodes_(std::make_unique<chain_node[]>(keys)) {
    const std::size_t bytes = (mask_ + 1) * sizeof(bucket_entry);
    // On huge pages where the system allows, as grace's bucket levels of 2 MiB and more.
    mapped_bytes_ = bytes + kHugePage;
    mapped_ = ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped_ == MAP_FAILED) throw std::bad_alloc();
    const auto aligned =
        (reinterpret_cast<std::uintptr_t>(mapped_) + kHugePage - 1) & ~(kHugePage - 1);
    if (bytes >= kHugePage) ::madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
    buckets_ = reinterpret_cast<bucket_entry*>(aligned);
    for (std::size_t i = 0; i < keys; ++i) {
      chain_node& n = nodes_[i];
      n.key = key_of(i);
      n.so_key = split_key<Order>(n.key);
      n.value = make_value(n.key);
      bucket_entry& b = buckets_[n.key & mask_];
      n.next = b.first;
      b.first = &n;
    }
  }
  ~bare_table() { ::munmap(mapped_, mapped_bytes_); }
  bare_table(const bare_table&) = delete;
  bare_table& operator=(const bare_table&) = delete;

  // True if `key` is present with its value.
  bool check(std::uint64_t key) const {
    for (const chain_node* n = buckets_[key & mask_].first; n != nullptr; n = n->next) {
      if (n->key == key) return value_matches(n->value, key);
    }
    return false;
  }
  // The same, comparing the nodes' split-order keys first.
  bool check_split_key(std::uint64_t key) const {
    const std::uint64_t so_key = split_key<Order>(key);
    for (const chain_node* n = buckets_[key & mask_].first; n != nullptr; n = n->next) {
      if (n->so_key == so_key && n->key == key) {
        return value_matches(n->value, key);
      }
    }
    return false;
  }

 private:
  std::size_t mask_;
  std::unique_ptr<chain_node[]> nodes_;
  void* mapped_ = nullptr;
  std::size_t mapped_bytes_ = 0;
  bucket_entry* buckets_ = nullptr;
};

using grace_table = grace::hash_map<std::uint64_t, value64>;

std::unique_ptr<grace_table> make_grace_table(std::size_t keys) {
  auto map = std::make_unique<grace_table>();
  map->reserve(keys);
  for (std::size_t i = 0; i < keys; ++i) map->insert(key_of(i), make_value(key_of(i)));
  return map;
}

// Built once per size and order, on first use, shared by the benchmark's threads.
template <split_order Order = split_order::reversed>
const bare_table<Order>& bare_for(std::size_t keys) {
  if (keys == 10'000) {
    static const bare_table<Order> small(10'000);
    return small;
  }
  static const bare_table<Order> large(1'000'000);
  return large;
}
// A map built once per size by Make, on first use, shared by the benchmark's threads.
template <class Map, std::unique_ptr<Map> (*Make)(std::size_t)>
const Map& built_once(std::size_t keys) {
  if (keys == 10'000) {
    static const std::unique_ptr<Map> small = Make(10'000);
    return *small;
  }
  static const std::unique_ptr<Map> large = Make(1'000'000);
  return *large;
}
const grace_table& grace_for(std::size_t keys) {
  return built_once<grace_table, make_grace_table>(keys);
}

// Runs `check` on kLookupsPerIteration uniform random present keys per iteration; counts
// lookups whose key was missing or whose value was wrong as an error.
template <class Check>
void run_lookups(benchmark::State& state, Check check) {
  const auto keys = static_cast<std::uint64_t>(state.range(0));
  fast_rng rng(0x5eed ^ (static_cast<std::uint64_t>(state.thread_index()) << 32));
  std::uint64_t errors = 0;
  for (auto _ : state) {
    for (unsigned i = 0; i < kLookupsPerIteration; ++i) {
      const std::uint64_t key = key_of(fast_rng::below(rng.next(), keys));
      if (!check(key)) [[unlikely]] ++errors;
    }
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kLookupsPerIteration);
  if (errors != 0) state.SkipWithError("a lookup missed its key or read a wrong value");
}

void BM_bare_chain(benchmark::State& state) {
  const auto& table = bare_for(static_cast<std::size_t>(state.range(0)));
  run_lookups(state, [&](std::uint64_t key) { return table.check(key); });
}

template <split_order Order>
void BM_bare_chain_split_key(benchmark::State& state) {
  const auto& table = bare_for<Order>(static_cast<std::size_t>(state.range(0)));
  run_lookups(state, [&](std::uint64_t key) { return table.check_split_key(key); });
}

void BM_chain_in_read_section(benchmark::State& state) {
  const auto& table = bare_for(static_cast<std::size_t>(state.range(0)));
  { auto registers_this_thread = grace::pin(); }
  run_lookups(state, [&](std::uint64_t key) {
    auto guard = grace::pin();
    return table.check(key);
  });
}

void BM_chain_in_urcu_read_section(benchmark::State& state) {
  const auto& table = bare_for(static_cast<std::size_t>(state.range(0)));
  { auto registers_this_thread = grace::pin(); }  // liburcu registration, grace's way
  run_lookups(state, [&](std::uint64_t key) {
    urcu_memb_read_lock();
    const bool good = table.check(key);
    urcu_memb_read_unlock();
    return good;
  });
}

void BM_grace_visit(benchmark::State& state) {
  const grace_table& map = grace_for(static_cast<std::size_t>(state.range(0)));
  { auto registers_this_thread = grace::pin(); }
  run_lookups(state, [&](std::uint64_t key) {
    bool good = false;
    const bool found = map.visit(key, [&](const value64& v) { good = value_matches(v, key); });
    return found && good;
  });
}

#if GRACE_BENCH_HAVE_LIBCUCKOO
using cuckoo_table = libcuckoo::cuckoohash_map<std::uint64_t, value64>;

std::unique_ptr<cuckoo_table> make_cuckoo_table(std::size_t keys) {
  auto map = std::make_unique<cuckoo_table>(keys);  // grace-bench map's capacity hint: N
  for (std::size_t i = 0; i < keys; ++i) map->insert(key_of(i), make_value(key_of(i)));
  return map;
}
const cuckoo_table& cuckoo_for(std::size_t keys) {
  return built_once<cuckoo_table, make_cuckoo_table>(keys);
}

void BM_libcuckoo_find(benchmark::State& state) {
  const cuckoo_table& map = cuckoo_for(static_cast<std::size_t>(state.range(0)));
  run_lookups(state, [&](std::uint64_t key) {
    bool good = false;
    const bool found = map.find_fn(key, [&](const value64& v) { good = value_matches(v, key); });
    return found && good;
  });
}
BENCHMARK(BM_libcuckoo_find)->Arg(10'000)->Arg(1'000'000)->Threads(2)->UseRealTime();
#endif

BENCHMARK(BM_bare_chain)->Arg(10'000)->Arg(1'000'000)->Threads(2)->UseRealTime();
BENCHMARK(BM_bare_chain_split_key<split_order::reversed>)
    ->Arg(10'000)
    ->Arg(1'000'000)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK(BM_bare_chain_split_key<split_order::multiplied>)
    ->Arg(10'000)
    ->Arg(1'000'000)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK(BM_chain_in_read_section)->Arg(10'000)->Arg(1'000'000)->Threads(2)->UseRealTime();
BENCHMARK(BM_chain_in_urcu_read_section)->Arg(10'000)->Arg(1'000'000)->Threads(2)->UseRealTime();
BENCHMARK(BM_grace_visit)->Arg(10'000)->Arg(1'000'000)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace grace::bench
