// Tests for grace::object_pool and grace::typed_pool: objects, options, stats, the
// reuse-after-grace-period guarantee, bulk calls, watermarks, allocation failure and
// destruction.
//
// Order: single-threaded semantics; lifetime accounting (typed_pool with an instance
// tracker); the guarantee (deterministic, then concurrent with a reuse_oracle); readers;
// bulk; memory given back; allocation failure; producer-consumer; destruction; death tests.
// The long runs live in object_pool_stress_test.cc (label `stress`).
//
// Conventions:
//   - Every test builds its own grace::domain, so grace periods and the engine's work are
//     the test's own.
//   - A "quiet" domain (10 s drain interval, the maximum) never flushes retired work on a
//     timer during a test: the pool's idle trim pass (which runs from a retire() callback)
//     then never runs, and a single-threaded test pinned to one CPU sees exactly the
//     magazine moves it causes. Only the tests about giving memory back use the default.
//   - The guarantee is checked from outside by a reuse_oracle (object_pool_testing.h): a
//     side table of the grace-period cookie taken right before each deallocate().
//   - Sleeps only widen race windows or poll with a timeout (gt::eventually); correctness
//     assertions rest on joins, flags, synchronize() and barrier().
#include "grace/alloc/object_pool.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <new>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "grace/reclaim/domain.h"
#include "grace/reclaim/read_guard.h"
#include "tests/alloc/object_pool_testing.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
namespace ga = grace::testing::alloc;
using namespace std::chrono_literals;
using ga::describe;
using ga::kHold;
using ga::kNoDeadlock;
using ga::quiet;
using ga::rejects;
using ga::small_magazines;

constexpr std::size_t kChunkBytes = std::size_t{64} << 10;  // object_pool.h: 64 KiB chunks
constexpr std::size_t kLargestObject = grace::object_pool::max_object_size;  // 3 a chunk

// The number of per-CPU caches (the configured CPUs rounded up to a power of two). The
// pool's own header includes this internal function; the bounds below are per cache.
std::size_t caches() { return grace::detail::cpu_shard_count(); }

std::size_t round_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// ---------------------------------------------------------------------------------------------
// Single-threaded semantics.

TEST(ObjectPool, AllocateReturnsDistinctWritableAlignedObjectsOfEverySize) {
  struct shape {
    std::size_t size;
    std::size_t alignment;  // 0: the default, alignof(std::max_align_t)
  };
  const shape shapes[] = {{1, 1},    {3, 2},      {4, 4},       {8, 0},
                          {24, 8},   {64, 64},    {100, 0},     {256, 128},
                          {1000, 0}, {4096, 4096}, {5000, 256}, {kLargestObject, 0},
                          {kLargestObject, 4096}};
  grace::domain d(quiet());
  for (const shape& sh : shapes) {
    SCOPED_TRACE("object_size " + std::to_string(sh.size) + ", alignment " +
                 std::to_string(sh.alignment));
    grace::pool_options options;
    options.alignment = sh.alignment;
    grace::object_pool pool(sh.size, options, d);
    EXPECT_EQ(pool.object_size(), sh.size);
    const std::size_t alignment = sh.alignment == 0 ? alignof(std::max_align_t) : sh.alignment;
    EXPECT_EQ(pool.options().alignment, alignment);
    // Enough objects for three chunks (at most 3000).
    const std::size_t stride = round_up(sh.size, alignment);
    const std::size_t count = std::min<std::size_t>(3000, 3 * kChunkBytes / stride + 3);
    std::vector<void*> objects;
    for (std::size_t i = 0; i < count; ++i) {
      void* p = pool.allocate();
      ASSERT_NE(p, nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % alignment, 0u) << "object " << i;
      ga::fill_object(p, sh.size, static_cast<unsigned char>(i * 7 + 1));
      objects.push_back(p);
    }
    // Every object still holds its own bytes: no two overlap.
    for (std::size_t i = 0; i < count; ++i) {
      const auto* bytes = static_cast<const unsigned char*>(objects[i]);
      ASSERT_TRUE(ga::object_intact(objects[i], sh.size)) << "object " << i << " overlaps another";
      ASSERT_EQ(bytes[0], static_cast<unsigned char>(i * 7 + 1)) << "object " << i;
    }
    std::vector<void*> sorted = objects;
    std::sort(sorted.begin(), sorted.end());
    for (std::size_t i = 1; i < sorted.size(); ++i) {
      ASSERT_GE(static_cast<char*>(sorted[i]) - static_cast<char*>(sorted[i - 1]),
                static_cast<std::ptrdiff_t>(sh.size))
          << "objects " << sorted[i - 1] << " and " << sorted[i] << " overlap";
    }
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, count);
    EXPECT_EQ(s.held_bytes, s.chunks * kChunkBytes);
    EXPECT_GE(s.chunks * kChunkBytes, count * sh.size);
    for (void* p : objects) pool.deallocate(p);
    EXPECT_EQ(pool.stats().deallocated, count);
  }
}

TEST(ObjectPool, DeallocateOfNullptrIsANoOp) {
  grace::domain d(quiet());
  grace::object_pool pool(64, {}, d);
  static_assert(noexcept(pool.deallocate(nullptr)));
  static_assert(noexcept(pool.deallocate_bulk(nullptr, 0)));
  pool.deallocate(nullptr);
  void* nulls[3] = {nullptr, nullptr, nullptr};
  pool.deallocate_bulk(nulls, 3);
  pool.deallocate_bulk(nullptr, 0);
  const grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.deallocated, 0u);
  EXPECT_EQ(s.allocated, 0u);
  EXPECT_EQ(s.chunks, 0u);
  EXPECT_EQ(s.held_bytes, 0u);

  // nullptr entries of a bulk call are skipped; the others are deallocated.
  void* mixed[4] = {nullptr, pool.allocate(), nullptr, pool.allocate()};
  pool.deallocate_bulk(mixed, 4);
  EXPECT_EQ(pool.stats().deallocated, 2u);
}

TEST(ObjectPool, DefaultWatermarksFollowTheBpfAllocatorScaledByObjectSize) {
  grace::domain d(quiet());
  {
    grace::object_pool pool(64, {}, d);
    EXPECT_EQ(pool.options().low_watermark, 32u);
    EXPECT_EQ(pool.options().high_watermark, 96u);
    EXPECT_EQ(pool.options().batch, 48u);
    EXPECT_EQ(pool.options().magazine_capacity, 256u);     // 16 KiB of objects
    EXPECT_EQ(pool.options().gp_request_threshold, 512u);  // 2 x magazine_capacity
    EXPECT_EQ(&pool.reclamation_domain(), &d);
  }
  {
    grace::object_pool pool(1024, {}, d);
    EXPECT_EQ(pool.options().low_watermark, 8u);
    EXPECT_EQ(pool.options().high_watermark, 24u);
    EXPECT_GE(pool.options().batch, 1u);
    EXPECT_LE(pool.options().batch, pool.options().high_watermark);
    EXPECT_EQ(pool.options().magazine_capacity, std::max<std::size_t>(16, pool.options().batch));
  }
  {
    grace::object_pool pool(kLargestObject, {}, d);
    EXPECT_GE(pool.options().low_watermark, 1u);
    EXPECT_LE(pool.options().low_watermark, pool.options().high_watermark);
    EXPECT_GE(pool.options().batch, 1u);
    EXPECT_LE(pool.options().batch, pool.options().high_watermark);
    EXPECT_EQ(pool.options().magazine_capacity, pool.options().batch);  // never below batch
  }
  {
    grace::object_pool pool(1, {}, d);
    EXPECT_EQ(pool.options().magazine_capacity, 1024u);  // 16 KiB of 16-byte strides
  }
  {
    grace::pool_options o;
    o.alignment = 8;
    grace::object_pool pool(1, o, d);
    EXPECT_EQ(pool.options().magazine_capacity, 2048u);  // 8-byte strides
  }
  {
    grace::pool_options o;  // 16 KiB holds 16 of these: the magazine keeps the batch
    o.low_watermark = 8;
    o.high_watermark = 24;
    o.batch = 24;
    grace::object_pool pool(1024, o, d);
    EXPECT_EQ(pool.options().magazine_capacity, 24u);
  }
}

TEST(ObjectPool, OwnerOfNamesThePoolThatAllocatedTheObject) {
  grace::domain d(quiet());
  grace::object_pool small(16, {}, d);
  grace::object_pool large(5000, {}, d);
  grace::typed_pool<std::uint64_t> typed({}, d);
  std::vector<void*> from_small(3000);
  std::vector<void*> from_large(50);
  small.allocate_bulk(from_small.data(), from_small.size());
  large.allocate_bulk(from_large.data(), from_large.size());
  std::uint64_t* word = typed.create(7u);
  for (void* p : from_small) ASSERT_EQ(&grace::object_pool::owner_of(p), &small);
  for (void* p : from_large) ASSERT_EQ(&grace::object_pool::owner_of(p), &large);
  EXPECT_EQ(&grace::object_pool::owner_of(word), &typed.pool());
  // Also for an object that waited for its grace period and came back.
  small.deallocate(from_small[0]);
  d.synchronize();
  std::vector<void*> again(2000);
  small.allocate_bulk(again.data(), again.size());
  for (void* p : again) ASSERT_EQ(&grace::object_pool::owner_of(p), &small);
  small.deallocate_bulk(again.data(), again.size());
  small.deallocate_bulk(from_small.data() + 1, from_small.size() - 1);
  large.deallocate_bulk(from_large.data(), from_large.size());
  typed.destroy(word);
}

TEST(ObjectPool, InvalidOptionsThrowInvalidArgumentNamingTheOption) {
  EXPECT_TRUE(rejects(0, {}, "object_size"));
  EXPECT_TRUE(rejects(kLargestObject + 1, {}, "object_size"));
  EXPECT_TRUE(rejects(std::size_t{1} << 20, {}, "object_size"));
  for (std::size_t alignment : {3, 6, 12, 48, 100, 8192}) {
    grace::pool_options o;
    o.alignment = alignment;
    EXPECT_TRUE(rejects(64, o, "alignment")) << "alignment " << alignment;
  }
  {
    grace::pool_options o = small_magazines();
    o.low_watermark = 17;  // > high 16
    EXPECT_TRUE(rejects(64, o, "low_watermark"));
  }
  {
    grace::pool_options o = small_magazines();
    o.batch = 0;
    EXPECT_TRUE(rejects(64, o, "batch"));
  }
  {
    grace::pool_options o = small_magazines();
    o.batch = 17;  // > high 16
    EXPECT_TRUE(rejects(64, o, "high_watermark"));
    EXPECT_TRUE(rejects(64, o, "batch"));
  }
  {
    grace::pool_options o = small_magazines();
    o.magazine_capacity = 7;  // < batch 8: a refill would not fit
    EXPECT_TRUE(rejects(64, o, "magazine_capacity"));
    o.magazine_capacity = 4097;
    EXPECT_TRUE(rejects(64, o, "magazine_capacity"));
  }
  {
    grace::pool_options o;
    o.magazine_capacity = 32;  // below the default batch (48), which the message names
    EXPECT_TRUE(rejects(64, o, "the default for this object size"));
  }
  {
    grace::pool_options o = small_magazines();
    o.allocator.allocate = nullptr;
    EXPECT_TRUE(rejects(64, o, "allocator"));
  }
  // The edges are accepted.
  grace::domain d(quiet());
  grace::pool_options edge;
  edge.low_watermark = 1;
  edge.high_watermark = 1;
  edge.batch = 1;
  edge.alignment = 4096;
  EXPECT_NO_THROW(grace::object_pool(kLargestObject, edge, d));
  EXPECT_NO_THROW(grace::object_pool(1, edge, d));
}

// Fills `objects` from the pool; returns how many of them were among `earlier`.
std::size_t allocate_counting_reuse(grace::object_pool& pool, std::vector<void*>& objects,
                                    const std::vector<void*>& earlier) {
  const std::set<void*> earlier_set(earlier.begin(), earlier.end());
  std::size_t reused = 0;
  for (void*& p : objects) {
    p = pool.allocate();
    reused += earlier_set.count(p);
  }
  return reused;
}

TEST(ObjectPool, StatsCountAllocationsFreshObjectsReuseAndChunks) {
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  grace::domain d(quiet());
  grace::pool_options options = small_magazines();  // batch 8
  options.caller_gp_threshold = 0;
  grace::object_pool pool(64, options, d);
  const grace::pool_stats empty = pool.stats();
  EXPECT_EQ(empty.allocated + empty.deallocated + empty.fresh + empty.reused_from_chunks +
                empty.reused_after_gp + empty.returned_to_system + empty.held_bytes +
                empty.peak_held_bytes + empty.chunks + empty.retained_chunks,
            0u);

  constexpr std::size_t kObjects = 20;
  std::vector<void*> first(kObjects);
  for (void*& p : first) p = pool.allocate();
  grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.allocated, kObjects);
  // Fresh objects are cut a magazine (batch) at a time: 3 refills of 8 for 20 objects.
  EXPECT_EQ(s.fresh, 24u) << describe(s);
  EXPECT_EQ(s.chunks, 1u);
  EXPECT_EQ(s.held_bytes, kChunkBytes);
  EXPECT_EQ(s.peak_held_bytes, kChunkBytes);
  EXPECT_EQ(s.reused_after_gp, 0u);
  EXPECT_EQ(s.deallocated, 0u);

  for (void* p : first) pool.deallocate(p);
  s = pool.stats();
  EXPECT_EQ(s.deallocated, kObjects);
  EXPECT_EQ(s.reused_after_gp, 0u) << "no grace period has run";
  // Gauges lag (they are refreshed on slow paths): at least the two sealed magazines.
  EXPECT_GE(s.waiting_for_gp, 16u) << describe(s);
  EXPECT_LE(s.waiting_for_gp, kObjects) << describe(s);

  d.synchronize();  // the two sealed magazines' cookies elapse
  std::vector<void*> second(kObjects);
  const std::size_t reused = allocate_counting_reuse(pool, second, first);
  s = pool.stats();
  EXPECT_EQ(s.allocated, 2 * kObjects);
  // The 4 fresh objects left in the loaded magazine go first, then the 16 objects of the
  // two magazines sealed before the grace period.
  EXPECT_EQ(s.reused_after_gp, 16u) << describe(s);
  EXPECT_EQ(reused, 16u);
  EXPECT_EQ(s.fresh, 24u) << "reused objects are not fresh: " << describe(s);
  EXPECT_EQ(s.returned_to_system, 0u);
  for (void* p : second) pool.deallocate(p);
  EXPECT_EQ(pool.stats().deallocated, 2 * kObjects);
}

TEST(ObjectPool, AMagazineWaitsForItsGracePeriodOnceItHoldsMagazineCapacityObjects) {
  // Refills cut `batch` objects, but deallocate() fills a magazine to its capacity before
  // it is stamped: 40 frees into magazines of 16 seal two (32 objects) and leave 8 behind.
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  grace::domain d(quiet());
  grace::pool_options options = small_magazines();  // batch 8
  options.magazine_capacity = 16;
  options.caller_gp_threshold = 0;
  options.gp_request_threshold = 1000;  // no grace period but the test's own
  grace::object_pool pool(64, options, d);
  constexpr std::size_t kObjects = 40;
  std::vector<void*> first(kObjects);
  for (void*& p : first) p = pool.allocate();
  EXPECT_EQ(pool.stats().fresh, 40u) << "five refills of batch 8";
  for (void* p : first) pool.deallocate(p);
  d.synchronize();  // the two sealed magazines' cookies elapse; the third was never stamped
  std::vector<void*> second(kObjects);
  const std::size_t reused = allocate_counting_reuse(pool, second, first);
  const grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.reused_after_gp, 32u) << describe(s);
  EXPECT_EQ(reused, 32u);
  for (void* p : second) pool.deallocate(p);
}

TEST(ObjectPool, ObjectsGoBackToTheSystemWhenCachesAndDepotAreFull) {
  // Ready objects above the busy limit go to the depot; with the depot full they go back to
  // their chunks, and a chunk whose every object came back is kept for reuse (up to 16,
  // which the idle trim releases: not in a quiet domain) or released.
  ga::pin_to_current_cpu pin;
  grace::domain d(quiet());
  grace::pool_options options = small_magazines();
  options.caller_gp_threshold = 0;
  grace::object_pool pool(64, options, d);
  const std::size_t objects = 20'000;  // ~20 chunks, far more than caches and depot hold
  std::vector<void*> held(objects);
  for (void*& p : held) p = pool.allocate();
  const grace::pool_stats full = pool.stats();
  for (std::size_t i = 0; i < objects; ++i) {
    pool.deallocate(held[i]);
    if (i % 64 == 63) d.synchronize();  // promotions happen in the next slow paths
  }
  d.synchronize();
  pool.deallocate(pool.allocate());  // one more pass through the slow paths
  const grace::pool_stats s = pool.stats();
  EXPECT_GT(s.returned_to_system, 0u) << describe(s);
  EXPECT_GT(s.retained_chunks + (full.chunks - s.chunks), 0u)
      << "no chunk came back whole: " << describe(s);
  EXPECT_LE(s.retained_chunks, 16u) << describe(s);
  EXPECT_EQ(s.held_bytes, s.chunks * kChunkBytes);
  EXPECT_EQ(s.peak_held_bytes, full.chunks * kChunkBytes);
}

// The system allocator, counting the chunks (64 KiB, aligned to 64 KiB) it hands out and
// takes back.
class chunk_counting_allocator {
 public:
  grace::system_allocator get() noexcept { return {&allocate, &deallocate, this}; }
  // Relaxed: tallies, read by the test's thread between calls.
  std::uint64_t chunks_allocated() const noexcept {
    return allocated_.load(std::memory_order_relaxed);
  }
  std::uint64_t chunks_given_back() const noexcept {
    return given_back_.load(std::memory_order_relaxed);
  }

 private:
  static void* allocate(std::size_t bytes, std::size_t alignment, void* context) noexcept {
    auto* self = static_cast<chunk_counting_allocator*>(context);
    if (bytes == kChunkBytes && alignment == kChunkBytes) {
      self->allocated_.fetch_add(1, std::memory_order_relaxed);
    }
    return grace::system_allocator::malloc_allocate(bytes, alignment, nullptr);
  }
  static void deallocate(void* memory, std::size_t bytes, void* context) noexcept {
    auto* self = static_cast<chunk_counting_allocator*>(context);
    if (bytes == kChunkBytes) self->given_back_.fetch_add(1, std::memory_order_relaxed);
    grace::system_allocator::malloc_deallocate(memory, bytes, nullptr);
  }

  std::atomic<std::uint64_t> allocated_{0};
  std::atomic<std::uint64_t> given_back_{0};
};

// The objects of a pool of 64-byte objects that fill `chunks` chunks of their own (they
// are cut from fresh chunks, in order).
std::vector<void*> allocate_whole_chunks(grace::object_pool& pool, std::size_t chunks) {
  constexpr std::size_t kPerChunk = 1021;  // behind the 64-byte header and a 16-word bitmap
  std::vector<void*> objects(chunks * kPerChunk);
  for (void*& p : objects) p = pool.allocate();
  return objects;
}

// A pool whose objects cycle between CPUs (one CPU allocates, another frees) empties
// chunks as fast as it cuts them: a chunk whose every object came back is kept (16 at most;
// past those, chunks go back to the system at once), and cut again before the system is
// asked for a new one. deallocate_unconstructed() sends objects straight to their chunks,
// past caches and depot, whatever the number of CPUs; a quiet domain runs no trim pass.
TEST(ObjectPool, AChunkWhoseEveryObjectCameBackIsCutAgainBeforeTheSystemIsAskedForOne) {
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned()) << "one cache cuts every chunk";
  chunk_counting_allocator memory;
  grace::domain d(quiet());
  grace::pool_options options = small_magazines();
  options.allocator = memory.get();
  grace::object_pool pool(64, options, d);
  const std::vector<void*> objects = allocate_whole_chunks(pool, 24);
  const std::uint64_t cut = memory.chunks_allocated();
  ASSERT_GE(cut, 24u);
  for (void* p : objects) pool.deallocate_unconstructed(p);
  const grace::pool_stats released = pool.stats();
  EXPECT_EQ(released.retained_chunks, 16u) << describe(released);
  EXPECT_EQ(memory.chunks_given_back(), 8u) << "past the 16 kept, chunks go back at once";

  // Eighteen chunks' worth: the 16 kept are cut before any chunk from the system.
  const std::vector<void*> again = allocate_whole_chunks(pool, 18);
  const grace::pool_stats reused = pool.stats();
  EXPECT_EQ(reused.retained_chunks, 0u) << describe(reused);
  EXPECT_LE(memory.chunks_allocated() - cut, 18u - 16u + 1u)
      << "chunks came from the system while kept ones were there";
  for (void* p : again) pool.deallocate_unconstructed(p);
}

// Kept chunks are no leak: the trim gives them back once no refill took them for a pass,
// also in a pool that nothing else gives the trim work to (its caches and depot empty).
TEST(ObjectPool, ChunksKeptForReuseGoBackToTheSystemOnceThePoolIsIdle) {
  chunk_counting_allocator memory;
  grace::domain d;  // the default drain interval: the idle trim runs
  grace::pool_options options = small_magazines();
  options.allocator = memory.get();
  grace::object_pool pool(64, options, d);
  const std::vector<void*> objects = allocate_whole_chunks(pool, 8);
  for (void* p : objects) pool.deallocate_unconstructed(p);
  EXPECT_GE(pool.stats().retained_chunks, 1u);
  grace::pool_stats s;
  // The trim drops a chunk from the pool's counts under the chunk lock and hands it to the
  // allocator after unlocking, so the allocator's tally is waited for too.
  const bool settled = gt::eventually(
      [&] {
        s = pool.stats();
        return s.retained_chunks == 0 && s.chunks <= caches() &&
               memory.chunks_given_back() >= 8u - caches();
      },
      5s);
  EXPECT_TRUE(settled) << "kept chunks still held; " << describe(s);
  EXPECT_GE(memory.chunks_given_back(), 8u - caches()) << describe(s);
}

// ---------------------------------------------------------------------------------------------
// Lifetime accounting: typed_pool.

TEST(ObjectPool, TypedPoolConstructsAndDestroysEveryObjectExactlyOnce) {
  constexpr std::size_t kObjects = 5000;
  gt::instance_tracker tracker(kObjects);
  grace::domain d(quiet());
  {
    grace::typed_pool<gt::tracked> pool({}, d);
    EXPECT_EQ(pool.pool().object_size(), sizeof(gt::tracked));
    std::vector<gt::tracked*> objects;
    for (std::size_t i = 0; i < kObjects; ++i) objects.push_back(pool.create(tracker, i));
    EXPECT_EQ(tracker.constructed(), kObjects);
    EXPECT_TRUE(tracker.none_destroyed(0, kObjects));
    for (std::size_t i = 0; i < kObjects; ++i) {
      ASSERT_TRUE(objects[i]->intact());
      ASSERT_EQ(objects[i]->id(), i);
    }
    for (gt::tracked* object : objects) pool.destroy(object);
    pool.destroy(nullptr);
    EXPECT_TRUE(tracker.each_destroyed_once(0, kObjects));
    EXPECT_EQ(pool.stats().allocated, kObjects);
    EXPECT_EQ(pool.stats().deallocated, kObjects);
  }
  EXPECT_TRUE(tracker.each_destroyed_once(0, kObjects)) << "the pool's destructor ran ~T()";
  EXPECT_EQ(tracker.corrupt_destructions(), 0u);
}

TEST(ObjectPool, TypedPoolAlignsObjectsForTheirType) {
  struct alignas(64) line {
    std::uint64_t words[3];
  };
  struct alignas(256) page_part {
    char bytes[300];
  };
  grace::domain d(quiet());
  grace::typed_pool<line> lines({}, d);
  grace::typed_pool<page_part> parts({}, d);
  EXPECT_EQ(lines.pool().options().alignment, 64u);
  EXPECT_EQ(parts.pool().options().alignment, 256u);
  std::vector<line*> ls;
  std::vector<page_part*> ps;
  for (int i = 0; i < 1000; ++i) {
    ls.push_back(lines.create());
    ps.push_back(parts.create());
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(ls.back()) % 64, 0u);
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(ps.back()) % 256, 0u);
  }
  for (line* l : ls) lines.destroy(l);
  for (page_part* p : ps) parts.destroy(p);
}

struct throws_when_asked {
  static inline int constructed = 0;
  static inline int destroyed = 0;
  explicit throws_when_asked(bool fail) {
    if (fail) throw std::runtime_error("constructor failed");
    ++constructed;
  }
  ~throws_when_asked() { ++destroyed; }
  std::uint64_t payload[4] = {};
};

TEST(ObjectPool, TypedPoolCreateWhoseConstructorThrowsReturnsTheObjectToThePool) {
  throws_when_asked::constructed = 0;
  throws_when_asked::destroyed = 0;
  gt::failing_allocator memory;
  grace::domain d(quiet());
  {
    grace::pool_options options;
    options.allocator = memory.get();
    grace::typed_pool<throws_when_asked> pool(options, d);
    throws_when_asked* kept = pool.create(false);
    EXPECT_THROW(pool.create(true), std::runtime_error);
    grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, 2u);
    EXPECT_EQ(s.deallocated, 1u) << "the memory of the failed create() was not given back";
    EXPECT_EQ(throws_when_asked::constructed, 1);
    EXPECT_EQ(throws_when_asked::destroyed, 0) << "~T() ran for an object never constructed";
    // The pool still works.
    std::vector<throws_when_asked*> more;
    for (int i = 0; i < 500; ++i) more.push_back(pool.create(false));
    for (throws_when_asked* p : more) pool.destroy(p);
    pool.destroy(kept);
    s = pool.stats();
    EXPECT_EQ(s.allocated, s.deallocated);
    EXPECT_EQ(throws_when_asked::destroyed, throws_when_asked::constructed);
    // (In debug builds the destructor below aborts if any object is still allocated.)
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

// ---------------------------------------------------------------------------------------------
// The guarantee, deterministically: while a reader that pinned before the deallocate() is
// inside, no grace period can end, so nothing deallocated after it pinned may come back.

TEST(ObjectPool, NothingIsReusedWhileAReaderThatPinnedBeforeTheDeallocateIsInside) {
  // Pinned: objects freed on one CPU's cache come back to allocations on that CPU (another
  // CPU would only see them through the depot, once its cache sheds them).
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  grace::domain d(quiet());
  grace::pool_options options = small_magazines();
  options.caller_gp_threshold = 0;  // the test thread must never wait for the reader
  grace::object_pool pool(64, options, d);
  constexpr std::size_t kObjects = 2000;
  std::vector<void*> first(kObjects);
  for (void*& p : first) p = pool.allocate();

  gt::guard_holder reader;
  reader.start();
  for (void* p : first) pool.deallocate(p);
  d.request_gp();  // a grace period may start, but cannot end while the reader is inside
  std::this_thread::sleep_for(kHold);

  const std::unordered_set<void*> first_set(first.begin(), first.end());
  std::vector<void*> second;
  for (std::size_t i = 0; i < 4 * kObjects; ++i) {
    second.push_back(pool.allocate());
    ASSERT_EQ(first_set.count(second.back()), 0u)
        << "allocation " << i << " reused an object while a reader from before its "
        << "deallocate() was still inside";
  }
  std::vector<void*> bulk(3 * kObjects);
  pool.allocate_bulk(bulk.data(), bulk.size());
  for (void* p : bulk) ASSERT_EQ(first_set.count(p), 0u) << "allocate_bulk reused early";
  EXPECT_EQ(pool.stats().reused_after_gp, 0u);

  reader.release();
  d.synchronize();
  // Now the same objects do come back.
  std::vector<void*> third(2 * kObjects);
  pool.allocate_bulk(third.data(), third.size());
  std::size_t reused = 0;
  for (void* p : third) reused += first_set.count(p);
  EXPECT_GT(reused, 0u) << describe(pool.stats());
  EXPECT_GT(pool.stats().reused_after_gp, 0u);

  pool.deallocate_bulk(second.data(), second.size());
  pool.deallocate_bulk(bulk.data(), bulk.size());
  pool.deallocate_bulk(third.data(), third.size());
}

TEST(ObjectPool, TheReuseOracleCatchesAPoolThatReusesAtOnce) {
  // The oracle the concurrent tests rely on must be able to fail: with reuse_after_gp =
  // false (the unsafe reference) and a read section held, every reuse is early.
  grace::domain d(quiet());
  grace::pool_options options;
  options.reuse_after_gp = false;
  grace::object_pool pool(64, options, d);
  ga::reuse_oracle oracle(d);
  {
    auto g = grace::pin();  // no grace period can end until this guard does
    for (int i = 0; i < 1000; ++i) {
      void* p = pool.allocate();
      oracle.on_allocate(p);
      oracle.on_deallocate(p);
      pool.deallocate(p);
    }
  }
  EXPECT_GT(oracle.violations(), 900u);
  EXPECT_FALSE(oracle.clean());
}

// ---------------------------------------------------------------------------------------------
// The guarantee under concurrency.

struct reuse_case {
  const char* name;
  std::size_t object_size;
  grace::pool_options options;
  ga::churn_options churn;
};

grace::pool_options tiny_caller_threshold() {
  grace::pool_options o = small_magazines();
  o.caller_gp_threshold = 64;  // deallocating threads run grace periods themselves, often
  return o;
}

// Objects smaller than AddressSanitizer's 8-byte shadow granule, packed 4 bytes apart:
// neighbours share a shadow byte, so poisoning one must never make another unusable.
grace::pool_options four_byte_objects() {
  grace::pool_options o = small_magazines();
  o.alignment = 4;
  return o;
}

grace::pool_options batch_of_one() {
  grace::pool_options o;
  o.low_watermark = 1;
  o.high_watermark = 2;
  o.batch = 1;
  o.magazine_capacity = 1;
  return o;
}

const reuse_case kReuseCases[] = {
    {"DefaultOptionsOutsideGuards", 64, {}, {.threads = 2, .guards = ga::guards::never}},
    {"DefaultOptionsInsideGuards", 64, {}, {.threads = 2, .guards = ga::guards::always}},
    {"SmallMagazinesOutsideGuards", 48, small_magazines(),
     {.threads = 2, .guards = ga::guards::never, .max_held = 300}},
    {"SmallMagazinesInsideGuards", 48, small_magazines(),
     {.threads = 2, .guards = ga::guards::always, .max_held = 300}},
    {"CallerRunGracePeriodsMixedGuards", 128, tiny_caller_threshold(),
     {.threads = 3, .guards = ga::guards::odd_threads, .max_held = 500}},
    {"BatchOfOneMixedGuards", 32, batch_of_one(),
     {.threads = 2, .guards = ga::guards::odd_threads, .max_held = 100}},
    {"FourByteObjectsMixedGuards", 4, four_byte_objects(),
     {.threads = 3, .guards = ga::guards::odd_threads, .max_held = 300}},
};

// Names the case in test listings (instead of its bytes).
void PrintTo(const reuse_case& c, std::ostream* out) { *out << c.name; }

class ObjectPoolReuse : public ::testing::TestWithParam<reuse_case> {};

INSTANTIATE_TEST_SUITE_P(Configs, ObjectPoolReuse, ::testing::ValuesIn(kReuseCases),
                         [](const ::testing::TestParamInfo<reuse_case>& info) {
                           return std::string(info.param.name);
                         });

TEST_P(ObjectPoolReuse, NeverReusesAnObjectBeforeAGracePeriod) {
  const reuse_case& c = GetParam();
  grace::domain d;
  grace::object_pool pool(c.object_size, c.options, d);
  ga::reuse_oracle oracle(d);
  ga::churn_options churn = c.churn;
  churn.operations = gt::iterations(1'000'000);
  const ga::churn_totals totals = ga::churn(pool, oracle, churn);

  EXPECT_TRUE(oracle.clean());
  EXPECT_EQ(totals.corrupted, 0u) << "an allocated object was written by someone else";
  EXPECT_EQ(totals.allocated, totals.deallocated);
  const grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.allocated, totals.allocated) << describe(s);
  EXPECT_EQ(s.deallocated, totals.deallocated) << describe(s);
  // The run must have exercised reuse, or it proved nothing.
  EXPECT_GT(oracle.reuses(), totals.allocated / 4) << describe(s);
  EXPECT_GT(s.reused_after_gp, 0u);
}

TEST(ObjectPool, EightThreadsOnTwoCoresNeverReuseBeforeAGracePeriod) {
  // More threads than CPUs: threads are preempted while holding a CPU's cache, so the
  // contended paths (another cache, or the lock-free fallbacks) run too.
  grace::domain d;
  grace::object_pool pool(64, small_magazines(), d);
  ga::reuse_oracle oracle(d);
  const ga::churn_totals totals =
      ga::churn(pool, oracle,
                {.threads = 8, .operations = gt::iterations(200'000),
                 .guards = ga::guards::odd_threads, .max_held = 400});
  EXPECT_TRUE(ga::churn_accounted(pool, oracle, totals));
}

// Fresh objects are cut from chunks one chunk at a time per cache, so the chunks a pool ever
// held number at most ceil(fresh / objects a chunk) plus one chunk being cut per cache.
// The one exception is the fallback for a thread that finds every cache held (its holders
// were preempted): it takes a whole chunk for one object. Bound: that plus 16 such rare
// fallbacks:
//   peak_held_bytes <= (ceil(fresh / objects_per_chunk) + caches + 16) * 64 KiB.
// With more threads than CPUs, holders are preempted while holding a cache; the bound shows
// whether the fallback stays rare and whether its chunks stay pinned while their objects are
// reused.
TEST(ObjectPool, EightThreadsOnTwoCoresHoldNoMoreChunksThanTheirFreshObjectsNeed) {
  grace::domain d;
  grace::object_pool pool(64, small_magazines(), d);
  ga::reuse_oracle oracle(d);
  const ga::churn_totals totals =
      ga::churn(pool, oracle,
                {.threads = 8, .operations = gt::iterations(400'000),
                 .guards = ga::guards::odd_threads, .max_held = 400});
  EXPECT_TRUE(oracle.clean());
  EXPECT_EQ(totals.allocated, totals.deallocated);
  const grace::pool_stats s = pool.stats();
  const std::size_t per_chunk = (kChunkBytes - 64 - 128) / 64;  // header, bitmap: 1021
  const std::size_t bound =
      ((s.fresh + per_chunk - 1) / per_chunk + caches() + 16) * kChunkBytes;
  EXPECT_LE(s.peak_held_bytes, bound)
      << "the pool held " << s.peak_held_bytes / kChunkBytes << " chunks at its peak for "
      << s.fresh << " fresh objects (" << per_chunk << " a chunk): " << describe(s);
}

// ---------------------------------------------------------------------------------------------
// Readers.

TEST(ObjectPool, AReaderKeepsSeeingItsObjectIntactWhileOthersChurn) {
  // A writer keeps replacing the published object (allocate, fill with its generation,
  // publish, deallocate the old one); churners allocate and overwrite objects at full speed.
  // A reader pins, takes the published object and checks, for the whole guard, that every
  // word still holds the generation it first read.
  constexpr std::size_t kWords = 32;  // 256-byte objects
  constexpr std::uint64_t kChurnWord = 0x5a5a5a5a5a5a5a5aULL;
  grace::domain d;
  grace::object_pool pool(kWords * sizeof(std::uint64_t), small_magazines(), d);
  auto fill = [&](void* memory, std::uint64_t value) {
    auto* words = static_cast<std::uint64_t*>(memory);
    for (std::size_t i = 0; i < kWords; ++i) words[i] = value;
    return words;
  };
  std::atomic<std::uint64_t*> published{fill(pool.allocate(), 1)};
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> torn{0};
  std::atomic<std::uint64_t> replaced_while_read{0};
  // The reader runs at least this many sections, and on until the writer has replaced its
  // object under it kMinOverlaps times (or the deadline passes: then the test fails below).
  const std::size_t min_sections = gt::iterations(40'000);
  constexpr std::uint64_t kMinOverlaps = 50;
  const auto deadline = std::chrono::steady_clock::now() + 20s;

  gt::run_threads(4, [&](unsigned index) {
    if (index == 0) {  // the reader
      for (std::size_t n = 0;; ++n) {
        // Relaxed: only this thread writes the tally.
        if (n >= min_sections &&
            replaced_while_read.load(std::memory_order_relaxed) >= kMinOverlaps) {
          break;
        }
        if (n % 256 == 0 && std::chrono::steady_clock::now() > deadline) break;
        auto g = grace::pin();
        // Acquire: the object's words, written before it was published; pairs with the
        // AcqRel exchange in the writer.
        const std::uint64_t* object = published.load(std::memory_order_acquire);
        const volatile std::uint64_t* words = object;
        const std::uint64_t first = words[0];
        std::uint64_t bad = 0;
        for (int pass = 0; pass < 64; ++pass) {
          for (std::size_t i = 0; i < kWords; ++i) bad += words[i] != first;
        }
        if (first == kChurnWord || first == 0) ++bad;
        // Relaxed (all three): tallies, read after the join; the published pointer is only
        // compared, never dereferenced.
        if (bad != 0) torn.fetch_add(1, std::memory_order_relaxed);
        if (published.load(std::memory_order_relaxed) != object) {
          replaced_while_read.fetch_add(1, std::memory_order_relaxed);
        }
      }
      // Release: ends the other threads' loops; pairs with their Acquire loads.
      stop.store(true, std::memory_order_release);
    } else if (index == 1) {  // the writer
      // Acquire: pairs with the Release store of `stop` by the reader.
      for (std::uint64_t generation = 2; !stop.load(std::memory_order_acquire); ++generation) {
        std::uint64_t* fresh = fill(pool.allocate(), generation);
        // AcqRel: Release publishes the filled words to readers (pairs with their Acquire
        // load); Acquire takes the old object we now own.
        std::uint64_t* old = published.exchange(fresh, std::memory_order_acq_rel);
        pool.deallocate(old);
      }
    } else {  // churners
      std::vector<void*> mine;
      // Acquire: pairs with the Release store of `stop` by the reader.
      while (!stop.load(std::memory_order_acquire)) {
        for (int i = 0; i < 64; ++i) mine.push_back(fill(pool.allocate(), kChurnWord));
        for (void* p : mine) pool.deallocate(p);
        mine.clear();
      }
    }
  });
  // Relaxed: every thread was joined.
  EXPECT_EQ(torn.load(std::memory_order_relaxed), 0u)
      << "a reader saw its object change inside its read section";
  // The window the test is about was exercised: the object was deallocated (and the pool
  // churned) while the reader still held it.
  EXPECT_GE(replaced_while_read.load(std::memory_order_relaxed), kMinOverlaps);  // Relaxed: joined.
  // Relaxed: joined.
  pool.deallocate(published.load(std::memory_order_relaxed));
  EXPECT_GT(pool.stats().reused_after_gp, 0u);
}

// ---------------------------------------------------------------------------------------------
// Bulk calls.

TEST(ObjectPool, BulkCallsOfEverySizeHandOutDistinctObjects) {
  grace::domain d(quiet());
  grace::object_pool pool(40, small_magazines(), d);
  const std::size_t batch = pool.options().batch;
  std::unordered_set<void*> live;
  std::vector<std::vector<void*>> groups;
  std::uint64_t total = 0;
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, batch - 1, batch, batch + 1,
                            3 * batch + 5, std::size_t{7000}}) {
    SCOPED_TRACE("count " + std::to_string(count));
    std::vector<void*> objects(count + 1, nullptr);
    void* const sentinel = &objects;
    objects[count] = sentinel;
    pool.allocate_bulk(objects.data(), count);
    EXPECT_EQ(objects[count], sentinel) << "allocate_bulk wrote past `count`";
    objects.pop_back();
    for (void* p : objects) {
      ASSERT_NE(p, nullptr);
      ASSERT_TRUE(live.insert(p).second) << "allocate_bulk returned " << p << " twice";
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(p) % alignof(std::max_align_t), 0u);
      ga::fill_object(p, 40, static_cast<unsigned char>(total++));
    }
    groups.push_back(std::move(objects));
  }
  EXPECT_EQ(pool.stats().allocated, total);
  std::uint64_t checked = 0;
  for (const auto& group : groups) {
    for (void* p : group) {
      ASSERT_TRUE(ga::object_intact(p, 40));
      ASSERT_EQ(*static_cast<unsigned char*>(p), static_cast<unsigned char>(checked++));
    }
  }
  for (auto& group : groups) pool.deallocate_bulk(group.data(), group.size());
  EXPECT_EQ(pool.stats().deallocated, total);
}

TEST(ObjectPool, BulkCallsNeverReuseBeforeAGracePeriodUnderConcurrency) {
  // Bulk-only churn: every allocation and deallocation of the test is a bulk call.
  grace::domain d;
  grace::object_pool pool(64, small_magazines(), d);
  ga::reuse_oracle oracle(d);
  const std::size_t rounds = gt::iterations(20'000);
  std::atomic<std::uint64_t> moved{0};
  gt::run_threads(2, [&](unsigned index) {
    ga::random_source random(index + 11);
    std::vector<void*> objects(80);
    for (std::size_t r = 0; r < rounds; ++r) {
      const std::size_t n = random.below(objects.size() + 1);
      auto guard = index == 1 ? std::make_unique<grace::read_guard>() : nullptr;
      pool.allocate_bulk(objects.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        oracle.on_allocate(objects[i]);
        ga::fill_object(objects[i], 64, static_cast<unsigned char>(i));
      }
      for (std::size_t i = 0; i < n; ++i) oracle.on_deallocate(objects[i]);
      pool.deallocate_bulk(objects.data(), n);
      // Relaxed: a tally, read after the join.
      moved.fetch_add(n, std::memory_order_relaxed);
    }
  });
  EXPECT_TRUE(oracle.clean());
  EXPECT_GT(oracle.reuses(), moved.load(std::memory_order_relaxed) / 4);  // Relaxed: joined.
}

TEST(ObjectPool, AllocateBulkUnderAllocationFailureIsAllOrNothing) {
  // The n-th system allocation fails, for every n a bulk call of many chunks makes: the call
  // either hands out every object or throws std::bad_alloc leaving none allocated.
  // 128-byte objects: 511 a chunk (64 KiB less the header and the free-slot bitmap), so
  // refills of 73 end exactly at each chunk's end and a failed chunk allocation finds the
  // magazine empty (with another batch the refill would hand out the chunk's tail and the
  // next refill would try again: no failure would surface).
  constexpr std::size_t kObjectSize = 128;
  constexpr std::size_t kCount = 5000;  // 10 chunks, ~70 refills
  grace::pool_options options;
  options.low_watermark = 16;
  options.high_watermark = 96;
  options.batch = 73;
  std::uint64_t attempts_clean = 0;
  {
    gt::failing_allocator memory;
    grace::domain d(quiet());
    options.allocator = memory.get();
    grace::object_pool pool(kObjectSize, options, d);
    std::vector<void*> objects(kCount);
    pool.allocate_bulk(objects.data(), kCount);
    attempts_clean = memory.attempts();
    pool.deallocate_bulk(objects.data(), kCount);
  }
  ASSERT_GT(attempts_clean, 5u);
  std::size_t threw = 0;
  for (std::uint64_t n = 1; n <= attempts_clean + 1; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n) + " fails");
    gt::failing_allocator memory;
    {
      grace::domain d(quiet());
      options.allocator = memory.get();
      grace::object_pool pool(kObjectSize, options, d);
      // Some objects first, so the call starts from a loaded magazine.
      std::vector<void*> before(10);
      pool.allocate_bulk(before.data(), before.size());
      memory.fail_nth(n);
      std::vector<void*> objects(kCount, nullptr);
      bool ok = true;
      try {
        pool.allocate_bulk(objects.data(), kCount);
      } catch (const std::bad_alloc&) {
        ok = false;
        ++threw;
      }
      grace::pool_stats s = pool.stats();
      if (ok) {
        std::unordered_set<void*> distinct(objects.begin(), objects.end());
        EXPECT_EQ(distinct.size(), kCount);
        EXPECT_EQ(s.allocated, kCount + before.size());
        pool.deallocate_bulk(objects.data(), kCount);
      } else {
        EXPECT_EQ(s.allocated - s.deallocated, before.size())
            << "a failed allocate_bulk left objects allocated: " << describe(s);
      }
      // The pool still serves a bulk call once memory is back.
      memory.fail_nth(0);
      pool.allocate_bulk(objects.data(), kCount);
      pool.deallocate_bulk(objects.data(), kCount);
      pool.deallocate_bulk(before.data(), before.size());
      s = pool.stats();
      EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
      // (In debug builds the destructor below aborts if an object is still allocated.)
    }
    EXPECT_EQ(memory.live_allocations(), 0);
    EXPECT_EQ(memory.live_bytes(), 0);
  }
  // Each chunk and chunk record allocation of the call surfaces.
  EXPECT_GE(threw, 8u) << "injected failures did not reach allocate_bulk";
}

// ---------------------------------------------------------------------------------------------
// Memory given back.

// After a burst, with no further call on the pool, the idle trim pass sheds each cache to
// its watermarks and empties the idle depot. Bound on what stays:
//   - ready objects (the stats gauge): at most high_watermark per cache (a first trim pass
//     keeps (low + high) / 2 in ready magazines plus the loaded magazine's up to
//     magazine_capacity, which may exceed high; the second pass empties the cache, which
//     the next test checks, and the test waits for it);
//   - held bytes: the burst was deallocated in allocation order and a cache keeps its
//     newest magazines, so what stays is at most (high + magazine_capacity) consecutive
//     objects per cache, spanning at most ceil((high + magazine_capacity) * stride / chunk)
//     + 1 chunks, plus the chunk each cache is cutting fresh objects from:
//       caches * (ceil((high + magazine_capacity) * stride / 64 KiB) + 2) * 64 KiB.
//   For 64-byte objects with the default watermarks on 2 CPUs that is 6 chunks (384 KiB)
//   out of the burst's ~196 (12.5 MiB).
class ObjectPoolWatermarks : public ::testing::TestWithParam<bool> {};

INSTANTIATE_TEST_SUITE_P(Modes, ObjectPoolWatermarks, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ReuseAfterGracePeriod" : "ImmediateReuse";
                         });

TEST_P(ObjectPoolWatermarks, GiveMemoryBackAfterABurstWithoutFurtherCalls) {
  grace::domain d;
  grace::pool_options options;
  options.reuse_after_gp = GetParam();
  grace::object_pool pool(64, options, d);
  const std::size_t objects = 200'000;
  std::vector<void*> held(objects);
  for (void*& p : held) p = pool.allocate();
  for (void* p : held) pool.deallocate(p);
  const grace::pool_stats burst = pool.stats();
  EXPECT_GE(burst.peak_held_bytes, objects * 64);

  const std::size_t high = pool.options().high_watermark;
  const std::size_t magazine = pool.options().magazine_capacity;
  const std::size_t stride = 64;
  const std::size_t chunks_per_cache =
      ((high + magazine) * stride + kChunkBytes - 1) / kChunkBytes + 2;
  const std::size_t held_bound = caches() * chunks_per_cache * kChunkBytes;
  const std::size_t ready_bound = caches() * high;
  const std::size_t returned_bound = objects - caches() * (high + magazine);
  grace::pool_stats s;
  // stats() fields are not mutually consistent: a trim pass may have freed chunks but not yet
  // counted their objects as returned. Wait for all three.
  const bool settled = gt::eventually(
      [&] {
        s = pool.stats();
        return s.held_bytes <= held_bound && s.ready <= ready_bound && s.waiting_for_gp == 0 &&
               s.returned_to_system > returned_bound;
      },
      5s);
  EXPECT_TRUE(settled) << "held_bytes bound " << held_bound << ", ready bound " << ready_bound
                       << ", returned more than " << returned_bound << "; " << describe(s);
  EXPECT_EQ(s.held_bytes, s.chunks * kChunkBytes);

  // The pool still works, and reuses what it kept.
  std::vector<void*> again(1000);
  pool.allocate_bulk(again.data(), again.size());
  pool.deallocate_bulk(again.data(), again.size());
}

// The objects a cache keeps after a burst are the last it was given back. Freed in another
// order than they were cut, each may sit in a chunk of its own: then the (low + high) / 2 a
// first trim pass keeps (plus the loaded magazine) would hold up to ~100 chunks for a few
// KiB (48 objects held 2-3 MiB with the emptying off). A cache still idle at the next pass
// gives back every ready object, and only the chunk being cut from stays: this thread's,
// pinned, where only its cache allocates.
TEST_P(ObjectPoolWatermarks, AnIdleCacheGivesBackTheChunksItsLastObjectsAreScatteredOver) {
  ga::pin_to_current_cpu pinned;  // one cache keeps everything it is given back
  grace::domain d;
  grace::pool_options options;
  options.reuse_after_gp = GetParam();
  grace::object_pool pool(64, options, d);
  const std::size_t objects = 200'000;  // ~200 chunks
  std::vector<void*> held(objects);
  for (void*& p : held) p = pool.allocate();
  // Every 1024th object first, then the ones after those: the last batch freed holds one
  // object from each of ~200 chunks.
  constexpr std::size_t kStride = 1024;
  for (std::size_t offset = 0; offset < kStride; ++offset) {
    for (std::size_t i = offset; i < objects; i += kStride) pool.deallocate(held[i]);
  }
  // Unpinned (the affinity could not be set), any cache may have cut a chunk.
  const std::size_t held_bound = (pinned.pinned() ? 1 : caches()) * kChunkBytes;
  grace::pool_stats s;
  const bool settled = gt::eventually(
      [&] {
        s = pool.stats();
        return s.ready == 0 && s.waiting_for_gp == 0 && s.held_bytes <= held_bound;
      },
      5s);
  EXPECT_TRUE(settled) << "held_bytes bound " << held_bound << " (the chunks being cut); "
                       << describe(s);

  // The pool still works.
  std::vector<void*> again(1000);
  pool.allocate_bulk(again.data(), again.size());
  pool.deallocate_bulk(again.data(), again.size());
}

// A chunk whose objects were mostly released stays held while a few of its objects live.
// Its free slots are handed out before a new chunk is cut: else each such chunk stays
// pinned while the pool cuts new ones, and a long run's memory creeps up to several times
// what its live objects need (the two-minute producer-consumer test grew 2 -> 8.7 MiB).
TEST(ObjectPool, FreeSlotsOfChunksItHoldsAreHandedOutBeforeANewChunkIsCut) {
  ga::pin_to_current_cpu pinned;
  grace::domain d;
  grace::object_pool pool(64, {}, d);
  constexpr std::size_t kObjects = 20'000;  // ~20 chunks
  constexpr std::size_t kKeepEvery = 100;   // ~10 live objects pin each chunk
  std::vector<void*> objects(kObjects);
  for (void*& p : objects) p = pool.allocate();
  std::vector<void*> kept;
  for (std::size_t i = 0; i < kObjects; ++i) {
    if (i % kKeepEvery == 0) {
      kept.push_back(objects[i]);
    } else {
      pool.deallocate(objects[i]);
    }
  }
  // The idle trim gives what the cache does not keep back to the chunks.
  const std::size_t high = pool.options().high_watermark;
  grace::pool_stats s;
  ASSERT_TRUE(gt::eventually(
      [&] {
        s = pool.stats();
        return s.waiting_for_gp == 0 && s.ready <= caches() * high;
      },
      5s))
      << describe(s);
  const grace::pool_stats pinned_chunks = pool.stats();
  EXPECT_GE(pinned_chunks.chunks, kObjects / 1021) << "every chunk keeps live objects";

  constexpr std::size_t kAgain = 19'000;  // fewer than were released
  std::vector<void*> again(kAgain);
  for (void*& p : again) p = pool.allocate();
  s = pool.stats();
  EXPECT_LE(s.chunks, pinned_chunks.chunks + 1)
      << "new chunks were cut while held ones had free slots: " << describe(s);
  EXPECT_GE(s.reused_from_chunks - pinned_chunks.reused_from_chunks,
            kAgain - caches() * high - pool.options().batch)
      << describe(s);
  for (void* p : again) pool.deallocate(p);
  for (void* p : kept) pool.deallocate(p);
}

// ---------------------------------------------------------------------------------------------
// Allocation failure.

TEST(ObjectPool, AllocateThrowsBadAllocWhenTheSystemHasNoMemory) {
  gt::failing_allocator memory;
  grace::domain d(quiet());
  {
    grace::pool_options options;
    options.allocator = memory.get();
    grace::object_pool pool(64, options, d);
    memory.fail_all(true);
    EXPECT_THROW(pool.allocate(), std::bad_alloc);
    void* objects[10];
    EXPECT_THROW(pool.allocate_bulk(objects, 10), std::bad_alloc);
    grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, 0u);
    EXPECT_EQ(s.held_bytes, 0u);
    memory.fail_all(false);
    void* p = pool.allocate();
    ga::fill_object(p, 64, 1);
    pool.deallocate(p);
    s = pool.stats();
    EXPECT_EQ(s.allocated, 1u);
    EXPECT_EQ(s.deallocated, 1u);
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

TEST(ObjectPool, StaysConsistentWhileEveryAllocationFailsForAWhile) {
  gt::failing_allocator memory;
  grace::domain d(quiet());
  {
    grace::pool_options options = small_magazines();
    options.allocator = memory.get();
    grace::object_pool pool(64, options, d);
    ga::reuse_oracle oracle(d);
    std::vector<void*> held;
    auto allocate = [&] {
      void* p = pool.allocate();
      oracle.on_allocate(p);
      ga::fill_object(p, 64, static_cast<unsigned char>(held.size()));
      held.push_back(p);
    };
    for (int i = 0; i < 500; ++i) allocate();

    memory.fail_all(true);
    // What the pool has cut already is still served; then allocate() throws.
    bool threw = false;
    for (int i = 0; i < 100'000 && !threw; ++i) {
      try {
        allocate();
      } catch (const std::bad_alloc&) {
        threw = true;
      }
    }
    EXPECT_TRUE(threw);
    EXPECT_THROW(pool.allocate(), std::bad_alloc) << "failed once, then succeeded with no memory";
    // Every object still deallocates (magazines cannot be had: the fallback retires them).
    const std::size_t failed_deallocations = held.size() / 2;
    for (std::size_t i = 0; i < failed_deallocations; ++i) {
      ASSERT_TRUE(ga::object_intact(held.back(), 64));
      oracle.on_deallocate(held.back());
      pool.deallocate(held.back());
      held.pop_back();
    }
    EXPECT_GT(memory.failures(), 1u);

    memory.fail_all(false);
    for (int i = 0; i < 2000; ++i) allocate();
    d.synchronize();
    for (int i = 0; i < 2000; ++i) allocate();
    for (void* p : held) {
      ASSERT_TRUE(ga::object_intact(p, 64));
      oracle.on_deallocate(p);
      pool.deallocate(p);
    }
    EXPECT_TRUE(oracle.clean());
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
    // (In debug builds the destructor below aborts if an object was lost.)
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

TEST(ObjectPool, SurvivesTheNthSystemAllocationFailingAtEveryPoint) {
  // A scripted single-threaded workload (single and bulk calls, grace periods between) run
  // once per n with the n-th system allocation failing: each run stays consistent and
  // returns every byte.
  auto workload = [](grace::object_pool& pool, grace::domain& d, std::size_t& bad_allocs) {
    std::vector<void*> held;
    std::unordered_set<void*> live;
    std::vector<void*> bulk(30);
    for (int step = 0; step < 600; ++step) {
      try {
        if (step % 7 == 3) {
          pool.allocate_bulk(bulk.data(), bulk.size());
          for (void* p : bulk) {
            if (!live.insert(p).second) ADD_FAILURE() << "object handed out twice";
            held.push_back(p);
          }
        } else if (step % 3 == 0 && held.size() > 40) {
          const std::size_t n = step % 2 == 0 ? 25 : 1;
          for (std::size_t i = 0; i < n; ++i) live.erase(held[held.size() - 1 - i]);
          pool.deallocate_bulk(held.data() + held.size() - n, n);
          held.resize(held.size() - n);
        } else {
          void* p = pool.allocate();
          if (!live.insert(p).second) ADD_FAILURE() << "object handed out twice";
          held.push_back(p);
        }
      } catch (const std::bad_alloc&) {
        ++bad_allocs;
      }
      if (step % 50 == 49) d.synchronize();
    }
    pool.deallocate_bulk(held.data(), held.size());
  };
  ga::pin_to_current_cpu pin;  // the same cache throughout: runs differ only by the failure
  grace::pool_options options = small_magazines();
  options.caller_gp_threshold = 0;
  std::uint64_t attempts_clean = 0;
  {
    gt::failing_allocator memory;
    grace::domain d(quiet());
    options.allocator = memory.get();
    grace::object_pool pool(200, options, d);
    std::size_t bad_allocs = 0;
    workload(pool, d, bad_allocs);
    ASSERT_EQ(bad_allocs, 0u);
    attempts_clean = memory.attempts();
  }
  std::size_t surfaced = 0;
  std::size_t injected = 0;
  for (std::uint64_t n = 1; n <= attempts_clean; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n) + " fails");
    gt::failing_allocator memory;
    {
      grace::domain d(quiet());
      options.allocator = memory.get();
      grace::object_pool pool(200, options, d);
      memory.fail_nth(n);
      std::size_t bad_allocs = 0;
      workload(pool, d, bad_allocs);
      surfaced += bad_allocs;
      const grace::pool_stats s = pool.stats();
      EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
    }
    EXPECT_LE(memory.failures(), 1u);
    injected += memory.failures();
    EXPECT_EQ(memory.live_allocations(), 0);
    EXPECT_EQ(memory.live_bytes(), 0);
  }
  // A failure changes the run after it, so some of the last n may never be reached; and the
  // idle trim pass runs on the domain's worker on a timer, so how many system allocations a
  // run makes varies a little from run to run (seen: 231 of 258 reached).
  EXPECT_GT(injected, attempts_clean * 3 / 4);
  EXPECT_GT(surfaced, 0u) << "no injected failure surfaced as std::bad_alloc";
}

TEST(ObjectPool, DeallocateNeverThrowsWhenMagazinesCannotBeAllocated) {
  ga::pin_to_current_cpu pin;
  gt::failing_allocator memory;
  grace::domain d(quiet());
  {
    grace::pool_options options = small_magazines();
    options.allocator = memory.get();
    grace::object_pool pool(64, options, d);
    constexpr std::size_t kObjects = 1000;
    std::vector<void*> held(kObjects);
    for (void*& p : held) p = pool.allocate();
    memory.fail_all(true);
    for (void* p : held) pool.deallocate(p);  // noexcept: a throw would terminate
    EXPECT_GT(memory.failures(), 0u);
    grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.deallocated, kObjects) << describe(s);
    // With no magazine to put them in, the objects went back to their chunks through the
    // domain, after a grace period.
    d.barrier();
    s = pool.stats();
    EXPECT_EQ(s.returned_to_system, kObjects) << describe(s);
    memory.fail_all(false);
    pool.allocate_bulk(held.data(), kObjects);
    pool.deallocate_bulk(held.data(), kObjects);
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

// ---------------------------------------------------------------------------------------------
// Allocate on one thread, deallocate on another.

// Flatness bound: held_bytes at the end is at most 1.5 x held_bytes after the first second
// plus 4 MiB (a leak at the producer's pace, ~1M objects/s, would add tens of MiB per second);
// RSS at the end at most RSS after the first second plus 32 MiB (plain builds only: ASan's
// quarantine keeps freed memory resident).
TEST(ObjectPool, MemoryStaysFlatWhenOneThreadAllocatesAndAnotherDeallocates) {
  constexpr std::size_t kBytes = 64;
  const auto run = gt::kSanitized ? 3s : 4s;
  grace::domain d;
  grace::object_pool pool(kBytes, {}, d);
  ga::spsc_ring<4096> queue;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> corrupted{0};
  std::atomic<std::uint64_t> moved{0};
  grace::pool_stats after_warmup;
  grace::pool_stats at_end;
  std::size_t rss_after_warmup = 0;
  std::size_t rss_at_end = 0;
  gt::run_threads(3, [&](unsigned index) {
    if (index == 0) {  // producer
      ga::produce_until(stop, pool, queue, 0);
    } else if (index == 1) {  // consumer
      const ga::consumed c = ga::consume_until(stop, pool, queue);
      // Relaxed (both): tallies, read after the join.
      corrupted.fetch_add(c.corrupted, std::memory_order_relaxed);
      moved.fetch_add(c.objects, std::memory_order_relaxed);
    } else {  // sampler
      std::this_thread::sleep_for(1s);
      after_warmup = pool.stats();
      rss_after_warmup = gt::current_rss_bytes();
      std::this_thread::sleep_for(run - 1s);
      at_end = pool.stats();
      rss_at_end = gt::current_rss_bytes();
      // Release: ends the producer's and consumer's loops; pairs with the Acquire loads in
      // produce_until() and consume_until().
      stop.store(true, std::memory_order_release);
    }
  });
  ga::deallocate_rest(pool, queue);
  // Relaxed: joined.
  EXPECT_EQ(corrupted.load(std::memory_order_relaxed), 0u);
  EXPECT_GT(moved.load(std::memory_order_relaxed), 10'000u) << "the run moved almost nothing";
  EXPECT_GT(at_end.reused_after_gp, after_warmup.reused_after_gp)
      << "the consumer's objects never came back to the producer";
  EXPECT_LE(at_end.held_bytes, after_warmup.held_bytes * 3 / 2 + (std::size_t{4} << 20))
      << "after warm-up: " << describe(after_warmup) << "\nat the end: " << describe(at_end);
  if (!gt::kSanitized) {
    EXPECT_LE(rss_at_end, rss_after_warmup + (std::size_t{32} << 20))
        << "RSS after warm-up " << rss_after_warmup << ", at the end " << rss_at_end;
  }
  const grace::pool_stats s = pool.stats();
  EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
  std::printf("warm-up: %s\nend: %s\nRSS %zu -> %zu\n", describe(after_warmup).c_str(),
              describe(at_end).c_str(), rss_after_warmup, rss_at_end);
}

TEST(ObjectPool, ObjectsFreedOnACpuThatNeverAllocatesAreReusedByTheCpuThatAllocates) {
  // The map's add_del_on_diff_cpu pattern, in lock step: a producer pinned to one CPU
  // allocates a round of objects, a consumer pinned to another CPU (another cache) frees
  // them and waits for a grace period. Once ready, what the consumer freed must reach the
  // producer through the depot, so that after the first rounds the producer cuts nothing
  // fresh. A consumer that kept its ready objects for itself (up to one grace period's worth
  // under the default caller_gp_threshold) made the producer cut ~16k fresh objects first,
  // and the map's add_del_on_diff_cpu cut three in four of its elements fresh.
  const std::array<int, 2> cpus = gt::two_cpus_with_their_own_shards();
  if (cpus[0] < 0) GTEST_SKIP() << "needs two CPUs with different pool caches";
  constexpr int kRounds = 200;
  constexpr int kWarmupRounds = 10;
  constexpr std::size_t kPerRound = 256;
  grace::domain d(quiet());
  grace::object_pool pool(64, {}, d);  // default watermarks and grace-period thresholds
  std::vector<void*> round(kPerRound);
  std::barrier<> step(2);
  std::uint64_t fresh_after_warmup = 0;
  gt::run_threads(2, [&](unsigned index) {
    ASSERT_TRUE(gt::pin_to_cpu(cpus[index]));
    for (int r = 0; r < kRounds; ++r) {
      if (index == 0) {  // producer
        if (r == kWarmupRounds) fresh_after_warmup = pool.stats().fresh;
        for (void*& object : round) object = pool.allocate();
      }
      step.arrive_and_wait();  // the round is allocated
      if (index == 1) {  // consumer
        for (void* object : round) pool.deallocate(object);
        d.synchronize();  // what it freed is ready at its next slow path
      }
      step.arrive_and_wait();  // the round is freed
    }
  });
  const grace::pool_stats s = pool.stats();
  // Fresh cuts after warm-up: at most a magazine or two while a grace period is in flight
  // (the defaults' hold 256 objects of 64 bytes), against 190 rounds x 256 objects
  // allocated meanwhile.
  EXPECT_LE(s.fresh - fresh_after_warmup, 2 * kPerRound) << describe(s);
  EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
}

// ---------------------------------------------------------------------------------------------
// Destruction.

// The default system allocator maps each chunk on its own; the destructor gives adjacent
// chunks back in one munmap() (one TLB shootdown per run, not per chunk). Every chunk must
// still be unmapped, whichever runs they formed: mincore() fails with ENOMEM on a range
// with no mapping.
TEST(ObjectPool, DestroyingUnmapsEveryChunkOfTheDefaultAllocator) {
  grace::domain d(quiet());
  std::set<std::uintptr_t> chunk_addresses;
  {
    grace::object_pool pool(64, {}, d);
    std::vector<void*> objects(64 * 1021);  // ~64 chunks
    for (void*& p : objects) {
      p = pool.allocate();
      chunk_addresses.insert(reinterpret_cast<std::uintptr_t>(p) & ~(kChunkBytes - 1));
    }
    for (void* p : objects) pool.deallocate(p);
  }
  ASSERT_GE(chunk_addresses.size(), 64u);
  std::size_t still_mapped = 0;
  for (const std::uintptr_t chunk : chunk_addresses) {
    unsigned char resident[kChunkBytes / 4096];
    errno = 0;
    if (::mincore(reinterpret_cast<void*>(chunk), kChunkBytes, resident) == 0 ||
        errno != ENOMEM) {
      ++still_mapped;
    }
  }
  EXPECT_EQ(still_mapped, 0u) << "of " << chunk_addresses.size() << " chunks";
}

TEST(ObjectPool, DestroyingWithObjectsStillWaitingForAGracePeriodReturnsEveryByte) {
  // Objects in every stage at once: unsealed, waiting, ready, in the depot, retired by the
  // magazine-less fallback, with the idle trim pass scheduled; the pool is destroyed at once.
  gt::failing_allocator memory;
  grace::domain d;  // the default drain interval: trim passes are pending too
  {
    grace::pool_options options = small_magazines();
    options.allocator = memory.get();
    grace::object_pool pool(64, options, d);
    std::vector<void*> held(20'000);
    pool.allocate_bulk(held.data(), held.size());
    for (std::size_t i = 0; i < 15'000; ++i) {
      pool.deallocate(held[i]);
      if (i % 1000 == 999) d.synchronize();
    }
    memory.fail_all(true);
    for (std::size_t i = 15'000; i < held.size(); ++i) pool.deallocate(held[i]);
    memory.fail_all(false);
    EXPECT_EQ(pool.stats().deallocated, held.size());
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

TEST(ObjectPool, DestructionWaitsForAReaderOfAnObjectWaitingForAGracePeriod) {
  // A reader pinned before the deallocate() still reads the object while the pool is
  // destroyed: the destructor must not release its chunk before the reader has left (under
  // ASan an early release is a heap-use-after-free in the reader).
  grace::domain d;
  auto pool = std::make_unique<grace::object_pool>(64, grace::pool_options{}, d);
  void* object = pool->allocate();
  ga::fill_object(object, 64, 0x3c);
  std::atomic<void*> published{object};
  std::atomic<bool> reading{false};
  std::atomic<bool> reader_left{false};
  std::atomic<std::uint64_t> torn{0};
  std::thread reader([&] {
    {
      auto g = grace::pin();
      // Acquire: the object's bytes; pairs with the initialization before the thread started.
      const void* p = published.load(std::memory_order_acquire);
      // Release: tells the main thread we hold the object; pairs with its Acquire load.
      reading.store(true, std::memory_order_release);
      const auto until = std::chrono::steady_clock::now() + 4 * kHold;
      while (std::chrono::steady_clock::now() < until) {
        if (!ga::object_intact(p, 64) || *static_cast<const volatile unsigned char*>(p) != 0x3c) {
          torn.fetch_add(1, std::memory_order_relaxed);  // Relaxed: read after the join.
        }
      }
      // Release: set before the guard ends; pairs with the Acquire load after destruction.
      reader_left.store(true, std::memory_order_release);
    }
  });
  // Acquire: pairs with the reader's Release store.
  while (!reading.load(std::memory_order_acquire)) std::this_thread::yield();
  published.store(nullptr, std::memory_order_relaxed);  // Relaxed: the reader loaded it.
  pool->deallocate(object);
  {
    gt::watchdog dog(kNoDeadlock, "destroying a pool while a reader is inside");
    pool.reset();
  }
  // Acquire: pairs with the reader's Release store before its guard ended.
  EXPECT_TRUE(reader_left.load(std::memory_order_acquire))
      << "the pool was destroyed while a reader of one of its objects was still inside";
  reader.join();
  EXPECT_EQ(torn.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
}

TEST(ObjectPool, ForgetAllocatedLetsItsOwnerDestroyThePoolWithObjectsStillAllocated) {
  // A container that tears down everything it allocated at once forgets its objects instead
  // of deallocating each: no abort (in any build), and every byte goes back.
  gt::failing_allocator memory;
  {
    grace::domain d;
    grace::pool_options options;
    options.allocator = memory.get();
    grace::object_pool pool(64, options, d);
    std::vector<void*> held(5000);
    pool.allocate_bulk(held.data(), held.size());
    pool.deallocate_bulk(held.data(), 1000);  // some waiting for a grace period too
    pool.forget_allocated();
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}

TEST(ObjectPool, KeepsItsGuaranteeWhenTheDomainHasNoMemoryForRetireBlocks) {
  // The pool retires through its domain (trim passes, magazine-less deallocations). With no
  // memory for retire blocks the domain runs each deleter on the retiring thread after a
  // grace period: trim passes then run synchronously inside the pool's slow paths.
  gt::failing_allocator domain_memory;
  gt::failing_allocator pool_memory;
  {
    grace::domain_options domain_options;
    domain_options.allocator = domain_memory.get();
    grace::domain d(domain_options);
    domain_memory.fail_all(true);
    grace::pool_options options = small_magazines();
    options.allocator = pool_memory.get();
    grace::object_pool pool(64, options, d);
    ga::reuse_oracle oracle(d);
    gt::watchdog dog(kNoDeadlock, "churn with a domain that has no memory");
    const ga::churn_totals totals =
        ga::churn(pool, oracle,
                  {.threads = 2, .operations = gt::iterations(100'000),
                   .guards = ga::guards::never, .max_held = 300});
    // Magazine-less deallocations go through the emergency path too.
    std::vector<void*> held(2000);
    pool.allocate_bulk(held.data(), held.size());
    pool_memory.fail_all(true);
    for (void* p : held) pool.deallocate(p);
    pool_memory.fail_all(false);
    EXPECT_TRUE(oracle.clean());
    EXPECT_EQ(totals.corrupted, 0u);
    EXPECT_GT(d.stats().emergency_frees, 0u);
    EXPECT_GT(oracle.reuses(), 0u);
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
    domain_memory.fail_all(false);
  }
  EXPECT_EQ(pool_memory.live_allocations(), 0);
  EXPECT_EQ(pool_memory.live_bytes(), 0);
  EXPECT_EQ(domain_memory.live_allocations(), 0);
}

// Debug builds only: release builds release the memory instead (the next test).
#ifndef NDEBUG
TEST(ObjectPool, DestroyingWithObjectsStillAllocatedAbortsNamingTheCount) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        grace::domain d;
        auto pool = std::make_unique<grace::object_pool>(64, grace::pool_options{}, d);
        void* a = pool->allocate();
        void* b = pool->allocate();
        void* c = pool->allocate();
        pool->deallocate(b);
        (void)a;
        (void)c;
        pool.reset();
      },
      "2 object\\(s\\) of 64 bytes still allocated");
}
#endif

// Release builds only: debug builds abort instead (the death test above).
#ifdef NDEBUG
TEST(ObjectPool, DestroyingWithObjectsStillAllocatedReleasesTheMemoryInReleaseBuilds) {
  gt::failing_allocator memory;
  {
    grace::domain d;
    grace::pool_options options;
    options.allocator = memory.get();
    grace::object_pool pool(64, options, d);
    std::vector<void*> held(5000);
    pool.allocate_bulk(held.data(), held.size());
    pool.deallocate_bulk(held.data(), held.size() / 2);
  }
  EXPECT_EQ(memory.live_allocations(), 0);
  EXPECT_EQ(memory.live_bytes(), 0);
}
#endif

// A domain destroyed before a pool built on it would leave the pool's destructor and trim
// passes using a destroyed domain: it aborts, in every build, saying what to destroy first.
TEST(ObjectPool, DestroyingTheDomainBeforeAPoolBuiltOnItAbortsSayingSo) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto d = std::make_unique<grace::domain>();
        grace::object_pool pool(64, grace::pool_options{}, *d);
        pool.deallocate(pool.allocate());
        d.reset();
      },
      "grace::domain at 0x[0-9a-f]+ destroyed while 1 object pool\\(s\\) built on it still "
      "exist");
}

TEST(ObjectPool, ADomainOutlivingItsPoolsIsDestroyedWithoutComplaint) {
  auto d = std::make_unique<grace::domain>();
  {
    grace::object_pool first(64, grace::pool_options{}, *d);
    grace::object_pool second(128, grace::pool_options{}, *d);
    first.deallocate(first.allocate());
    second.deallocate(second.allocate());
  }
  d.reset();  // aborts if a pool's count was left behind
}

// ---------------------------------------------------------------------------------------------
// AddressSanitizer: objects in ready magazines are poisoned.

#if GRACE_TESTING_ASAN
// Steers an object into a ready magazine without handing it out: a pool with 4-object
// magazines on a thread pinned to one CPU (one cache) and a quiet domain (no trim pass):
//   1. allocate p0..p3 (one refill of 4 fresh objects; the loaded magazine is now empty);
//   2. deallocate them: they fill the cache's `freed` magazine;
//   3. allocate: nothing is ready, so the slow path seals `freed` (takes its cookie) and
//      cuts 4 fresh objects f0..f3 into the loaded magazine, returning f3;
//   4. synchronize(): the sealed magazine's cookie elapses;
//   5. allocate f2, f1, f0 from the loaded magazine (fast path; it is empty again);
//   6. allocate: the slow path promotes the sealed magazine (poisoning p0..p3), loads it and
//      returns p3. p0, p1 and p2 now wait, poisoned, in the loaded magazine.
// Returns p0 (nullptr and a test failure if the steps did not go as described); `held`
// receives the objects the caller now holds (f0..f3 and p3).
void* steer_into_ready_magazine(grace::object_pool& pool, grace::domain& d,
                                std::vector<void*>& held) {
  void* p[4];
  for (void*& x : p) x = pool.allocate();
  for (void* x : p) pool.deallocate(x);
  void* f[4];
  f[3] = pool.allocate();
  d.synchronize();
  for (int i = 2; i >= 0; --i) f[i] = pool.allocate();
  void* reused = pool.allocate();
  held.assign(std::begin(f), std::end(f));
  held.push_back(reused);
  for (void* x : f) {
    if (x == p[0] || x == p[1] || x == p[2] || x == p[3]) {
      ADD_FAILURE() << "a fresh object was expected";
      return nullptr;
    }
  }
  if (reused != p[3]) {
    ADD_FAILURE() << "the promoted magazine was not loaded as expected";
    return nullptr;
  }
  return p[0];
}

#endif  // GRACE_TESTING_ASAN

// AddressSanitizer builds only (the asan preset).
#if GRACE_TESTING_ASAN
TEST(ObjectPool, AddressSanitizerCatchesAReadOfAnObjectWaitingInAReadyMagazine) {
  // threadsafe: the child re-runs the test from the start in a fresh process (a fork of a
  // process with the domain's threads could inherit a lock held by one of them).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ga::pin_to_current_cpu pin;
  ASSERT_TRUE(pin.pinned());
  grace::domain d(quiet());
  grace::pool_options options;
  options.low_watermark = 4;
  options.high_watermark = 8;
  options.batch = 4;
  options.caller_gp_threshold = 0;
  grace::object_pool pool(64, options, d);
  std::vector<void*> held;
  void* stale = steer_into_ready_magazine(pool, d, held);
  ASSERT_NE(stale, nullptr);
  EXPECT_DEATH(
      {
        const unsigned char byte = *static_cast<const volatile unsigned char*>(stale);
        std::fprintf(stderr, "read %d without a report\n", byte);
      },
      "use-after-poison");
  // Handed out again, the object is readable and writable.
  void* again[3];
  pool.allocate_bulk(again, 3);
  EXPECT_NE(std::find(std::begin(again), std::end(again), stale), std::end(again));
  for (void* x : again) ga::fill_object(x, 64, 7);
  pool.deallocate_bulk(again, 3);
  pool.deallocate_bulk(held.data(), held.size());
}
#endif

TEST(ObjectPool, PackedSmallObjectsStayUsableWhileOtherThreadsPoisonTheirNeighbours) {
  // Objects whose stride is not a multiple of 8 share AddressSanitizer shadow bytes with
  // their neighbours. Two threads on two CPUs (two caches) allocate, write, swap and
  // deallocate such objects at full speed, so one thread unpoisons an object it allocates
  // while the other poisons or unpoisons the object next to it. Under ASan a lost shadow
  // update shows as a use-after-poison (or "unknown-crash") on a write to an object just
  // allocated: the test dies. In every build the bytes are checked.
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs two CPUs";
  struct shape {
    std::size_t size;
    std::size_t alignment;
  };
  for (const shape sh : {shape{4, 4}, shape{12, 4}, shape{6, 2}}) {
    SCOPED_TRACE("object_size " + std::to_string(sh.size) + ", alignment " +
                 std::to_string(sh.alignment));
    grace::domain d;
    grace::pool_options options = small_magazines();
    options.alignment = sh.alignment;
    grace::object_pool pool(sh.size, options, d);
    constexpr std::size_t kSlots = 256;
    std::array<std::atomic<void*>, kSlots> slots{};
    std::atomic<std::uint64_t> corrupted{0};
    const std::size_t rounds = gt::iterations(400'000);
    const auto deadline = std::chrono::steady_clock::now() + 1s;
    gt::run_threads(2, [&](unsigned index) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(index, &one);
      ::pthread_setaffinity_np(::pthread_self(), sizeof(one), &one);  // best effort
      ga::random_source random(index + 5);
      std::vector<void*> batch;
      std::uint64_t bad = 0;
      for (std::size_t r = 0; r < rounds; ++r) {
        if (r % 1024 == 0 && std::chrono::steady_clock::now() > deadline) break;
        for (int i = 0; i < 64; ++i) {
          void* p = pool.allocate();
          ga::fill_object(p, sh.size, static_cast<unsigned char>(r + i));
          batch.push_back(p);
        }
        for (void*& p : batch) {
          // AcqRel: Release hands our bytes to the thread that takes the object; Acquire
          // takes the previous occupant with its bytes; pairs with this same exchange.
          p = slots[random.below(kSlots)].exchange(p, std::memory_order_acq_rel);
        }
        for (void* p : batch) {
          if (p == nullptr) continue;
          bad += !ga::object_intact(p, sh.size);
          pool.deallocate(p);
        }
        batch.clear();
      }
      corrupted.fetch_add(bad, std::memory_order_relaxed);  // Relaxed: read after the join.
    });
    for (std::atomic<void*>& slot : slots) {
      // Acquire: pairs with the AcqRel exchange that parked the object (the join also orders).
      if (void* p = slot.exchange(nullptr, std::memory_order_acquire)) pool.deallocate(p);
    }
    EXPECT_EQ(corrupted.load(std::memory_order_relaxed), 0u);  // Relaxed: joined.
    const grace::pool_stats s = pool.stats();
    EXPECT_EQ(s.allocated, s.deallocated) << describe(s);
    EXPECT_GT(s.reused_after_gp, 0u) << describe(s);
  }
}

TEST(ObjectPool, ObjectsWaitingForAGracePeriodAreNotPoisoned) {
  // Readers may legally read an object until its grace period ends: the pool must not
  // poison (or otherwise touch) it while it waits. Under ASan a poisoned read dies here.
  grace::domain d(quiet());
  grace::object_pool pool(64, small_magazines(), d);
  std::vector<void*> objects(500);
  pool.allocate_bulk(objects.data(), objects.size());
  for (std::size_t i = 0; i < objects.size(); ++i) {
    ga::fill_object(objects[i], 64, static_cast<unsigned char>(i));
  }
  {
    auto g = grace::pin();  // a reader from before the deallocations
    for (void* p : objects) pool.deallocate(p);
    std::vector<void*> churn(2000);
    pool.allocate_bulk(churn.data(), churn.size());  // slow paths seal and try to promote
    pool.deallocate_bulk(churn.data(), churn.size());
    for (std::size_t i = 0; i < objects.size(); ++i) {
      ASSERT_TRUE(ga::object_intact(objects[i], 64)) << "object " << i;
      ASSERT_EQ(*static_cast<const unsigned char*>(objects[i]), static_cast<unsigned char>(i));
    }
  }
}

}  // namespace
