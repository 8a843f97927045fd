// Tests for how grace::hash_map destroys erased and replaced elements
// (hash_map_options::destruction): on the domain's reclaim worker (the default), or by the
// threads that update the map, through the element pool's destroy hook (by_updaters); and
// hash_map::destroy_erased(), which waits for either.
//
// Order: options; lifetime accounting in both modes (exactly once, destroy_erased(), clear(),
// destruction, readers); where destruction runs; concurrency in both modes.
//
// Conventions:
//   - Every TEST_P runs once per element_destruction mode (Modes/HashMapDestruction.*/
//     OnReclaimWorker and .../ByUpdaters).
//   - lifetime_object (map_testing.h) gives every instance (copies included) a serial number
//     and counts destructions per serial; checked_string() values carry their key's checksum.
//   - Sleeps only widen race windows or poll with a timeout; correctness rests on joins,
//     destroy_erased(), clear(), barrier() and the map's destructor.
#include "grace/map/hash_map.h"

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/map/map_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace gm = grace::testing::map;
using gm::checked_string;
using gm::checked_string_key;
using gm::checked_string_valid_for;
using gm::checked_string_version;
using gm::lifetime_object;
using gm::lifetime_registry;
using gm::rejects;
using grace::element_destruction;
using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 60s;    // watchdog budget for scopes that must finish
constexpr auto kNoDrainTimer = 10s;  // the largest drain interval: the timer never fires

using lifetime_map = grace::hash_map<lifetime_object, lifetime_object>;
using lifetime_value_map = grace::hash_map<std::uint64_t, lifetime_object>;
using string_map = grace::hash_map<std::string, std::string>;

grace::hash_map_options with_destruction(element_destruction mode) {
  grace::hash_map_options options;
  options.destruction = mode;
  return options;
}

// One mode, named for test listings.
struct destruction_mode {
  element_destruction mode;
  const char* name;
};
void PrintTo(const destruction_mode& m, std::ostream* out) { *out << m.name; }

class HashMapDestruction : public ::testing::TestWithParam<destruction_mode> {
 protected:
  grace::hash_map_options options() const { return with_destruction(GetParam().mode); }
  bool by_updaters() const { return GetParam().mode == element_destruction::by_updaters; }
};

INSTANTIATE_TEST_SUITE_P(
    Modes, HashMapDestruction,
    ::testing::Values(destruction_mode{element_destruction::on_reclaim_worker, "OnReclaimWorker"},
                      destruction_mode{element_destruction::by_updaters, "ByUpdaters"}),
    [](const ::testing::TestParamInfo<destruction_mode>& info) {
      return std::string(info.param.name);
    });

// =============================================================================================
// Options.

TEST(HashMapDestructionOptions, ElementsAreDestroyedOnTheReclaimWorkerUnlessAskedOtherwise) {
  EXPECT_EQ(grace::hash_map_options{}.destruction, element_destruction::on_reclaim_worker);
}

void user_destroy(void*) noexcept {}

TEST_P(HashMapDestruction, AUserSetPoolDestroyIsRejectedNamingPoolDestroy) {
  // The map owns its pool's destroy hook, whatever its types and mode.
  grace::hash_map_options o = options();
  o.pool.destroy = &user_destroy;
  EXPECT_TRUE(rejects(o, "pool.destroy"));
  EXPECT_TRUE(rejects<string_map>(o, "pool.destroy"));
  EXPECT_TRUE(rejects<lifetime_map>(o, "pool.destroy"));
}

// =============================================================================================
// Lifetime accounting, in both modes.

TEST_P(HashMapDestruction, ErasedAndReplacedElementsAreDestroyedExactlyOnceByDestroyErased) {
  lifetime_registry registry(1 << 16);
  {
    lifetime_map map(options());
    constexpr std::uint64_t kCount = 1000;
    for (std::uint64_t k = 0; k < kCount; ++k) {
      ASSERT_TRUE(map.insert(lifetime_object(registry, k), lifetime_object(registry, k)));
    }
    ASSERT_EQ(registry.live(), 2 * static_cast<std::int64_t>(kCount));  // a key and a value each
    for (std::uint64_t k = 0; k < kCount; ++k) {
      const lifetime_object key(registry, k);
      switch (k % 4) {
        case 0:
          ASSERT_TRUE(map.erase(key));
          break;
        case 1:
          ASSERT_FALSE(map.insert_or_assign(key, lifetime_object(registry, k + 1)));
          break;
        case 2:
          ASSERT_TRUE(map.assign(key, lifetime_object(registry, k + 2)));
          break;
        case 3:
          ASSERT_TRUE(map.update(key, [&](const lifetime_object& old) {
            return lifetime_object(registry, old.payload() + 3);
          }));
          break;
      }
    }
    map.destroy_erased();
    // Left: 750 elements, each a key and a value; 1000 erased or replaced.
    EXPECT_EQ(registry.live(), 2 * 750);
    EXPECT_EQ(registry.corrupt(), 0u);
    EXPECT_EQ(map.size(), 750u);
    if (by_updaters()) {
      EXPECT_EQ(map.stats().pool.destroyed, kCount) << "the element pool's destroy hook ran on "
                                                    << "another number of elements";
    }
  }
  EXPECT_TRUE(registry.each_destroyed_once());
}

TEST_P(HashMapDestruction, ClearDestroysTheErasedElementsBeforeItReturns) {
  lifetime_registry registry(1 << 16);
  {
    lifetime_map map(options());
    for (std::uint64_t k = 0; k < 1000; ++k) {
      ASSERT_TRUE(map.insert(lifetime_object(registry, k), lifetime_object(registry, k)));
    }
    // Some erased and replaced before the clear(), waiting for their grace period.
    for (std::uint64_t k = 0; k < 999; k += 3) {  // k + 1 is a key too
      ASSERT_TRUE(map.erase(lifetime_object(registry, k)));
      ASSERT_TRUE(map.assign(lifetime_object(registry, k + 1), lifetime_object(registry, 7)));
    }
    map.clear();
    EXPECT_EQ(registry.live(), 0);  // neither destroy_erased() nor barrier(): clear() waited
    EXPECT_TRUE(map.empty());
    EXPECT_EQ(registry.corrupt(), 0u);
  }
  EXPECT_TRUE(registry.each_destroyed_once());
}

TEST_P(HashMapDestruction, DestroyingTheMapDestroysEveryElementExactlyOnce) {
  lifetime_registry registry(1 << 16);
  {
    lifetime_map map(options());
    for (std::uint64_t k = 0; k < 5000; ++k) {
      ASSERT_TRUE(map.insert(lifetime_object(registry, k), lifetime_object(registry, k)));
    }
    for (std::uint64_t k = 0; k < 5000; k += 2) {
      ASSERT_TRUE(map.erase(lifetime_object(registry, k)));
      ASSERT_FALSE(
          map.insert_or_assign(lifetime_object(registry, k + 1), lifetime_object(registry, 9)));
    }
    EXPECT_GT(registry.live(), 0);
  }
  EXPECT_EQ(registry.live(), 0);
  EXPECT_TRUE(registry.each_destroyed_once());
}

TEST_P(HashMapDestruction, AnElementErasedInsideAReadSectionStaysIntactUntilTheSectionEnds) {
  lifetime_registry registry(1 << 16);
  lifetime_map map(options());
  for (std::uint64_t k = 0; k < 10; ++k) {
    ASSERT_TRUE(map.insert(lifetime_object(registry, k), lifetime_object(registry, k * 100)));
  }
  std::vector<const lifetime_object*> held;
  {
    auto view = map.pin();
    for (std::uint64_t k = 0; k < 10; ++k) held.push_back(view.find(lifetime_object(registry, k)));
    for (std::uint64_t k = 0; k < 10; k += 2) ASSERT_TRUE(map.erase(lifetime_object(registry, k)));
    for (std::uint64_t k = 1; k < 10; k += 2) {
      ASSERT_FALSE(
          map.insert_or_assign(lifetime_object(registry, k), lifetime_object(registry, 7)));
    }
    // More updates from this thread, inside the same section: with by_updaters they run the
    // element pool's slow paths, where destroy runs for elements whose grace period ended.
    for (std::uint64_t k = 100; k < 2100; ++k) {
      ASSERT_TRUE(map.insert(lifetime_object(registry, k), lifetime_object(registry, k)));
      ASSERT_TRUE(map.erase(lifetime_object(registry, k)));
    }
    std::this_thread::sleep_for(20ms);  // let the domain's engine run if it were to
    for (std::uint64_t k = 0; k < 10; ++k) {
      ASSERT_NE(held[k], nullptr);
      EXPECT_TRUE(held[k]->intact()) << k;
      EXPECT_EQ(held[k]->payload(), k * 100) << k;
    }
    EXPECT_EQ(view.find(lifetime_object(registry, 0)), nullptr);
    EXPECT_EQ(view.find(lifetime_object(registry, 1))->payload(), 7u);
  }
  map.destroy_erased();
  EXPECT_EQ(registry.live(), 2 * 5);  // five elements left
  EXPECT_EQ(registry.corrupt(), 0u);
}

TEST_P(HashMapDestruction, ErasedElementsOfAnIdleMapAreDestroyedWithoutFurtherCalls) {
  // Nobody updates the map after the erases: the reclaim worker (on_reclaim_worker) or the
  // element pool's idle trim (by_updaters) must still destroy them.
  lifetime_registry registry(1 << 16);
  lifetime_value_map map(options());
  constexpr std::uint64_t kCount = 3000;
  for (std::uint64_t k = 0; k < kCount; ++k) ASSERT_TRUE(map.try_emplace(k, registry, k));
  for (std::uint64_t k = 0; k < kCount; ++k) ASSERT_TRUE(map.erase(k));
  EXPECT_TRUE(gt::eventually([&] { return registry.live() == 0; }, 20s))
      << registry.live() << " values of erased elements still live";
  EXPECT_TRUE(registry.each_destroyed_once());
}

// =============================================================================================
// Where destruction runs.

// A value that notes whether its destructor ran on a thread that updates the map.
thread_local bool updating_thread = false;
// Relaxed (both): tallies, read after a join, destroy_erased() or barrier(), which order the
// destructors before the read; that ordering is what the tests check.
std::atomic<std::uint64_t> destroyed_on_updating_threads{0};
std::atomic<std::uint64_t> destroyed_elsewhere{0};

struct notes_where_destroyed {
  explicit notes_where_destroyed(std::uint64_t v) noexcept : value(v) {}
  notes_where_destroyed(const notes_where_destroyed&) = default;
  ~notes_where_destroyed() {
    (updating_thread ? destroyed_on_updating_threads : destroyed_elsewhere)
        .fetch_add(1, std::memory_order_relaxed);  // Relaxed: see above.
  }
  std::uint64_t value;
};

TEST_P(HashMapDestruction, ErasedElementsAreDestroyedOnTheThreadsTheModeNames) {
  // Relaxed (both): no other thread runs yet.
  destroyed_on_updating_threads.store(0, std::memory_order_relaxed);
  destroyed_elsewhere.store(0, std::memory_order_relaxed);
  grace::domain_options quiet;
  quiet.drain_interval = kNoDrainTimer;  // the pool's idle trim never runs
  grace::domain d(quiet);
  constexpr std::uint64_t kKeys = 500;
  constexpr std::uint64_t kRounds = 20;
  grace::hash_map_options o = options();
  o.reclamation = &d;
  {
    grace::hash_map<std::uint64_t, notes_where_destroyed> map(o);
    std::thread updater([&] {
      updating_thread = true;
      for (std::uint64_t round = 0; round < kRounds; ++round) {
        // try_emplace builds the value in place: the only values destroyed are erased ones.
        for (std::uint64_t k = 0; k < kKeys; ++k) map.try_emplace(k, round);
        for (std::uint64_t k = 0; k < kKeys; ++k) map.erase(k);
        d.synchronize();  // the round's elements' grace period ends
      }
    });
    updater.join();
    // Relaxed: joined.
    const std::uint64_t on_updaters = destroyed_on_updating_threads.load(std::memory_order_relaxed);
    if (by_updaters()) {
      EXPECT_GT(on_updaters, 0u) << "no erased element was destroyed inside an update";
    } else {
      d.barrier();
      EXPECT_EQ(on_updaters, 0u) << "elements were destroyed inside updates";
      // Relaxed: after barrier().
      EXPECT_EQ(destroyed_elsewhere.load(std::memory_order_relaxed), kKeys * kRounds);
    }
    map.destroy_erased();
    // Relaxed (both): after destroy_erased().
    EXPECT_EQ(destroyed_on_updating_threads.load(std::memory_order_relaxed) +
                  destroyed_elsewhere.load(std::memory_order_relaxed),
              kKeys * kRounds);
  }
}

// =============================================================================================
// Concurrency.

TEST_P(HashMapDestruction, DestroyErasedCoversEveryElementItsThreadErasedWhileOthersUpdate) {
  // Each updater owns a registry and its own keys; a round inserts them, replaces them,
  // erases them and calls destroy_erased(): every instance its registry counted must then be
  // destroyed, while the other updaters keep updating and a reader reads them all.
  constexpr unsigned kUpdaters = 3;
  constexpr std::uint64_t kKeys = 300;  // per updater
  const std::size_t rounds = gt::iterations(100, 20);
  std::vector<std::unique_ptr<lifetime_registry>> registries;
  for (unsigned i = 0; i < kUpdaters; ++i) {
    registries.push_back(std::make_unique<lifetime_registry>(rounds * kKeys * 8));
  }
  std::atomic<std::uint64_t> rounds_left_alive{0};
  std::atomic<std::uint64_t> destroyed_while_read{0};
  std::atomic<std::uint64_t> reads{0};
  std::atomic<unsigned> updaters_left{kUpdaters};
  // Updater 0 erases its first round only once the reader has found a value: on a loaded
  // machine the reader could otherwise run only after the updaters, and read nothing.
  std::atomic<bool> reader_found_one{false};
  {
    lifetime_value_map map(options());
    gt::watchdog dog(kNoDeadlock, "updaters calling destroy_erased()");
    gt::run_threads(kUpdaters + 1, [&](unsigned index) {
      if (index == kUpdaters) {  // the reader
        std::uint64_t bad = 0;
        std::uint64_t found = 0;
        std::minstd_rand random(7);
        // Acquire: pairs with the updaters' Release decrements.
        while (updaters_left.load(std::memory_order_acquire) != 0) {
          auto view = map.pin();
          std::array<const lifetime_object*, 16> held{};
          for (const lifetime_object*& p : held) p = view.find(random() % (kKeys * kUpdaters));
          for (int pass = 0; pass < 8; ++pass) {
            for (const lifetime_object* p : held) {
              if (p == nullptr) continue;
              ++found;
              bad += !p->intact();
            }
          }
          // Relaxed: a progress signal; nothing is published through it.
          if (found != 0) reader_found_one.store(true, std::memory_order_relaxed);
        }
        // Relaxed (both): tallies, read after the join.
        destroyed_while_read.fetch_add(bad, std::memory_order_relaxed);
        reads.fetch_add(found, std::memory_order_relaxed);
        return;
      }
      lifetime_registry& registry = *registries[index];
      std::uint64_t left_alive = 0;
      for (std::size_t round = 0; round < rounds; ++round) {
        for (std::uint64_t i = 0; i < kKeys; ++i) {
          map.try_emplace(i * kUpdaters + index, registry, round);
        }
        for (std::uint64_t i = 0; i < kKeys; ++i) {
          map.insert_or_assign(i * kUpdaters + index, lifetime_object(registry, round + 1));
        }
        // Relaxed: see reader_found_one.
        while (index == 0 && round == 0 && !reader_found_one.load(std::memory_order_relaxed)) {
          std::this_thread::yield();
        }
        for (std::uint64_t i = 0; i < kKeys; ++i) map.erase(i * kUpdaters + index);
        map.destroy_erased();
        left_alive += registry.live() != 0;
      }
      // Relaxed: a tally, read after the join.
      rounds_left_alive.fetch_add(left_alive, std::memory_order_relaxed);
      // Release: this updater is done; pairs with the reader's Acquire load.
      updaters_left.fetch_sub(1, std::memory_order_release);
    });
    // Relaxed (all three): joined.
    EXPECT_EQ(rounds_left_alive.load(std::memory_order_relaxed), 0u)
        << "destroy_erased() returned before the values its thread erased were destroyed, in "
        << "that many of " << kUpdaters * rounds << " calls";
    EXPECT_EQ(destroyed_while_read.load(std::memory_order_relaxed), 0u)
        << "a reader saw a value destroyed inside its read section";
    EXPECT_GT(reads.load(std::memory_order_relaxed), 0u);
    EXPECT_TRUE(map.empty());
  }
  for (const std::unique_ptr<lifetime_registry>& registry : registries) {
    EXPECT_TRUE(registry->each_destroyed_once());
  }
}

TEST_P(HashMapDestruction, StringKeysAndValuesStayIntactForReadersWhileUpdatersReplaceThem) {
  // Two updaters insert, replace, update and erase std::string values that carry their key's
  // checksum; two readers check every value they see, in visit() and in pinned views that
  // hold pointers across several finds. A string destroyed while a reader can see it is a
  // use-after-free under ASan, and fails the checksum otherwise.
  constexpr std::uint64_t kKeys = 512;
  constexpr unsigned kUpdaters = 2;
  constexpr unsigned kReaders = 2;
  const std::size_t operations = gt::iterations(300'000);
  std::vector<std::string> keys;
  for (std::uint64_t k = 0; k < kKeys; ++k) keys.push_back(checked_string_key(k));
  std::atomic<unsigned> updaters_left{kUpdaters};
  std::atomic<std::uint64_t> bad_values{0};
  std::atomic<std::uint64_t> changed_under_reader{0};
  std::atomic<std::uint64_t> values_read{0};
  string_map map(options());
  {
    gt::watchdog dog(kNoDeadlock, "string updaters and readers");
    gt::run_threads(kUpdaters + kReaders, [&](unsigned index) {
      std::minstd_rand random(index + 1);
      std::uint64_t bad = 0;
      if (index < kUpdaters) {
        std::uint64_t version = std::uint64_t{index} << 40;
        for (std::size_t op = 0; op < operations; ++op) {
          const std::string& key = keys[random() % kKeys];
          switch (random() % 6) {
            case 0:
              map.insert_or_assign(key, checked_string(key, ++version));
              break;
            case 1:
              map.erase(key);
              break;
            case 2:
              map.update(key, [&](const std::string& old) {
                if (!checked_string_valid_for(old, key)) {
                  ++bad;
                  return checked_string(key, 0);
                }
                return checked_string(key, checked_string_version(old) + 1);
              });
              break;
            case 3:
              map.try_emplace(key, checked_string(key, 0));
              break;
            case 4:
              map.assign(key, checked_string(key, ++version));
              break;
            case 5:
              if (index == 0 && op % 512 < 6) {
                map.destroy_erased();
              } else {
                map.erase_if(key, [&](const std::string& value) {
                  if (!checked_string_valid_for(value, key)) {
                    ++bad;
                    return false;
                  }
                  return checked_string_version(value) % 2 == 0;
                });
              }
              break;
          }
        }
        // Relaxed: a tally, read after the join.
        bad_values.fetch_add(bad, std::memory_order_relaxed);
        // Release: this updater is done; pairs with the readers' Acquire loads.
        updaters_left.fetch_sub(1, std::memory_order_release);
        return;
      }
      std::uint64_t changed = 0;
      std::uint64_t read = 0;
      std::array<const std::string*, 8> held{};
      std::array<std::size_t, 8> held_keys{};
      std::array<std::string, 8> copies;
      // Acquire: pairs with the updaters' Release decrements.
      while (updaters_left.load(std::memory_order_acquire) != 0) {
        const std::size_t k = random() % kKeys;
        map.visit(keys[k], [&](const std::string& value) {
          ++read;
          bad += !checked_string_valid_for(value, keys[k]);
        });
        auto view = map.pin();
        for (std::size_t j = 0; j < held.size(); ++j) {
          held_keys[j] = random() % kKeys;
          held[j] = view.find(keys[held_keys[j]]);
          if (held[j] == nullptr) continue;
          ++read;
          bad += !checked_string_valid_for(*held[j], keys[held_keys[j]]);
          copies[j] = *held[j];
        }
        std::this_thread::yield();  // let the updaters replace what this view holds
        for (std::size_t j = 0; j < held.size(); ++j) {
          if (held[j] == nullptr) continue;
          changed += *held[j] != copies[j];
          bad += !checked_string_valid_for(*held[j], keys[held_keys[j]]);
        }
      }
      // Relaxed (all three): tallies, read after the join.
      bad_values.fetch_add(bad, std::memory_order_relaxed);
      changed_under_reader.fetch_add(changed, std::memory_order_relaxed);
      values_read.fetch_add(read, std::memory_order_relaxed);
    });
  }
  // Relaxed (all three): joined.
  EXPECT_EQ(bad_values.load(std::memory_order_relaxed), 0u)
      << "values that do not carry their key's checksum";
  EXPECT_EQ(changed_under_reader.load(std::memory_order_relaxed), 0u)
      << "a value changed while a pinned view held it";
  EXPECT_GT(values_read.load(std::memory_order_relaxed), 0u);
  std::size_t visited = 0;
  std::size_t invalid = 0;
  map.for_each([&](const std::string& key, const std::string& value) {
    ++visited;
    invalid += !checked_string_valid_for(value, key);
  });
  EXPECT_EQ(invalid, 0u);
  EXPECT_EQ(visited, map.size());
  map.destroy_erased();
  if (by_updaters()) {
    EXPECT_GT(map.stats().pool.destroyed, 0u);
  }
}

}  // namespace
