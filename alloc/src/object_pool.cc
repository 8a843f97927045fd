// grace::object_pool: construction, destruction and the slow paths.
#include "grace/alloc/object_pool.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "grace/reclaim/detail/fork.h"

namespace grace::detail {

// Every chunk is kChunkBytes, aligned to kChunkBytes, so an object finds its chunk (and so
// its pool) by masking its address: the retire() deleters need nothing but the object.
inline constexpr std::size_t kChunkBytes = std::size_t{64} << 10;
// The header; the chunk's free-slot bitmap follows it, then its objects.
inline constexpr std::size_t kChunkHeaderBytes = 64;
// A released object may carry a link in its first word (P6): no slot is smaller.
inline constexpr std::size_t kMinStride = sizeof(void*);
// The largest poolable object: a quarter of a chunk's bytes past the header (3 objects a
// chunk at the largest sizes, once the bitmap and the alignment take their share).
inline constexpr std::size_t kMaxObjectSize = (kChunkBytes - kChunkHeaderBytes) / 4;
static_assert(kMaxObjectSize == object_pool::max_object_size);
// Passes of unlock_chunks() over what other threads deferred before it leaves the rest to
// the next holder or the idle trim: a holder does a bounded amount of other threads' work.
inline constexpr unsigned kDeferredPasses = 4;
// The chunk lock's value while held: the fork generation it was taken under, tagged.
inline constexpr std::uint32_t kGenerationMask = 0x7fffffff;

constinit std::atomic<void (*)()> chunk_lock_held_hook{nullptr};
// The depot holds kDepotBatchesPerCache batches of objects per cache, in as many magazines
// as that takes (rounded up), and at least kMinDepotSlotsPerCache magazines: with the default
// magazines of 64-byte objects, 3 slots of 256 for 768 objects.
inline constexpr std::size_t kDepotBatchesPerCache = 16;
inline constexpr std::size_t kMinDepotSlotsPerCache = 2;
constexpr unsigned depot_slots_per_cache(std::size_t batch, std::size_t magazine_capacity) {
  return static_cast<unsigned>(
      std::max(kMinDepotSlotsPerCache,
               (kDepotBatchesPerCache * batch + magazine_capacity - 1) / magazine_capacity));
}
// pool_options::magazine_capacity's default holds this many bytes of objects (by stride).
inline constexpr std::size_t kDefaultMagazineObjectBytes = 16 * 1024;
inline constexpr std::size_t kMaxMagazineCapacity = 4096;
// Magazines a cache fills in a row without allocating before it counts as a consumer.
inline constexpr std::uint32_t kConsumerMagazines = 4;
// The idle trim runs at most this often (and after a grace period).
inline constexpr std::chrono::milliseconds kTrimInterval{20};
// Trim passes in a row that find a cache idle before it gives back every ready object.
inline constexpr std::uint32_t kIdlePassesBeforeEmptying = 2;
// Chunks with no object in use a pool keeps for its next refill instead of freeing them at
// once (P5): a pool whose objects cycle between CPUs (one inserts, another erases) empties
// and cuts chunks hundreds of times a second, each a fresh mapping with its page faults and,
// once freed, an munmap() that shoots down the other CPUs' TLBs. 1 MiB at most, and the idle
// trim frees those no refill took for a whole pass, at its next pass.
inline constexpr std::uint32_t kRetainedChunks = 16;
inline constexpr unsigned kEmptyMagazinesPerCache = 2;
// destroy_deallocated() in a fork() child: yields before it skips a cache of a pool built
// during the fork that stays held (pool_core::fork_skip).
inline constexpr unsigned kForkSkippedHoldTries = 1000;
// How many times stats() yields to the holder of a cache it would settle.
inline constexpr unsigned kStatsHoldTries = 64;
// Constructed magazines one hold takes out to destroy (P7), bounding the destructors one
// take runs: up to 2 x magazine_capacity (by default a magazine holds 16 KiB of objects,
// 186 map elements of 88 bytes). Two keep up with a thread that frees an object per
// allocation.
inline constexpr std::uint32_t kMagazinesPerTake = 2;

// A record of one chunk, kept for the pool's lifetime so destruction can find chunks that
// still hold allocated objects. Records of released chunks are reused.
struct chunk_record {
  chunk_record* next_all = nullptr;   // immutable once pushed onto records_
  chunk_record* next_free = nullptr;  // written by the owner before a push onto free_records_
  std::atomic<chunk*> live{nullptr};  // (A6)
};

struct chunk {
  pool_core* const core;
  chunk_record* const record;
  const std::uint32_t capacity;
  // (P5): the rest, and the bitmap, change only under the pool's chunk lock.
  std::uint32_t free_slots = 0;  // bits set in the bitmap
  chunk* partial_prev = nullptr;  // the pool's list of chunks with free slots
  chunk* partial_next = nullptr;  // ... and, once all its slots are free, the retained lists
                                  // or the holder's list
  // (P6): on the deferred chunk stack, the slots [uncarved_from, capacity) wait to be freed.
  chunk* deferred_next = nullptr;
  std::uint32_t uncarved_from = 0;

  chunk(pool_core* owner, chunk_record* chunk_record_, std::uint32_t objects) noexcept
      : core(owner), record(chunk_record_), capacity(objects) {}

  // One bit per slot, set while the slot is free.
  std::uint64_t* free_bits() noexcept {
    return reinterpret_cast<std::uint64_t*>(reinterpret_cast<char*>(this) + kChunkHeaderBytes);
  }
};
static_assert(sizeof(chunk) <= kChunkHeaderBytes);

// Where a chunk's objects start and how many fit behind the header and their bitmap.
struct chunk_layout {
  std::size_t first_offset;
  std::uint32_t capacity;
  std::uint32_t bitmap_words;
};

constexpr std::size_t round_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}

// The distance between neighbouring objects in a chunk.
constexpr std::size_t object_stride(std::size_t object_size, std::size_t alignment) {
  return round_up(std::max(object_size, kMinStride), alignment);
}

constexpr chunk_layout layout_chunks(std::size_t stride, std::size_t alignment) {
  std::size_t capacity = (kChunkBytes - kChunkHeaderBytes) / stride;
  for (;;) {
    const std::size_t words = (capacity + 63) / 64;
    const std::size_t offset = round_up(kChunkHeaderBytes + words * 8, alignment);
    const std::size_t fits = (kChunkBytes - offset) / stride;
    if (fits >= capacity) {
      return {offset, static_cast<std::uint32_t>(capacity), static_cast<std::uint32_t>(words)};
    }
    capacity = fits;
  }
}

struct pool_core {
  object_pool& pool;
  domain& reclamation;
  const std::size_t stride;
  // ceil(2^32 / stride): an object's offset in its chunk times this, >> 32, is its slot
  // (exact: offsets and strides are below 2^16).
  const std::uint64_t slot_reciprocal;
  const std::size_t first_offset;
  const std::uint32_t objects_per_chunk;
  const std::uint32_t bitmap_words;
  const std::uint32_t batch;              // objects a refill puts into a magazine
  const std::uint32_t magazine_capacity;  // >= batch
  const std::uint64_t low;
  const std::uint64_t high;
  // Ready objects a cache that allocates may hold: the high watermark plus what one grace
  // period releases at once (what waits for it, and the magazine being filled). Above it the
  // hot paths shed (a cache that only frees sheds above `high`, to the depot); the idle trim
  // goes down to the watermarks, then to nothing.
  const std::uint64_t busy_high;
  const std::uint64_t gp_request_threshold;
  const std::uint64_t caller_gp_threshold;
  const unsigned depot_slots;
  std::unique_ptr<std::atomic<magazine*>[]> depot;  // (P4)

  std::atomic<chunk_record*> records{nullptr};       // push-only
  std::atomic<chunk_record*> free_records{nullptr};  // push-chain / take-all: no ABA
  // (P5): the chunk lock, only ever tried: 0, or (fork generation << 1) | 1 while held.
  std::atomic<std::uint32_t> chunk_lock{0};
  chunk* partial_head = nullptr;  // chunks with free slots, most recently partial first
  chunk* emptied = nullptr;       // chunks whose slots are all free: freed after the unlock
  // Chunks whose slots are all free, kept for reuse (kRetainedChunks in all): emptied since
  // the last trim pass, and before it. Each pass frees the older list and ages the newer.
  chunk* retained = nullptr;
  chunk* retained_old = nullptr;
  // Relaxed: written under the lock, read without it as a hint that partial_head is set.
  std::atomic<std::uint64_t> partial_chunks{0};
  // Relaxed: the length of both retained lists, written under the lock, read without it as
  // a hint that one is set.
  std::atomic<std::uint32_t> retained_chunks{0};
  // (P6): what was released while another thread held the chunk lock: objects, and chunks'
  // uncarved tails.
  std::atomic<void*> deferred_objects{nullptr};
  std::atomic<chunk*> deferred_chunks{nullptr};
  // 0, or set: generation_tag() of the process that set it. One left set by a fork()'s copy
  // (a pass that was never queued, or ran on a thread absent here) counts as clear.
  std::atomic<std::uint32_t> trim_scheduled{0};
  std::atomic<std::uint32_t> trim_running{0};
  // The list of live pools that fork() holds every cache of (see "fork()" below); guarded
  // by pools_mutex.
  pool_core* fork_prev = nullptr;
  pool_core* fork_next = nullptr;
  // In a fork child: constructed between the fork's hold and the copy, so a cache of it may
  // be held by a thread the child does not have. Later forks neither hold nor release it
  // (holding would wait for ever); it keeps the all-caches-held fallback for such caches.
  bool fork_skip = false;
  // fork()'s hooks (see "fork()" below), and the list they walk.
  static void add_for_fork(pool_core& core) noexcept;
  static void remove_for_fork(pool_core& core) noexcept;
  static void hold_every_cache() noexcept;
  static void release_every_cache() noexcept;
  static void release_every_cache_in_parent() noexcept;
  static void release_every_cache_in_child() noexcept;
  // (P7): the takes the caches' finishing slots record were made by threads of the parent
  // (or, by this one, end under the parent's generation and leave the slot alone). Their
  // magazines are lost to the child, so its ~object_pool() finds their objects neither free
  // nor in a magazine: not a usage error there.
  void forget_finishing_in_child() noexcept {
    for (unsigned i = 0; i <= pool.cache_mask_; ++i) {
      for (auto& slot : pool.caches_[i].finishing) {
        // Relaxed: the child's only thread.
        if (slot.load(std::memory_order_relaxed) % 2 != 0) {
          forget_allocated.store(true, std::memory_order_relaxed);
        }
        slot.store(0, std::memory_order_relaxed);
      }
    }
  }
  std::atomic<bool> destroying{false};
  std::atomic<bool> forget_allocated{false};
  // Relaxed: the trim pass compares it between passes to tell whether the depot is in use.
  std::atomic<std::uint64_t> depot_takes{0};
  // The trim pass's memory. Passes normally run one at a time (trim_scheduled), but one may
  // run synchronously inside retire() on the emergency path while another runs on the
  // worker. Relaxed: hints for the next pass.
  std::atomic<std::uint64_t> depot_takes_at_last_trim{0};
  std::atomic<std::chrono::steady_clock::rep> last_trim{0};

  // Relaxed: statistics.
  std::atomic<std::uint64_t> held_bytes{0};
  std::atomic<std::uint64_t> peak_held_bytes{0};
  std::atomic<std::uint64_t> chunks{0};
  std::atomic<std::uint64_t> returned{0};
  std::atomic<std::uint64_t> destroyed{0};
  std::atomic<std::uint64_t> unheld_allocations{0};
  std::atomic<std::uint64_t> fresh_unheld{0};
  std::atomic<std::uint64_t> reused_unheld{0};
  std::atomic<std::uint64_t> unheld_deallocations{0};

  pool_core(object_pool& owner, std::size_t object_stride, const chunk_layout& layout,
            std::uint32_t magazine_batch, std::uint32_t capacity, std::uint64_t low_mark,
            std::uint64_t high_mark, std::uint64_t request_threshold,
            std::uint64_t caller_threshold, unsigned slots)
      : pool(owner),
        reclamation(*owner.domain_),
        stride(object_stride),
        slot_reciprocal(((std::uint64_t{1} << 32) + object_stride - 1) / object_stride),
        first_offset(layout.first_offset),
        objects_per_chunk(layout.capacity),
        bitmap_words(layout.bitmap_words),
        batch(magazine_batch),
        magazine_capacity(capacity),
        low(low_mark),
        high(high_mark),
        busy_high(high_mark + std::max(request_threshold, caller_threshold) + capacity),
        gp_request_threshold(request_threshold),
        caller_gp_threshold(caller_threshold),
        depot_slots(slots),
        depot(std::make_unique<std::atomic<magazine*>[]>(slots)) {}

  const system_allocator& allocator() const noexcept { return pool.options_.allocator; }

  static chunk* chunk_of(void* object) noexcept {
    return reinterpret_cast<chunk*>(reinterpret_cast<std::uintptr_t>(object) &
                                    ~(kChunkBytes - 1));
  }
  void* object_at(chunk* c, std::uint32_t index) const noexcept {
    return reinterpret_cast<char*>(c) + first_offset + index * stride;
  }

  // --- chunks -------------------------------------------------------------------------------

  chunk_record* take_record() noexcept {
    // Acquire: the records' next_free links written before their push; pairs with the
    // Release CAS in give_records().
    chunk_record* list = free_records.exchange(nullptr, std::memory_order_acquire);
    if (list != nullptr) {
      if (list->next_free != nullptr) give_records(list->next_free);
      return list;
    }
    void* memory = allocator().allocate(sizeof(chunk_record), alignof(chunk_record),
                                        allocator().context);
    if (memory == nullptr) return nullptr;
    auto* record = new (memory) chunk_record();
    chunk_record* head = records.load(std::memory_order_relaxed);
    do {
      record->next_all = head;
      // Release: next_all is visible to the destructor's walk (which runs after every
      // thread is done, so this only orders the link itself).
    } while (!records.compare_exchange_weak(head, record, std::memory_order_release,
                                            std::memory_order_relaxed));
    return record;
  }

  void give_records(chunk_record* first) noexcept {
    chunk_record* last = first;
    while (last->next_free != nullptr) last = last->next_free;
    chunk_record* head = free_records.load(std::memory_order_relaxed);
    do {
      last->next_free = head;
      // Release: the chain's links are visible to the taker; pairs with take_record().
    } while (!free_records.compare_exchange_weak(head, first, std::memory_order_release,
                                                 std::memory_order_relaxed));
  }

  // A chunk with every slot uncarved: a retained one (P5) if the lock is free, else one from
  // the system.
  chunk* new_chunk() noexcept {
    // Relaxed: a hint; the lock decides.
    if (retained_chunks.load(std::memory_order_relaxed) != 0 && try_lock_chunks()) {
      chunk* c = take_retained();
      unlock_chunks();
      if (c != nullptr) {
        asan_unpoison(c, kChunkBytes);  // its free slots were poisoned: as new from here on
        return c;
      }
    }
    chunk_record* record = take_record();
    if (record == nullptr) return nullptr;
    void* memory = allocator().allocate(kChunkBytes, kChunkBytes, allocator().context);
    if (memory == nullptr) {
      record->next_free = nullptr;
      give_records(record);
      return nullptr;
    }
    auto* c = new (memory) chunk(this, record, objects_per_chunk);
    std::memset(c->free_bits(), 0, bitmap_words * sizeof(std::uint64_t));
    // Release (A6): the header and the cleared bitmap come before the record names the
    // chunk; pairs with the Acquire load in repair_chunks_after_fork().
    record->live.store(c, std::memory_order_release);
    chunks.fetch_add(1, std::memory_order_relaxed);
    const std::uint64_t held =
        held_bytes.fetch_add(kChunkBytes, std::memory_order_relaxed) + kChunkBytes;
    std::uint64_t peak = peak_held_bytes.load(std::memory_order_relaxed);
    // Relaxed: a statistic.
    while (peak < held &&
           !peak_held_bytes.compare_exchange_weak(peak, held, std::memory_order_relaxed)) {
    }
    return c;
  }

  // Gives back the memory of chunks freed in a row, a run of adjacent ones in one call where
  // the allocator takes them so: the default system_allocator maps each chunk on its own and
  // takes back adjacent mappings with one munmap(), and each munmap() shoots down the TLB of
  // every other CPU the process runs on (destroying a map of 10M elements gave back ~14,000
  // chunks: 780 ms of munmap() one by one on a 2-CPU VM, 51 ms in runs). The destructor's
  // walk over `records` (newest first) meets long runs: the kernel places each new mapping
  // right below the previous one. A hold of the chunk lock mostly empties one chunk.
  class chunk_releaser {
   public:
    explicit chunk_releaser(const system_allocator& allocator) noexcept
        : allocator_(allocator),
          in_runs_(allocator.deallocate == &system_allocator::malloc_deallocate) {}
    chunk_releaser(const chunk_releaser&) = delete;
    chunk_releaser& operator=(const chunk_releaser&) = delete;
    ~chunk_releaser() { flush(); }

    void release(chunk* c) noexcept {
      char* const memory = reinterpret_cast<char*>(c);
      if (in_runs_ && run_ != nullptr) {
        if (memory == run_ + run_bytes_) {
          run_bytes_ += kChunkBytes;
          return;
        }
        if (memory + kChunkBytes == run_) {
          run_ = memory;
          run_bytes_ += kChunkBytes;
          return;
        }
      }
      flush();
      run_ = memory;
      run_bytes_ = kChunkBytes;
    }

   private:
    void flush() noexcept {
      if (run_ != nullptr) allocator_.deallocate(run_, run_bytes_, allocator_.context);
      run_ = nullptr;
    }

    const system_allocator& allocator_;
    const bool in_runs_;
    char* run_ = nullptr;
    std::size_t run_bytes_ = 0;
  };

  void free_chunk(chunk* c, chunk_releaser& releaser) noexcept {
    chunk_record* record = c->record;
    // Relaxed: as in new_chunk().
    record->live.store(nullptr, std::memory_order_relaxed);
    record->next_free = nullptr;
    give_records(record);
    chunks.fetch_sub(1, std::memory_order_relaxed);
    held_bytes.fetch_sub(kChunkBytes, std::memory_order_relaxed);
    asan_unpoison(c, kChunkBytes);
    c->~chunk();
    releaser.release(c);
  }

  // --- the chunk lock (P5) and deferred releases (P6) ----------------------------------------

  bool try_lock_chunks() noexcept {
    const std::uint32_t generation = process_fork_generation() & kGenerationMask;
    const std::uint32_t mine = tag_of(generation);
    // SeqCst (Dekker, A5): after a push onto a deferred stack, either this load sees the
    // holder's unlock, or the holder's look at the stacks after that unlock sees the push.
    std::uint32_t seen = chunk_lock.load(std::memory_order_seq_cst);
    // Held under an older fork generation (by a thread of a parent, absent here), it is
    // taken over; held under this one (or, from a stale reading, a newer one), it is busy.
    const std::uint32_t age = (generation - (seen >> 1)) & kGenerationMask;
    if (seen != 0 && (age == 0 || age > kGenerationMask / 2)) return false;
    // Acquire (A5): the previous holder's changes to bitmaps and the partial list; pairs
    // with the store in unlock_chunks().
    if (!chunk_lock.compare_exchange_strong(seen, mine, std::memory_order_acquire,
                                            std::memory_order_relaxed)) {
      return false;
    }
    if (seen != 0) repair_chunks_after_fork();
    return true;
  }

  // Releases what other threads deferred to the holder (P6), then the lock, then frees the
  // chunks on `emptied` (P5). Ends with the deferred stacks empty or another holder
  // in charge of them, except after kDeferredPasses: the rest then waits for the next holder,
  // and the callers' anything_deferred() checks schedule the idle trim for it once they hold
  // no cache.
  void unlock_chunks() noexcept {
    for (unsigned pass = 1;; ++pass) {
      free_deferred();
      chunk* to_free = std::exchange(emptied, nullptr);
      // Relaxed: see its declaration.
      if (auto hook = chunk_lock_held_hook.load(std::memory_order_relaxed)) hook();
      // SeqCst (A5): this hold's changes reach the next holder (pairs with the Acquire CAS
      // in try_lock_chunks()), and the Dekker pair with a pusher (see there).
      chunk_lock.store(0, std::memory_order_seq_cst);
      chunk_releaser releaser(allocator());
      while (to_free != nullptr) {
        chunk* next = to_free->partial_next;
        free_chunk(to_free, releaser);
        to_free = next;
      }
      if (!anything_deferred() || pass == kDeferredPasses || !try_lock_chunks()) return;
    }
  }

  bool anything_deferred() const noexcept {
    // SeqCst: the holder's side of the Dekker pair (see try_lock_chunks()).
    return deferred_objects.load(std::memory_order_seq_cst) != nullptr ||
           deferred_chunks.load(std::memory_order_seq_cst) != nullptr;
  }

  // Lock held: frees the slots on both deferred stacks.
  void free_deferred() noexcept {
    // Acquire (A5): the links written before each push; pairs with the SeqCst CAS in
    // defer_object() and release_uncarved().
    void* object = deferred_objects.exchange(nullptr, std::memory_order_acquire);
    while (object != nullptr) {
      void* next;
      std::memcpy(&next, object, sizeof next);
      free_slot(object);
      object = next;
    }
    // Acquire (A5): as above.
    chunk* c = deferred_chunks.exchange(nullptr, std::memory_order_acquire);
    while (c != nullptr) {
      chunk* next = c->deferred_next;
      free_uncarved(c, c->uncarved_from);
      c = next;
    }
  }

  // (P6): `object` (free, its grace period over) waits on the deferred stack for the holder.
  void defer_object(void* object) noexcept {
    asan_unpoison(object, pool.object_size_);
    void* head = deferred_objects.load(std::memory_order_relaxed);
    do {
      std::memcpy(object, &head, sizeof head);
      // SeqCst (A5): the link reaches the holder that takes the stack (pairs with the
      // Acquire exchange in free_deferred()), and the pusher's side of the Dekker pair.
    } while (!deferred_objects.compare_exchange_weak(head, object, std::memory_order_seq_cst,
                                                     std::memory_order_relaxed));
  }

  // Frees what was deferred, unless a holder is in charge of it: after a push, and where
  // a holder may have left something (the trim, the destructor).
  void drain_deferred() noexcept {
    if (try_lock_chunks()) unlock_chunks();
  }

  // Releases objects to their chunks: `for_each(release)` calls release(object) on each. The
  // objects will not be used again until a chunk hands them out. Never waits: with the lock
  // held elsewhere, they are deferred to its holder (P6).
  template <class ForEach>
  void release_to_chunks(ForEach for_each) noexcept {
    if (try_lock_chunks()) {
      for_each([this](void* object) { free_slot(object); });
      unlock_chunks();
    } else {
      for_each([this](void* object) { defer_object(object); });
      drain_deferred();
    }
  }

  // The slots [first, capacity) of `c` were never handed out: they are free.
  void release_uncarved(chunk* c, std::uint32_t first) noexcept {
    if (try_lock_chunks()) {
      free_uncarved(c, first);
      unlock_chunks();
      return;
    }
    // (P6): those slots are not free yet, so nobody frees `c` while it waits on the stack.
    c->uncarved_from = first;
    chunk* head = deferred_chunks.load(std::memory_order_relaxed);
    do {
      c->deferred_next = head;
      // SeqCst (A5): uncarved_from and the link reach the holder (pairs with the Acquire
      // exchange in free_deferred()), and the Dekker pair, as in defer_object().
    } while (!deferred_chunks.compare_exchange_weak(head, c, std::memory_order_seq_cst,
                                                    std::memory_order_relaxed));
    drain_deferred();
  }

  [[noreturn]] static void die_on_bad_release(void* object, const char* what) noexcept {
    std::fprintf(stderr,
                 "grace::object_pool: object %p %s (found when its slot was freed, perhaps on "
                 "another thread than the deallocating one).\n",
                 object, what);
    std::abort();
  }

  // (P5), lock held: `object`'s slot is free.
  void free_slot(void* object) noexcept {
    chunk* c = chunk_of(object);
    if (c->core != this) die_on_bad_release(object, "was deallocated to a pool it is not from");
    const auto offset = static_cast<std::uint64_t>(static_cast<char*>(object) -
                                                   reinterpret_cast<char*>(c)) -
                        first_offset;
    const auto slot = static_cast<std::uint32_t>((offset * slot_reciprocal) >> 32);
    // Unsigned: an address before the first object wraps to a huge offset.
    if (offset >= std::uint64_t{c->capacity} * stride || slot * stride != offset) {
      die_on_bad_release(object, "is not an object of this pool (not the start of a slot)");
    }
    std::uint64_t& word = c->free_bits()[slot / 64];
    const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
    if ((word & bit) != 0) die_on_bad_release(object, "was deallocated twice");
    asan_poison(object, pool.object_size_);
    word |= bit;
    slots_freed(c, 1);
  }

  // Lock held: frees the slots [first, capacity) of `c`, a word at a time.
  void free_uncarved(chunk* c, std::uint32_t first) noexcept {
    std::uint64_t* bits = c->free_bits();
    for (std::uint32_t slot = first; slot < c->capacity;) {
      const std::uint32_t in_word = std::min<std::uint32_t>(64 - slot % 64, c->capacity - slot);
      const std::uint64_t mask =
          (in_word == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << in_word) - 1) << (slot % 64);
      if ((bits[slot / 64] & mask) != 0) {
        die_on_bad_release(object_at(c, slot), "was released before it was ever handed out");
      }
      bits[slot / 64] |= mask;
      slot += in_word;
    }
    slots_freed(c, c->capacity - first);
  }

  // Lock held: `count` more slots of `c` are free. A chunk with no slot in use leaves the
  // partial list, to be kept for reuse or freed (retain_or_free()).
  void slots_freed(chunk* c, std::uint32_t count) noexcept {
    if (count == 0) return;
    const bool was_full = c->free_slots == 0;
    c->free_slots += count;
    if (was_full) link_partial(c);
    if (c->free_slots == c->capacity) {
      unlink_partial(c);
      retain_or_free(c);
    }
  }

  // Lock held: `c` has no slot in use. Kept for reuse while fewer than kRetainedChunks are,
  // otherwise freed by the holder after unlocking.
  void retain_or_free(chunk* c) noexcept {
    const std::uint32_t kept = retained_chunks.load(std::memory_order_relaxed);
    if (kept < kRetainedChunks) {
      c->partial_next = retained;
      retained = c;
      retained_chunks.store(kept + 1, std::memory_order_relaxed);
    } else {
      c->partial_next = emptied;
      emptied = c;
    }
  }

  // Lock held: a retained chunk, the most recently emptied first, made uncarved again (its
  // bitmap cleared, as new_chunk() clears a new one's); nullptr if none.
  chunk* take_retained() noexcept {
    chunk*& list = retained != nullptr ? retained : retained_old;
    chunk* c = list;
    if (c == nullptr) return nullptr;
    list = c->partial_next;
    retained_chunks.store(retained_chunks.load(std::memory_order_relaxed) - 1,
                          std::memory_order_relaxed);
    std::memset(c->free_bits(), 0, bitmap_words * sizeof(std::uint64_t));
    c->free_slots = 0;
    c->partial_next = nullptr;
    return c;
  }

  // Lock held, by the idle trim: the chunks retained since before the last pass go to
  // `emptied` (freed after the unlock); the rest age by one pass.
  void age_retained() noexcept {
    std::uint32_t freed = 0;
    while (chunk* c = retained_old) {
      retained_old = c->partial_next;
      c->partial_next = emptied;
      emptied = c;
      ++freed;
    }
    retained_old = std::exchange(retained, nullptr);
    retained_chunks.store(retained_chunks.load(std::memory_order_relaxed) - freed,
                          std::memory_order_relaxed);
  }

  void link_partial(chunk* c) noexcept {
    c->partial_prev = nullptr;
    c->partial_next = partial_head;
    if (partial_head != nullptr) partial_head->partial_prev = c;
    partial_head = c;
    partial_chunks.store(partial_chunks.load(std::memory_order_relaxed) + 1,
                         std::memory_order_relaxed);
  }

  void unlink_partial(chunk* c) noexcept {
    (c->partial_prev != nullptr ? c->partial_prev->partial_next : partial_head) =
        c->partial_next;
    if (c->partial_next != nullptr) c->partial_next->partial_prev = c->partial_prev;
    partial_chunks.store(partial_chunks.load(std::memory_order_relaxed) - 1,
                         std::memory_order_relaxed);
  }

  // Calls take() with the chunk lock held, if some chunk has free slots and the lock is free.
  template <class Take>
  void take_from_partial_chunks(Take take) noexcept {
    // Relaxed: a hint; the lock decides.
    if (partial_chunks.load(std::memory_order_relaxed) != 0 && try_lock_chunks()) {
      take();
      unlock_chunks();
    }
  }

  // (P5), lock held: moves up to `want` free slots of partial chunks into `out`, emptying the
  // chunk that became partial last first. Returns how many (the objects stay poisoned).
  std::uint32_t take_free_slots(void** out, std::uint32_t want) noexcept {
    std::uint32_t taken = 0;
    while (taken < want && partial_head != nullptr) {
      chunk* c = partial_head;
      std::uint64_t* bits = c->free_bits();
      for (std::uint32_t w = 0; w < bitmap_words && taken < want && c->free_slots != 0; ++w) {
        while (bits[w] != 0 && taken < want) {
          const auto bit = static_cast<std::uint32_t>(std::countr_zero(bits[w]));
          bits[w] &= bits[w] - 1;
          out[taken++] = object_at(c, w * 64 + bit);
          --c->free_slots;
        }
      }
      if (c->free_slots != 0 && taken < want) {
        std::fprintf(stderr,
                     "grace::object_pool: chunk %p counts more free slots than its bitmap "
                     "holds: memory was corrupted.\n",
                     static_cast<void*>(c));
        std::abort();
      }
      if (c->free_slots == 0) unlink_partial(c);
    }
    return taken;
  }

  // Lock taken over from a thread of the parent (fork() copied it held). That thread may
  // have stopped anywhere under the lock: rebuild free_slots and the lists from the bitmaps,
  // which each change one word at a time. What it had in hand (slots it took, a deferred
  // stack it had taken) is lost to this process; nothing is handed out twice.
  [[gnu::cold]] void repair_chunks_after_fork() noexcept {
    partial_head = nullptr;
    emptied = nullptr;
    retained = nullptr;
    retained_old = nullptr;
    partial_chunks.store(0, std::memory_order_relaxed);
    retained_chunks.store(0, std::memory_order_relaxed);
    // Acquire: records pushed by the parent's threads; pairs with take_record()'s CAS.
    for (chunk_record* r = records.load(std::memory_order_acquire); r != nullptr;
         r = r->next_all) {
      // Acquire (A6): the chunk's header and bitmap; pairs with new_chunk()'s store.
      chunk* c = r->live.load(std::memory_order_acquire);
      if (c == nullptr) continue;
      c->free_slots = 0;
      std::uint32_t free = 0;
      for (std::uint32_t w = 0; w < bitmap_words; ++w) {
        free += static_cast<std::uint32_t>(std::popcount(c->free_bits()[w]));
      }
      slots_freed(c, free);
    }
  }

  // retire() deleter for one deallocated object that found no magazine (P7: constructed if
  // the pool has a destroy hook).
  static void release_object_after_gp(void* object) noexcept {
    pool_core* core = chunk_of(object)->core;
    if (auto destroy = core->pool.options_.destroy) {
      destroy(object);
      core->destroyed.fetch_add(1, std::memory_order_relaxed);
    }
    core->release_object(object);
  }

  // `object` holds nothing and nobody can be reading it: back to its chunk.
  void release_object(void* object) noexcept {
    returned.fetch_add(1, std::memory_order_relaxed);
    release_to_chunks([&](auto&& release) { release(object); });
    trim_if_pending();
  }

  // --- magazines ----------------------------------------------------------------------------

  magazine* new_magazine(pool_cache& cache) noexcept {
    if (magazine* m = cache.empty) {
      cache.empty = m->next;
      --cache.empty_count;
      m->next = nullptr;
      return m;
    }
    return allocate_magazine();
  }

  // A new empty magazine from the system allocator; nullptr if it has no memory.
  magazine* allocate_magazine() noexcept {
    void* memory = allocator().allocate(magazine::bytes_for(magazine_capacity),
                                        alignof(magazine), allocator().context);
    return memory == nullptr ? nullptr : new (memory) magazine(magazine_capacity);
  }

  void free_magazine(magazine* m) noexcept {
    m->~magazine();
    allocator().deallocate(m, magazine::bytes_for(magazine_capacity), allocator().context);
  }

  void stash_magazine(pool_cache& cache, magazine* m) noexcept {
    m->count = 0;
    m->gp_cookie = 0;
    if (cache.empty_count < kEmptyMagazinesPerCache) {
      m->next = cache.empty;
      cache.empty = m;
      ++cache.empty_count;
    } else {
      free_magazine(m);
    }
  }

  // Every object of `m` goes back to its chunk, destroyed first if it is still constructed
  // (P7); requires a grace period since each was deallocated (m is ready or its cookie
  // elapsed, or the pool is being destroyed after synchronize()), and no cache hold unless
  // m is ready.
  void release_objects(magazine* m) noexcept {
    destroy_objects(m);
    returned.fetch_add(m->count, std::memory_order_relaxed);
    release_slots(m);
  }

  // (P7), never under a cache hold: runs pool_options::destroy on each object of a
  // constructed magazine.
  void destroy_objects(magazine* m) noexcept {
    if (!m->constructed) return;
    void (*const destroy)(void*) noexcept = pool.options_.destroy;
    void** objects = m->objects();
    for (std::uint32_t i = 0; i < m->count; ++i) destroy(objects[i]);
    m->constructed = false;
    destroyed.fetch_add(m->count, std::memory_order_relaxed);
  }

  // An elapsed magazine becomes ready: its objects destroyed (P7, so never under a cache hold
  // if it is constructed) and poisoned until handed out (P2).
  void make_ready(magazine* m) noexcept {
    destroy_objects(m);
    void** objects = m->objects();
    for (std::uint32_t i = 0; i < m->count; ++i) asan_poison(objects[i], pool.object_size_);
  }

  // release_objects() without counting them as returned.
  void release_slots(magazine* m) noexcept {
    void** objects = m->objects();
    const std::uint32_t count = m->count;
    release_to_chunks([&](auto&& release) {
      for (std::uint32_t i = 0; i < count; ++i) release(objects[i]);
    });
    m->count = 0;
  }

  bool to_depot(magazine* m) noexcept {
    for (unsigned i = 0; i < depot_slots; ++i) {
      magazine* expected = nullptr;
      // Release (A3): the magazine's contents are visible to the taker; pairs with (A4).
      if (depot[i].load(std::memory_order_relaxed) == nullptr &&
          depot[i].compare_exchange_strong(expected, m, std::memory_order_release,
                                           std::memory_order_relaxed)) {
        return true;
      }
    }
    return false;
  }

  // --- the grace-period stages ----------------------------------------------------------------

  // Magazines a holder took out of its cache to finish after the hold (P7), recorded in a
  // slot of the cache's `finishing`.
  struct taken_magazines {
    magazine_fifo fifo;
    std::atomic<std::uint64_t>* slot = nullptr;  // set once fifo is not empty
    std::uint64_t recorded = 0;                   // what the slot holds for this take
    std::uint32_t generation = 0;                 // the fork generation it was taken in
  };

  // Holder: an elapsed magazine becomes ready, or, still constructed, is taken out to be
  // finished after the hold (P7). False if it must stay: constructed, with every finishing
  // slot of the cache busy.
  bool promote(pool_cache& cache, magazine* m, taken_magazines& taken) noexcept {
    if (m->constructed) {
      if (taken.fifo.head == nullptr && !record_take(cache, taken)) return false;
      taken.fifo.push_back(m);
      return true;
    }
    make_ready(m);
    bump(cache.reused, m->count);
    cache.ready.push_back(m);
    return true;
  }

  // Holder: claims a free finishing slot for this hold's take (P7).
  bool record_take(pool_cache& cache, taken_magazines& taken) noexcept {
    for (std::atomic<std::uint64_t>& slot : cache.finishing) {
      // Acquire: a slot seen free carries its finisher's destroy calls into this hold, and
      // so to destroy_deallocated(), which holds the cache later; pairs with the Release
      // store in release_and_finish().
      if (slot.load(std::memory_order_acquire) % 2 != 0) continue;
      taken.slot = &slot;
      taken.recorded = 2 * ++cache.takes + 1;
      taken.generation = process_fork_generation();
      // Release: carries on the destroy calls of the take that freed the slot (acquired
      // above), for a destroy_deallocated() that waited on that take and reads this number
      // instead; pairs with its Acquire load. (Its read under a hold is ordered by (A2).)
      slot.store(taken.recorded, std::memory_order_release);
      return true;
    }
    return false;
  }

  // Promotes the elapsed magazines; takes out at most kMagazinesPerTake constructed ones, so
  // that one call runs a bounded number of destructors.
  void promote_elapsed(pool_cache& cache, taken_magazines& taken) noexcept {
    std::uint32_t taken_out = 0;
    while (cache.waiting.head != nullptr &&
           reclamation.gp_elapsed(cache.waiting.head->gp_cookie)) {
      if (cache.waiting.head->constructed && taken_out++ == kMagazinesPerTake) return;
      magazine* m = cache.waiting.pop_front();
      if (!promote(cache, m, taken)) {
        cache.waiting.push_front(m);
        return;
      }
    }
  }

  // Holder of `cache`, which took `taken` out of it: releases the hold, destroys the taken
  // magazines' objects (P7), then hands them to `cache` as ready if it can hold it again at
  // once, else to the depot, else back to the chunks. Returns with `cache` held (the caller
  // releases it) or, if it could not be held, false.
  bool release_and_finish(pool_cache& cache, taken_magazines& taken) noexcept {
    update_gauges(cache);
    pool.release_hold(cache);
    for (magazine* m = taken.fifo.head; m != nullptr; m = m->next) make_ready(m);
    const bool held = pool.take_cache(cache, pool.index_of(cache));
    while (taken.fifo.head != nullptr) {
      magazine* m = taken.fifo.pop_front();
      if (held) {
        bump(cache.reused, m->count);
        cache.ready.push_back(m);
      } else if (!to_depot(m)) {
        release_objects(m);
        free_magazine(m);
        trim_if_pending();
      }
    }
    // A take recorded before a fork() is not the child's to end: its slots started free.
    if (taken.generation == process_fork_generation()) {
      // Release: the destroy calls above reach destroy_deallocated(), which waits for the
      // slot to change; pairs with its Acquire load.
      taken.slot->store(taken.recorded + 1, std::memory_order_release);
    }
    return held;
  }

  // (P1): the cookie is taken after the magazine's last object was added.
  void seal(pool_cache& cache) noexcept {
    magazine* m = cache.freed;
    cache.freed = nullptr;
    m->gp_cookie = reclamation.gp_cookie();
    cache.waiting.push_back(m);
  }

  // Takes a magazine from the depot (P4: they are all ready).
  void take_from_depot(pool_cache& cache) noexcept {
    for (unsigned i = 0; i < depot_slots; ++i) {
      if (depot[i].load(std::memory_order_relaxed) == nullptr) continue;
      // Acquire (A4): own the magazine and its contents; pairs with (A3).
      magazine* m = depot[i].exchange(nullptr, std::memory_order_acquire);
      if (m == nullptr) continue;
      depot_takes.fetch_add(1, std::memory_order_relaxed);
      cache.ready.push_back(m);
      return;
    }
  }

  // The fallback of a thread that found every cache held: one object from a ready magazine
  // in the depot, whose rest goes back (P4). nullptr if none.
  void* allocate_from_depot() noexcept {
    for (unsigned i = 0; i < depot_slots; ++i) {
      if (depot[i].load(std::memory_order_relaxed) == nullptr) continue;
      // Acquire (A4): own the magazine; pairs with (A3).
      magazine* m = depot[i].exchange(nullptr, std::memory_order_acquire);
      if (m == nullptr) continue;
      void* object = m->objects()[--m->count];
      if (m->count == 0) {
        free_magazine(m);
      } else if (!to_depot(m)) {
        release_objects(m);
        free_magazine(m);
      }
      return object;
    }
    return nullptr;
  }

  // The last fallback: one object for the caller and a magazine's worth into the depot for
  // the next such thread, from the chunks' free slots (P5) if the chunk lock is free, or else
  // from a chunk of its own whose rest is released at once.
  void* allocate_from_chunks() {
    magazine* spare = allocate_magazine();
    void* object = nullptr;
    take_from_partial_chunks([&] {
      if (take_free_slots(&object, 1) == 1 && spare != nullptr) {
        spare->count = take_free_slots(spare->objects(), batch);
      }
    });
    if (object != nullptr) {
      reused_unheld.fetch_add(1, std::memory_order_relaxed);
      asan_unpoison(object, pool.object_size_);
    }
    bool spare_is_fresh = false;
    if (object == nullptr) {
      chunk* c = new_chunk();
      if (c == nullptr) {
        if (spare != nullptr) free_magazine(spare);
        trim_if_pending();
        throw std::bad_alloc();
      }
      object = object_at(c, 0);
      std::uint32_t used = 1;
      if (spare != nullptr) {
        while (spare->count < batch && used < c->capacity) {
          void* fresh = object_at(c, used++);
          asan_poison(fresh, pool.object_size_);
          spare->objects()[spare->count++] = fresh;
        }
      }
      fresh_unheld.fetch_add(1, std::memory_order_relaxed);
      release_uncarved(c, used);
      spare_is_fresh = true;
    }
    if (spare != nullptr) {
      const std::uint32_t count = spare->count;  // read before to_depot() hands it over (P4)
      if (count != 0 && to_depot(spare)) {
        (spare_is_fresh ? fresh_unheld : reused_unheld)
            .fetch_add(count, std::memory_order_relaxed);
      } else {
        // The depot is full: back to their chunks, never having counted as handed out.
        release_slots(spare);
        free_magazine(spare);
      }
    }
    return object;
  }

  // Cuts fresh objects into the (empty) loaded magazine; false if none could be had.
  bool refill_fresh(pool_cache& cache) noexcept {
    if (cache.loaded == nullptr) {
      cache.loaded = new_magazine(cache);
      if (cache.loaded == nullptr) return false;
    }
    magazine* m = cache.loaded;
    // Callers come with the loaded magazine empty; one holding batch or more (a ready
    // magazine may hold up to magazine_capacity) needs nothing cut.
    if (m->count >= batch) return true;
    // Free slots of the chunks already held first (P5): a chunk is cut only when none has one
    // (or another thread holds the chunk lock).
    std::uint32_t taken = 0;
    take_from_partial_chunks(
        [&] { taken = take_free_slots(m->objects() + m->count, batch - m->count); });
    m->count += taken;
    bump(cache.reused_from_chunks, taken);
    std::uint32_t added = 0;
    while (m->count < batch) {
      if (cache.carving == nullptr || cache.carved == objects_per_chunk) {
        chunk* c = new_chunk();
        if (c == nullptr) break;
        cache.carving = c;
        cache.carved = 0;
      }
      const std::uint32_t take = std::min(batch - m->count, objects_per_chunk - cache.carved);
      for (std::uint32_t i = 0; i < take; ++i) {
        m->objects()[m->count++] = object_at(cache.carving, cache.carved++);
      }
      added += take;
    }
    bump(cache.fresh, added);
    return m->count != 0;
  }

  std::uint64_t ready_objects(const pool_cache& cache) const noexcept {
    return (cache.loaded != nullptr ? cache.loaded->count : 0) + cache.ready.objects;
  }
  std::uint64_t waiting_objects(const pool_cache& cache) const noexcept {
    return cache.waiting.objects + (cache.freed != nullptr ? cache.freed->count : 0);
  }

  // Sheds ready magazines, oldest first: into the depot, where the next CPU that runs out
  // takes them, while the cache holds more than `depot_above` ready objects and a slot is
  // free; back to the system while it holds more than `release_above`.
  void shed_ready(pool_cache& cache, std::uint64_t depot_above,
                  std::uint64_t release_above) noexcept {
    std::uint64_t ready = ready_objects(cache);
    bool depot_has_room = true;  // one full scan per pass is enough to know it is full
    while (ready > std::min(depot_above, release_above) && cache.ready.head != nullptr) {
      magazine* m = cache.ready.pop_front();
      const std::uint32_t count = m->count;  // read before to_depot() hands m over (P4)
      if (depot_has_room && ready > depot_above) {
        if (to_depot(m)) {
          ready -= count;
          continue;
        }
        depot_has_room = false;
      }
      if (ready <= release_above) {
        cache.ready.push_front(m);
        break;
      }
      ready -= count;
      release_objects(m);
      stash_magazine(cache, m);
    }
  }

  // The idle trim's second look at a cache still idle: its ready magazines go to the depot
  // (one in use, where an allocating CPU finds them) or back to their chunks, and so do the
  // loaded magazine's objects. The (low + high) / 2 objects the first look kept are the last
  // the cache was given, and freed in another order than they were cut, each can keep a
  // chunk of its own from going back to the system. A cache idle for two passes (40 ms or
  // more) has nothing warm left to lose: its next allocation refills from the chunks.
  void empty_ready(pool_cache& cache, bool depot_idle) noexcept {
    shed_ready(cache, depot_idle ? std::numeric_limits<std::uint64_t>::max() : 0, 0);
    if (magazine* loaded = cache.loaded; loaded != nullptr && !loaded->empty()) {
      release_objects(loaded);  // leaves it empty; release_hold() marks it so (P8)
    }
  }

  // A cache that filled kConsumerMagazines magazines in a row without allocating only frees
  // (the consumer of a producer-consumer pair): it passes what it does not need to the
  // depot, where the allocating CPU finds it instead of cutting fresh chunks. One that
  // allocates keeps up to busy_high for itself: another CPU taking its objects would take
  // them cold, and a thread that frees in phases (a batch of erases between inserts) fills
  // a magazine or two between its allocations. Past busy_high, with the depot full, objects
  // go back to the system.
  void shed_surplus(pool_cache& cache) noexcept {
    const bool consumer = cache.magazines_freed_without_allocating >= kConsumerMagazines;
    shed_ready(cache, consumer ? high : busy_high, busy_high);
  }

  void update_gauges(pool_cache& cache) noexcept {
    // Relaxed: gauges, written by the holder only.
    cache.ready_gauge.store(ready_objects(cache), std::memory_order_relaxed);
    cache.waiting_gauge.store(waiting_objects(cache), std::memory_order_relaxed);
  }

  // After the hold is released: urge grace periods on for a cache with `waiting` objects.
  void drive_gp(std::uint64_t waiting) noexcept {
    if (!pool.options_.reuse_after_gp) return;
    if (caller_gp_threshold != 0 && waiting > caller_gp_threshold) {
      reclamation.synchronize_when_unpinned();
    } else if (waiting > gp_request_threshold) {
      if (caller_gp_threshold == 0) {
        reclamation.request_gp();
      } else if (reclamation.request_gp_claiming_overdue()) {
        // The domain's request has waited long: answer it here, between read sections.
        reclamation.synchronize_when_unpinned();
      }
    }
  }

  // Whether the idle trim has anything to look at in this cache, in the deferred stacks a
  // chunk lock holder left after kDeferredPasses, or among the chunks kept for reuse.
  bool needs_trim(const pool_cache& cache) const noexcept {
    return ready_objects(cache) > high || waiting_objects(cache) != 0 || anything_deferred() ||
           anything_retained();
  }
  // Relaxed: a hint; the trim pass takes the lock.
  bool anything_retained() const noexcept {
    return retained_chunks.load(std::memory_order_relaxed) != 0;
  }

  // For releases made outside any cache hold (deleters, the all-caches-held fallback, and
  // deallocate_unconstructed()): what they left to a chunk lock holder, or kept for reuse,
  // waits for the idle trim.
  void trim_if_pending() noexcept {
    if (anything_deferred() || anything_retained()) schedule_trim();
  }

  // The idle trim: a cache that allocated nothing since the last pass sheds its ready
  // objects down to the watermarks, one still idle at the next pass empties (empty_ready()),
  // and a depot nobody took from is emptied, so memory a
  // burst needed goes back to the system even when no thread touches the pool again. One
  // pass at a time, run by the domain's worker after a grace period, at most every
  // kTrimInterval; it reschedules itself while anything is left to trim.
  void schedule_trim() noexcept {
    const std::uint32_t tag = generation_tag();
    // SeqCst: the flag limits passes in flight to one (retire() orders the pass itself). A
    // caller that found something deferred and reads it set here is ordered before the
    // pass's SeqCst store(0), so that pass's look at the stacks sees it.
    std::uint32_t seen = trim_scheduled.load(std::memory_order_seq_cst);
    do {
      if (seen == tag) return;
    } while (!trim_scheduled.compare_exchange_weak(seen, tag, std::memory_order_seq_cst,
                                                   std::memory_order_seq_cst));
    reclamation.defer_housekeeping(&pool_core::trim_pass, this);
  }

  // The value of a flag set in this process: its fork generation, tagged (never 0).
  static std::uint32_t generation_tag() noexcept {
    return tag_of(process_fork_generation() & kGenerationMask);
  }
  static std::uint32_t tag_of(std::uint32_t generation) noexcept {
    return (generation << 1) | std::uint32_t{1};
  }

  // With no memory for a retire block, retire() runs the pass synchronously, on this thread;
  // a pass it schedules from there would run inside it again, without end.
  static inline thread_local bool tls_in_trim_pass = false;

  static void trim_pass(void* pointer) noexcept {
    auto* core = static_cast<pool_core*>(pointer);
    // SeqCst: a Dekker pair with the destructor's destroying store and its loads of these
    // flags: either this pass sees destroying, or the destructor sees it running.
    core->trim_running.store(generation_tag(), std::memory_order_seq_cst);
    core->trim_scheduled.store(0, std::memory_order_seq_cst);
    if (!core->destroying.load(std::memory_order_seq_cst) && !tls_in_trim_pass) {
      tls_in_trim_pass = true;
      core->trim(std::chrono::steady_clock::now());
      tls_in_trim_pass = false;
    }
    // Release: the pass's last touch of the pool; pairs with the destructor's Acquire load.
    core->trim_running.store(0, std::memory_order_release);
  }

  void trim(std::chrono::steady_clock::time_point now) noexcept {
    pool_core* core = this;
    // Relaxed: a hint (see last_trim).
    const auto last = std::chrono::steady_clock::time_point(
        std::chrono::steady_clock::duration(core->last_trim.load(std::memory_order_relaxed)));
    if (now - last < kTrimInterval) {
      core->schedule_trim();
      return;
    }
    core->last_trim.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    object_pool& pool = core->pool;
    bool again = false;
    const std::uint64_t takes = core->depot_takes.load(std::memory_order_relaxed);
    // Relaxed: hints (see depot_takes_at_last_trim). A depot some CPU took from since the
    // last pass is in use: idle caches shed into it first (a consumer's objects, which the
    // producer's CPU takes); an unused one is emptied below.
    const bool depot_idle =
        core->depot_takes_at_last_trim.exchange(takes, std::memory_order_relaxed) == takes;
    const std::uint64_t trimmed = (core->low + core->high) / 2;
    for (unsigned i = 0; i <= pool.cache_mask_; ++i) {
      pool_cache& cache = pool.caches_[i];
      // A held cache is busy: look again next pass.
      if (!pool.take_cache(cache, i)) {
        again = true;
        continue;
      }
      taken_magazines taken;
      if (pool.options_.reuse_after_gp) core->promote_elapsed(cache, taken);
      if (taken.fifo.head != nullptr) {
        // (P7): destroyed outside the hold, then the pass goes on holding the cache again.
        if (!core->release_and_finish(cache, taken)) {
          again = true;
          continue;
        }
      }
      // Relaxed: only holders write it, and we hold the cache.
      const std::uint64_t allocated = cache.allocated.load(std::memory_order_relaxed);
      const bool idle = allocated == cache.allocated_at_last_trim;
      // An idle cache's objects start their grace period; so do constructed ones in any
      // cache, so that each is destroyed within a pass or two of its grace period (P7).
      if (cache.freed != nullptr && !cache.freed->empty() && (idle || cache.freed->constructed)) {
        core->seal(cache);
      }
      cache.idle_trim_passes =
          idle ? std::min(cache.idle_trim_passes + 1, kIdlePassesBeforeEmptying) : 0;
      if (cache.idle_trim_passes == kIdlePassesBeforeEmptying) {
        core->empty_ready(cache, depot_idle);
      } else if (idle) {
        core->shed_ready(cache,
                         depot_idle ? std::numeric_limits<std::uint64_t>::max() : trimmed,
                         trimmed);
        // Look again: still idle then, the cache empties.
        again = again || ready_objects(cache) != 0;
      }
      cache.allocated_at_last_trim = allocated;
      again = again || core->needs_trim(cache);
      core->update_gauges(cache);
      pool.release_hold(cache);
    }
    // What a chunk lock holder left after kDeferredPasses, or deferred by threads that then
    // found the lock held too.
    if (core->anything_deferred()) {
      core->drain_deferred();
      again = again || core->anything_deferred();
    }
    // Chunks retained for reuse (P5) that no refill took since the last pass go back to the
    // system now (unlock_chunks() frees them); the others at the next pass, unless reused.
    if (core->anything_retained()) {
      if (core->try_lock_chunks()) {
        core->age_retained();
        core->unlock_chunks();
      }
      again = again || core->anything_retained();
    }
    for (unsigned i = 0; i < core->depot_slots; ++i) {
      if (core->depot[i].load(std::memory_order_relaxed) == nullptr) continue;
      again = true;
      if (!depot_idle) continue;
      // Acquire (A4): pairs with (A3).
      magazine* m = core->depot[i].exchange(nullptr, std::memory_order_acquire);
      if (m == nullptr) continue;
      core->release_objects(m);
      core->free_magazine(m);
    }
    if (again) core->schedule_trim();
  }
};

// --- fork() -----------------------------------------------------------------------------------
// A cache that a thread holds when fork() copies the process would stay held for ever in the
// child, which does not have that thread: with every cache held (two busy threads on two
// CPUs), each allocate() of the child took the all-caches-held fallback (a yield and a depot
// magazine or a chunk) and each deallocate() a retire(): 6 of 60 children of a churning
// parent ran for more than 20 s. So fork() holds every cache itself, through grace's fork
// hooks (grace/reclaim/detail/fork.h): grace's prepare handler calls hold_every_cache() last,
// once grace periods and the reclaim workers are held still, and it waits only for the
// threads that hold a cache, which wait for nothing but the pool's system_allocator while
// they do (P3). The copy then holds no half-done change to a cache, and the parent's and the
// child's handlers let every cache go first. The chunk lock and the trim flags, which threads
// take outside any cache hold, keep their fork generation tags (P5).
namespace {
// The live pools. Constructors push onto new_pools, a lock-free stack (a constructor may run
// inside a read section or a deleter, which a fork waits for: it must never wait for the
// fork); whoever holds pools_mutex (a destructor, the fork) moves them into live_pools first.
constinit std::mutex pools_mutex;  // held by fork() from hold_every_cache() to the release
constinit pool_core* live_pools = nullptr;
constinit std::atomic<pool_core*> new_pools{nullptr};

// pools_mutex held: moves the pools constructed since into live_pools.
void splice_new_pools() noexcept {
  // Acquire: the pushed pools and their links; pairs with the Release CAS in add_for_fork().
  pool_core* core = new_pools.exchange(nullptr, std::memory_order_acquire);
  while (core != nullptr) {
    pool_core* next = core->fork_next;
    core->fork_prev = nullptr;
    core->fork_next = live_pools;
    if (live_pools != nullptr) live_pools->fork_prev = core;
    live_pools = core;
    core = next;
  }
}
}  // namespace

// Set while the program starts (before any pool can exist), not at the first pool: a fork
// whose prepare ran before the first pool was built would call no hook, so its child would
// not mark that pool fork_skip, and the child's next fork would wait on a cache a thread of
// the parent held at the copy.
constexpr fork_hooks kForkHooks{&pool_core::hold_every_cache,
                                &pool_core::release_every_cache_in_parent,
                                &pool_core::release_every_cache_in_child};
[[maybe_unused]] const bool fork_hooks_set = (set_fork_hooks(&kForkHooks), true);

void pool_core::add_for_fork(pool_core& core) noexcept {
  pool_core* head = new_pools.load(std::memory_order_relaxed);
  do {
    core.fork_next = head;
    // Release: the built pool and its link reach the thread that splices it; pairs with the
    // Acquire exchange in splice_new_pools().
  } while (!new_pools.compare_exchange_weak(head, &core, std::memory_order_release,
                                            std::memory_order_relaxed));
}

void pool_core::remove_for_fork(pool_core& core) noexcept {
  std::lock_guard lock(pools_mutex);
  splice_new_pools();
  if (core.fork_prev != nullptr) {
    core.fork_prev->fork_next = core.fork_next;
  } else {
    live_pools = core.fork_next;
  }
  if (core.fork_next != nullptr) core.fork_next->fork_prev = core.fork_prev;
  core.fork_prev = core.fork_next = nullptr;
}

void pool_core::hold_every_cache() noexcept {
  pools_mutex.lock();
  splice_new_pools();  // a pool constructed after this point is not held by this fork
  bool sequences = false;
  for (pool_core* core = live_pools; core != nullptr; core = core->fork_next) {
    if (core->fork_skip) continue;
    object_pool& pool = core->pool;
    sequences = sequences || pool.restartable_sequences_;
    for (unsigned i = 0; i <= pool.cache_mask_; ++i) {
      // Acquire (A1): the holder's changes are complete before the copy; pairs with (A2).
      while (pool.caches_[i].held.exchange(true, std::memory_order_acquire)) {
        std::this_thread::yield();
      }
    }
  }
  // (A8), for every CPU at once: no sequence is half done when the child's copy is taken (a
  // push's object and its commit may lie on two pages, which fork() need not copy at one
  // instant), and none starts before release_every_cache().
  if (sequences) object_pool::fence_all_fast_paths_slow();
}

void pool_core::release_every_cache() noexcept {
  for (pool_core* core = live_pools; core != nullptr; core = core->fork_next) {
    if (core->fork_skip) continue;
    object_pool& pool = core->pool;
    // The fork's holds change nothing: like fast-path holds, they leave the counting (P8).
    for (unsigned i = 0; i <= pool.cache_mask_; ++i) pool.end_fast_hold(pool.caches_[i]);
  }
}

void pool_core::release_every_cache_in_parent() noexcept {
  release_every_cache();
  pools_mutex.unlock();
}

void pool_core::release_every_cache_in_child() noexcept {
  release_every_cache();
  for (pool_core* core = live_pools; core != nullptr; core = core->fork_next) {
    core->forget_finishing_in_child();
  }
  // Pools constructed after the hold spliced the list were not held by this fork: marked,
  // they stay on the stack for the next splice (destructors still find them).
  // Relaxed: the child's only thread.
  for (pool_core* core = new_pools.load(std::memory_order_relaxed); core != nullptr;
       core = core->fork_next) {
    core->fork_skip = true;
    core->forget_finishing_in_child();
  }
  // Locked by this thread in hold_every_cache(); a fresh mutex rather than an unlock, as
  // grace's own handlers do, before any thread of the child can wait on it.
  new (&pools_mutex) std::mutex();
}

}  // namespace grace::detail

namespace grace {
namespace {

pool_options resolve_options(std::size_t object_size, pool_options options) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("grace::object_pool: " + what);
  };
  if (object_size == 0) fail("object_size must be at least 1");
  if (object_size > detail::kMaxObjectSize) {
    fail("object_size " + std::to_string(object_size) + " exceeds the largest pooled size, " +
         std::to_string(detail::kMaxObjectSize) + " bytes");
  }
  if (options.alignment == 0) options.alignment = alignof(std::max_align_t);
  if (!std::has_single_bit(options.alignment) || options.alignment > 4096) {
    fail("pool_options.alignment must be a power of two up to 4096, got " +
         std::to_string(options.alignment));
  }
  const bool defaults = options.low_watermark == 0 && options.high_watermark == 0 &&
                        options.batch == 0;
  if (defaults) {
    // The BPF allocator's watermarks: 32/96 up to 256 bytes, scaled down for larger ones.
    if (object_size <= 256) {
      options.low_watermark = 32;
      options.high_watermark = 96;
    } else {
      options.low_watermark = std::max<std::size_t>(32 * 256 / object_size, 1);
      options.high_watermark = std::max<std::size_t>(96 * 256 / object_size, 3);
    }
    options.batch =
        std::max<std::size_t>((options.high_watermark - options.low_watermark) / 4 * 3, 1);
  }
  if (options.batch == 0) fail("pool_options.batch must be at least 1");
  if (options.batch > 4096) fail("pool_options.batch must be at most 4096");
  if (options.high_watermark < options.batch) {
    fail("pool_options.high_watermark (" + std::to_string(options.high_watermark) +
         ") must be >= batch (" + std::to_string(options.batch) + ")");
  }
  if (options.low_watermark > options.high_watermark) {
    fail("pool_options.low_watermark (" + std::to_string(options.low_watermark) +
         ") must be <= high_watermark (" + std::to_string(options.high_watermark) + ")");
  }
  if (options.magazine_capacity == 0) {
    const std::size_t stride = detail::object_stride(object_size, options.alignment);
    options.magazine_capacity =
        std::max(options.batch, std::min(detail::kMaxMagazineCapacity,
                                         detail::kDefaultMagazineObjectBytes / stride));
  }
  if (options.magazine_capacity < options.batch) {
    fail("pool_options.magazine_capacity (" + std::to_string(options.magazine_capacity) +
         ") must be >= batch (" + std::to_string(options.batch) +
         (defaults ? ", the default for this object size; set batch and the watermarks too)"
                   : ")"));
  }
  if (options.magazine_capacity > detail::kMaxMagazineCapacity) {
    fail("pool_options.magazine_capacity must be at most " +
         std::to_string(detail::kMaxMagazineCapacity) + ", got " +
         std::to_string(options.magazine_capacity));
  }
  // Two magazines: past it one at least is sealed, so the grace period can free something.
  if (options.gp_request_threshold == 0) {
    options.gp_request_threshold = 2 * options.magazine_capacity;
  }
  if (options.allocator.allocate == nullptr || options.allocator.deallocate == nullptr) {
    fail("pool_options.allocator must have both allocate and deallocate");
  }
  if (options.destroy != nullptr && !options.reuse_after_gp) {
    fail("pool_options.destroy requires reuse_after_gp: it runs after an object's grace "
         "period");
  }
  return options;
}

}  // namespace

namespace detail {

namespace {

long membarrier_call(int command, unsigned flags, int cpu) noexcept {
  return syscall(__NR_membarrier, command, flags, cpu);
}

// 0: not yet asked; 1: this process may use the pool's restartable sequences; 2: it may not.
// Not a function-local static: a fork() child must not find its guard held by a thread of
// the parent. Relaxed: every thread that asks gets the same answer, and registering twice
// is harmless.
std::atomic<int> rseq_state{0};

}  // namespace

bool restartable_sequences_available() noexcept {
  int state = rseq_state.load(std::memory_order_relaxed);
  if (state == 0) {
    bool usable = false;
    if (GRACE_POOL_RSEQ && __rseq_size != 0) {
      // A thread whose registration failed reads a CPU number no cache has: its sequences
      // always fall back. The fence must exist, or holders could not stop sequences (A8).
      const long commands = membarrier_call(MEMBARRIER_CMD_QUERY, 0, 0);
      usable = commands > 0 && (commands & MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ) != 0 &&
               membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0) == 0;
    }
    state = usable ? 1 : 2;
    rseq_state.store(state, std::memory_order_relaxed);
  }
  return state == 1;
}

}  // namespace detail

namespace detail {
namespace {

// membarrier's RSEQ fence on one CPU (flags MEMBARRIER_CMD_FLAG_CPU) or on every CPU that
// runs a thread of this process (flags 0). It cannot fail once registered: the registration
// is the process's and survives fork(); only exec() drops it, and no pool survives that.
// Register again once before calling it a broken promise.
void rseq_fence(unsigned flags, int cpu) noexcept {
  if (membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, flags, cpu) == 0) return;
  if (membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0) == 0 &&
      membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, flags, cpu) == 0) {
    return;
  }
  std::fprintf(stderr,
               "grace::object_pool: membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ) failed "
               "(errno %d) after it was registered; a cache cannot be held safely.\n",
               errno);
  std::abort();
}

}  // namespace
}  // namespace detail

void object_pool::fence_fast_paths_slow(unsigned cpu) noexcept {
  detail::rseq_fence(MEMBARRIER_CMD_FLAG_CPU, static_cast<int>(cpu));
}

void object_pool::fence_all_fast_paths_slow() noexcept { detail::rseq_fence(0, 0); }

void object_pool::settle(detail::pool_cache& cache) noexcept {
  std::uint64_t pops = 0;
  std::uint64_t pushes = 0;
  if (detail::magazine* loaded = cache.loaded) {
    pops = std::uint64_t{cache.loaded_mark} + loaded->pushed - loaded->count;
    pushes += loaded->pushed;
    loaded->pushed = 0;
  }
  if (detail::magazine* freed = cache.freed) {
    pushes += freed->pushed;
    freed->pushed = 0;
  }
  if (pops != 0) detail::bump(cache.allocated, pops);
  if (pushes != 0) detail::bump(cache.deallocated, pushes);
  mark_loaded(cache);
}

object_pool::object_pool(std::size_t object_size, pool_options options, domain& reclamation)
    : object_size_(object_size),
      options_(resolve_options(object_size, options)),
      domain_(reclamation),
      caches_(std::make_unique<detail::pool_cache[]>(detail::cpu_shard_count())),
      cache_mask_(detail::cpu_shard_count() - 1),
      restartable_sequences_(options_.restartable_sequences &&
                             detail::restartable_sequences_available()) {
  const std::size_t stride = detail::object_stride(object_size_, options_.alignment);
  core_ = std::make_unique<detail::pool_core>(
      *this, stride, detail::layout_chunks(stride, options_.alignment),
      static_cast<std::uint32_t>(options_.batch),
      static_cast<std::uint32_t>(options_.magazine_capacity), options_.low_watermark,
      options_.high_watermark, options_.gp_request_threshold, options_.caller_gp_threshold,
      detail::depot_slots_per_cache(options_.batch, options_.magazine_capacity) *
          (cache_mask_ + 1));
  detail::pool_core::add_for_fork(*core_);  // see "fork()"
}

object_pool::~object_pool() {
  detail::pool_core& core = *core_;
  detail::pool_core::remove_for_fork(core);  // no thread may use the pool any more
  // Objects still waiting may be in use by readers that began before their deallocate():
  // wait for them once, and for every retire() the pool made (shed magazines, trim passes).
  // SeqCst: see trim_pass(); from here on no pass trims or reschedules.
  core.destroying.store(true, std::memory_order_seq_cst);
  domain_->synchronize();
  domain_->barrier();
  // A pass that was already running may have rescheduled itself (defer_housekeeping() is
  // not chased by barrier()): wait for it too. Acquire: pairs with the pass's Release store.
  const std::uint32_t here = detail::pool_core::generation_tag();
  while (core.trim_scheduled.load(std::memory_order_seq_cst) == here ||
         core.trim_running.load(std::memory_order_acquire) == here) {
    domain_->barrier();
  }
  // What other threads deferred to a chunk lock holder, and, in the child of a fork(), the
  // lock a thread of the parent held (taken over and repaired).
  core.drain_deferred();
  auto release_all = [&](detail::pool_cache& cache, detail::magazine* m) {
    core.release_objects(m);
    core.free_magazine(m);
    (void)cache;
  };
  for (unsigned i = 0; i <= cache_mask_; ++i) {
    detail::pool_cache& cache = caches_[i];
    if (cache.loaded != nullptr) release_all(cache, cache.loaded);
    if (cache.freed != nullptr) release_all(cache, cache.freed);
    while (cache.waiting.head != nullptr) release_all(cache, cache.waiting.pop_front());
    while (cache.ready.head != nullptr) release_all(cache, cache.ready.pop_front());
    while (detail::magazine* m = cache.empty) {
      cache.empty = m->next;
      core.free_magazine(m);
    }
    if (cache.carving != nullptr && cache.carved != core.objects_per_chunk) {
      core.release_uncarved(cache.carving, cache.carved);
    }
  }
  for (unsigned i = 0; i < core.depot_slots; ++i) {
    // Relaxed: every thread is done with the pool.
    if (detail::magazine* m = core.depot[i].load(std::memory_order_relaxed)) {
      core.release_objects(m);
      core.free_magazine(m);
    }
  }
  std::uint64_t outstanding = 0;
  // Relaxed: as above.
  for (detail::chunk_record* r = core.records.load(std::memory_order_relaxed); r != nullptr;
       r = r->next_all) {
    if (detail::chunk* c = r->live.load(std::memory_order_relaxed)) {
      outstanding += c->capacity - c->free_slots;
    }
  }
  // Relaxed: set by the owner before destruction began.
  if (outstanding != 0 && !core.forget_allocated.load(std::memory_order_relaxed)) {
#ifndef NDEBUG
    std::fprintf(stderr,
                 "grace::object_pool destroyed with %llu object(s) of %zu bytes still "
                 "allocated: deallocate every object before destroying its pool.\n",
                 static_cast<unsigned long long>(outstanding), object_size_);
    std::abort();
#endif
  }
  {
    detail::pool_core::chunk_releaser releaser(options_.allocator);
    for (detail::chunk_record* r = core.records.load(std::memory_order_relaxed); r != nullptr;
         r = r->next_all) {
      if (detail::chunk* c = r->live.load(std::memory_order_relaxed)) {
        detail::asan_unpoison(c, detail::kChunkBytes);
        releaser.release(c);
      }
    }
  }
  for (detail::chunk_record* r = core.records.load(std::memory_order_relaxed); r != nullptr;) {
    detail::chunk_record* next = r->next_all;
    r->~chunk_record();
    options_.allocator.deallocate(r, sizeof(detail::chunk_record), options_.allocator.context);
    r = next;
  }
}

void* object_pool::allocate_slow(detail::pool_cache& cache) {
  settle(cache);
  detail::pool_core& core = *core_;
  detail::pool_core::taken_magazines taken;
  if (options_.reuse_after_gp) core.promote_elapsed(cache, taken);
  if (cache.ready.head == nullptr && taken.fifo.head == nullptr) core.take_from_depot(cache);
  if (taken.fifo.head != nullptr) {
    // (P7): their objects are destroyed outside the hold, then they are this cache's again
    // (or, with the cache held by another thread meanwhile, the depot's).
    if (!core.release_and_finish(cache, taken)) {
      core.schedule_trim();  // for what the cache still holds, whatever calls come next
      return allocate_contended_slow(detail::current_cpu() & cache_mask_);
    }
    // Held again, maybe after another holder loaded a magazine.
    if (cache.loaded != nullptr && !cache.loaded->empty()) {
      void* object = cache.loaded->objects()[--cache.loaded->count];
      return finish_allocate(cache, object);
    }
  }
  if (cache.ready.head != nullptr) {
    if (cache.loaded != nullptr) core.stash_magazine(cache, cache.loaded);
    cache.loaded = cache.ready.pop_front();
  } else {
    // Nothing ready: start the grace period of what this CPU freed, and cut fresh objects
    // meanwhile.
    if (cache.freed != nullptr && !cache.freed->empty()) core.seal(cache);
    if (!core.refill_fresh(cache)) {
      core.update_gauges(cache);
      release_hold(cache);
      core.trim_if_pending();
      throw std::bad_alloc();
    }
  }
  void* object = cache.loaded->objects()[--cache.loaded->count];
  return finish_allocate(cache, object);
}

void* object_pool::finish_allocate(detail::pool_cache& cache, void* object) noexcept {
  detail::pool_core& core = *core_;
  detail::bump(cache.allocated);
  const std::uint64_t waiting = core.waiting_objects(cache);
  const bool trim = core.needs_trim(cache);
  core.update_gauges(cache);
  release_hold(cache);
  detail::asan_unpoison(object, object_size_);
  core.drive_gp(waiting);
  if (trim) core.schedule_trim();
  return object;
}

void object_pool::deallocate_slow(detail::pool_cache& cache, void* object) noexcept {
  settle(cache);
  detail::pool_core& core = *core_;
  detail::magazine*& target = options_.reuse_after_gp ? cache.freed : cache.loaded;
  if (target != nullptr && !target->full()) {
    // Only `pushed` was at its limit, and settle() zeroed it.
    target->objects()[target->count++] = object;
    detail::bump(cache.deallocated);
    release_hold(cache);
    return;
  }
  if (target != nullptr) {
    // Full. (P1): sealed with a cookie; or, without reuse_after_gp, ready at once.
    if (options_.reuse_after_gp) {
      core.seal(cache);
    } else {
      cache.ready.push_back(target);
      target = nullptr;
    }
  }
  target = core.new_magazine(cache);
  if (target != nullptr) target->constructed = options_.destroy != nullptr;  // (P7)
  if (target == nullptr) {
    // No memory for a magazine: the object returns to its chunk after a grace period.
    core.update_gauges(cache);
    release_hold(cache);
    core.unheld_deallocations.fetch_add(1, std::memory_order_relaxed);
    domain_->retire(object, &detail::pool_core::release_object_after_gp, object_size_);
    return;
  }
  target->objects()[target->count++] = object;
  detail::bump(cache.deallocated);
  detail::pool_core::taken_magazines taken;
  if (options_.reuse_after_gp) core.promote_elapsed(cache, taken);
  // Relaxed: only holders write it, and this thread holds the cache.
  const std::uint64_t allocated = cache.allocated.load(std::memory_order_relaxed);
  if (allocated != cache.allocated_at_last_shed) {
    cache.allocated_at_last_shed = allocated;
    cache.magazines_freed_without_allocating = 0;
  } else if (cache.magazines_freed_without_allocating < detail::kConsumerMagazines) {
    ++cache.magazines_freed_without_allocating;
  }
  if (taken.fifo.head != nullptr) {
    // (P7): their objects are destroyed outside the hold, then they are this cache's again.
    const std::uint64_t waiting = core.waiting_objects(cache);
    if (!core.release_and_finish(cache, taken)) {
      core.drive_gp(waiting);
      core.schedule_trim();  // for what the cache still holds, whatever calls come next
      return;
    }
  }
  core.shed_surplus(cache);
  const std::uint64_t waiting = core.waiting_objects(cache);
  const bool trim = core.needs_trim(cache);
  core.update_gauges(cache);
  release_hold(cache);
  core.drive_gp(waiting);
  if (trim) core.schedule_trim();
}

void* object_pool::allocate_contended_slow(unsigned home) {
  // The holder is most often a thread preempted inside its few instructions of hold: let it
  // run once, then look at every cache, home first.
  std::this_thread::yield();
  if (restartable_sequences_) {
    // Where the thread runs now, without a fence: only another CPU's cache needs one (A8).
    if (void* object = detail::rseq_pop(caches_.get(), cache_mask_ + 1)) {
      detail::asan_unpoison(object, object_size_);
      return object;
    }
  }
  // The yield may have moved the thread; its CPU's cache, if free now, needs no fence.
  home = detail::current_cpu() & cache_mask_;
  for (unsigned i = 0; i <= cache_mask_; ++i) {
    const unsigned index = (home + i) & cache_mask_;
    detail::pool_cache& cache = caches_[index];
    if (!take_fast(cache, index)) continue;
    detail::magazine* loaded = cache.loaded;
    if (loaded == nullptr || loaded->empty()) return allocate_slow(cache);
    void* object = loaded->pop();
    end_fast_hold(cache);
    detail::asan_unpoison(object, object_size_);
    return object;
  }
  // Every cache is held (their holders were preempted, or more threads than CPUs are busy):
  // never wait for them.
  detail::pool_core& core = *core_;
  void* object = core.allocate_from_depot();
  if (object != nullptr) {
    detail::asan_unpoison(object, object_size_);
  } else {
    object = core.allocate_from_chunks();  // may throw std::bad_alloc: not counted
  }
  core.trim_if_pending();  // either may have released objects to the chunks
  core.unheld_allocations.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a statistic.
  return object;
}

void object_pool::deallocate_contended_slow(unsigned home, void* object) noexcept {
  // Without restartable sequences the home cache was just found held: look elsewhere at once.
  unsigned first = 1;
  if (restartable_sequences_) {
    // Another CPU's cache costs a fence (A8), more than letting the holder run once.
    std::this_thread::yield();
    if (detail::rseq_push(caches_.get(), cache_mask_ + 1, target_offset(), object)) return;
    // Still held, or the push needs the slow path (its target magazine missing or full, or
    // `pushed` at its limit): the cache of the CPU it runs on now comes first, with no
    // fence. Another CPU's cache would cost that CPU an IPI and stall its fast paths, and
    // the object would wait in that CPU's magazine instead of this one's.
    home = detail::current_cpu() & cache_mask_;
    first = 0;
  }
  for (unsigned i = first; i <= cache_mask_; ++i) {
    const unsigned index = (home + i) & cache_mask_;
    detail::pool_cache& cache = caches_[index];
    if (!take_fast(cache, index)) continue;
    detail::magazine* target = options_.reuse_after_gp ? cache.freed : cache.loaded;
    if (target == nullptr || !target->can_push()) {
      deallocate_slow(cache, object);
      return;
    }
    target->push(object);
    end_fast_hold(cache);
    return;
  }
  // Every cache is held: the object goes back to its chunk after a grace period.
  core_->unheld_deallocations.fetch_add(1, std::memory_order_relaxed);
  domain_->retire(object, &detail::pool_core::release_object_after_gp, object_size_);
}

void object_pool::allocate_bulk(void** objects, std::size_t count) {
  std::size_t done = 0;
  try {
    while (done < count) {
      const unsigned home = detail::current_cpu() & cache_mask_;
      detail::pool_cache& cache = caches_[home];
      if (!take_fast(cache, home)) {
        objects[done++] = allocate_contended_slow(home);
        continue;
      }
      detail::magazine* loaded = cache.loaded;
      if (loaded == nullptr || loaded->empty()) {
        objects[done++] = allocate_slow(cache);
        continue;
      }
      // One hold serves as many objects as the loaded magazine has.
      const std::size_t take = std::min<std::size_t>(count - done, loaded->count);
      for (std::size_t i = 0; i < take; ++i) {
        void* object = loaded->pop();
        detail::asan_unpoison(object, object_size_);
        objects[done++] = object;
      }
      end_fast_hold(cache);
    }
  } catch (...) {
    // Nobody has seen them, and they hold nothing (P7: never destroyed).
    for (std::size_t i = 0; i < done; ++i) deallocate_unconstructed(objects[i]);
    throw;
  }
}

void object_pool::deallocate_bulk(void* const* objects, std::size_t count) noexcept {
  std::size_t done = 0;
  while (done < count) {
    if (objects[done] == nullptr) {
      ++done;
      continue;
    }
    // Poisoned before it is anybody else's to take (as in deallocate()).
    if (!options_.reuse_after_gp) detail::asan_poison(objects[done], object_size_);
    const unsigned home = detail::current_cpu() & cache_mask_;
    detail::pool_cache& cache = caches_[home];
    if (!take_fast(cache, home)) {
      deallocate_contended_slow(home, objects[done++]);
      continue;
    }
    detail::magazine* target = options_.reuse_after_gp ? cache.freed : cache.loaded;
    if (target == nullptr || !target->can_push()) {
      deallocate_slow(cache, objects[done++]);
      continue;
    }
    // One hold fills the magazine as far as it has room.
    target->push(objects[done++]);
    while (done < count && target->can_push()) {
      void* object = objects[done++];
      if (object == nullptr) continue;
      if (!options_.reuse_after_gp) detail::asan_poison(object, object_size_);
      target->push(object);
    }
    end_fast_hold(cache);
  }
}

object_pool& object_pool::owner_of(void* object) noexcept {
  return detail::pool_core::chunk_of(object)->core->pool;
}

void object_pool::deallocate_unconstructed(void* object) noexcept {
  if (object == nullptr) return;
  detail::pool_core& core = *core_;
  core.unheld_deallocations.fetch_add(1, std::memory_order_relaxed);  // Relaxed: a statistic.
  core.release_object(object);
}

void object_pool::destroy_deallocated() {
  detail::pool_core& core = *core_;
  // Holders wait for nothing (P3): wait for them. In a fork() child, a cache of a pool built
  // during the fork may stay held by a thread the child does not have: after a while, it is
  // skipped (what it holds is lost to the child).
  auto hold = [this, &core](detail::pool_cache& cache) {
    for (unsigned tries = 0; !take_cache(cache, index_of(cache)); ++tries) {
      if (core.fork_skip && tries == detail::kForkSkippedHoldTries) return false;
      std::this_thread::yield();
    }
    return true;
  };
  // Every object deallocated before the call is now in a sealed magazine, retired alone, or
  // in magazines a holder took out to finish (P7).
  for (unsigned i = 0; i <= cache_mask_; ++i) {
    detail::pool_cache& cache = caches_[i];
    if (!hold(cache)) continue;
    if (cache.freed != nullptr && !cache.freed->empty()) core.seal(cache);
    release_hold(cache);
  }
  // Sealed magazines carry cookies up to this one: they elapse, and the objects retired alone
  // are destroyed.
  const std::uint64_t sealed_by = domain_->gp_cookie();
  domain_->synchronize();
  domain_->barrier();
  if (options_.destroy == nullptr) return;
  // In each cache the magazines sealed above are all elapsed: those still waiting are
  // finished here, and the takes recorded in its finishing slots when it is held (the
  // holders that took the others out, and maybe later ones) are waited for. A take stops at
  // kMagazinesPerTake, or finds every slot busy: while magazines sealed above are left
  // waiting, look again (waiting is in cookie order). The depot only ever holds ready
  // magazines.
  for (unsigned i = 0; i <= cache_mask_; ++i) {
    detail::pool_cache& cache = caches_[i];
    for (bool left_waiting = true; left_waiting;) {
      if (!hold(cache)) break;
      detail::pool_core::taken_magazines taken;
      core.promote_elapsed(cache, taken);
      left_waiting = cache.waiting.head != nullptr && cache.waiting.head->constructed &&
                     cache.waiting.head->gp_cookie <= sealed_by;
      std::uint64_t seen[detail::kFinishingSlots];
      for (unsigned s = 0; s < detail::kFinishingSlots; ++s) {
        // Acquire: a slot already freed carries its finisher's destroy calls; pairs with
        // the Release store in release_and_finish(). A busy one is waited for below.
        seen[s] = cache.finishing[s].load(std::memory_order_acquire);
      }
      if (taken.fifo.head == nullptr || core.release_and_finish(cache, taken)) {
        core.update_gauges(cache);
        release_hold(cache);
      }
      for (unsigned s = 0; s < detail::kFinishingSlots; ++s) {
        if (seen[s] % 2 == 0) continue;
        // Acquire: the finisher's destroy calls; pairs with the Release store in
        // release_and_finish().
        while (cache.finishing[s].load(std::memory_order_acquire) == seen[s]) {
          std::this_thread::yield();
        }
      }
    }
  }
}

void object_pool::forget_allocated() noexcept {
  // Relaxed: read by the destructor on the same thread (or after the owner's hand-off).
  core_->forget_allocated.store(true, std::memory_order_relaxed);
}

pool_stats object_pool::stats() const noexcept {
  // Fast paths count nothing (P8): settle every cache, so that the counts are exact when no
  // operation is in flight. A held cache is given a few yields: its holder may be the pool's
  // own (the idle trim), which settles it but may not have yet. Holders wait for nothing
  // (P3), so a hold lasts a few yields unless its thread is preempted (or, in a fork()
  // child, gone), and then the snapshot leaves that cache's latest fast paths out.
  for (unsigned i = 0; i <= cache_mask_; ++i) {
    for (unsigned tries = 0; tries < detail::kStatsHoldTries; ++tries) {
      if (take_cache(caches_[i], i)) {
        release_hold(caches_[i]);
        break;
      }
      std::this_thread::yield();
    }
  }
  const detail::pool_core& core = *core_;
  pool_stats s;
  // Relaxed throughout: an approximate snapshot.
  for (unsigned i = 0; i <= cache_mask_; ++i) {
    const detail::pool_cache& cache = caches_[i];
    s.allocated += cache.allocated.load(std::memory_order_relaxed);
    s.deallocated += cache.deallocated.load(std::memory_order_relaxed);
    s.reused_after_gp += cache.reused.load(std::memory_order_relaxed);
    s.fresh += cache.fresh.load(std::memory_order_relaxed);
    s.reused_from_chunks += cache.reused_from_chunks.load(std::memory_order_relaxed);
    s.ready += cache.ready_gauge.load(std::memory_order_relaxed);
    s.waiting_for_gp += cache.waiting_gauge.load(std::memory_order_relaxed);
  }
  s.allocated += core.unheld_allocations.load(std::memory_order_relaxed);
  s.fresh += core.fresh_unheld.load(std::memory_order_relaxed);
  s.reused_from_chunks += core.reused_unheld.load(std::memory_order_relaxed);
  s.deallocated += core.unheld_deallocations.load(std::memory_order_relaxed);
  s.returned_to_system = core.returned.load(std::memory_order_relaxed);
  s.destroyed = core.destroyed.load(std::memory_order_relaxed);
  s.held_bytes = core.held_bytes.load(std::memory_order_relaxed);
  s.peak_held_bytes = core.peak_held_bytes.load(std::memory_order_relaxed);
  s.chunks = core.chunks.load(std::memory_order_relaxed);
  s.retained_chunks = core.retained_chunks.load(std::memory_order_relaxed);
  return s;
}

}  // namespace grace
