// Internal. Do not include directly.
//
// The object pool's data structures.
//
//   deallocate()                        allocate()
//      |                                   ^
//      v                                   |
//   cache.freed --full, stamped--> cache.waiting --cookie elapsed--> cache.ready -> cache.loaded
//   (per CPU)     with gp_cookie    (FIFO)                            (stack)
//        \                 \                                          /
//         \--- surplus -----> depot_ (slots, any CPU takes an elapsed magazine) <--
//                             full depot: released to their chunks (waiting ones via retire())
//
// A magazine is an array of object pointers. Objects are never linked through their own
// memory: a reader may still be reading a freed object until its grace period ends, so the
// pool writes nothing into it. Fresh objects are carved from 64 KiB chunks aligned to their
// size, so an object finds its chunk by masking its address; a chunk goes back to the system
// when every object carved from it has been released.
//
// Invariants:
//   (P1) An object in `freed` or `waiting` has not been handed out since its deallocate().
//        A magazine's gp_cookie is taken after its last object was added.
//   (P2) An object in `ready` or `loaded` had its magazine's cookie elapsed (or came fresh
//        from a chunk): a full grace period has passed since its deallocate(). Only such
//        objects are handed out by allocate() (with reuse_after_gp; the `immediate` reference
//        mode skips the wait and is unsafe for readers).
//   (P3) A cache's lists are touched only by the thread holding it (held == true).
//   (P4) A magazine in a depot slot is owned by the slot; it moves out by one exchange.
//   (P5) chunk.released counts objects carved from the chunk and released; it reaches
//        chunk.capacity exactly once, and that releaser frees the chunk. Any other releaser
//        touches the chunk only before its fetch_add (the chunk may be gone right after).
//
// Ordering guarantees:
//   (A1) Acquire exchange(true) on cache.held takes the cache with every change its previous
//        holder made; pairs with the Release store(false) that ended that hold (A2).
//   (A2) Release store(false) on cache.held.
//   (A3) Release CAS of a magazine into a depot slot publishes its contents; pairs with the
//        Acquire exchange that takes it (A4).
//   (A4) Acquire exchange(nullptr) on a depot slot.
//   (A5) AcqRel fetch_add on chunk.released: the last releaser sees every other release
//        before freeing the chunk.
//
// Progress guarantees: allocate() and deallocate() never wait for another thread. A thread
// that finds its CPU's cache held tries the other caches once each, then takes the lock-free
// fallback (a fresh chunk, or retire() for a free). The slow paths may call the system
// allocator and, on the caller-driven grace-period path, synchronize() outside any read
// section.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace grace::detail {

struct magazine {
  magazine* next = nullptr;     // link in a cache's waiting / ready / empty list
  std::uint64_t gp_cookie = 0;  // (P1) taken when the magazine was sealed
  std::uint32_t count = 0;
  std::uint32_t capacity;
  bool ready = false;           // (P2) its cookie elapsed (set when promoted)

  explicit magazine(std::uint32_t magazine_capacity) noexcept : capacity(magazine_capacity) {}

  void** objects() noexcept { return reinterpret_cast<void**>(this + 1); }
  bool full() const noexcept { return count == capacity; }
  bool empty() const noexcept { return count == 0; }

  static constexpr std::size_t bytes_for(std::uint32_t capacity) noexcept {
    return sizeof(magazine) + capacity * sizeof(void*);
  }
};

// A FIFO of magazines (oldest at head), owned by a cache holder.
struct magazine_fifo {
  magazine* head = nullptr;
  magazine* tail = nullptr;
  std::uint64_t objects = 0;

  void push_back(magazine* m) noexcept {
    m->next = nullptr;
    if (tail != nullptr) {
      tail->next = m;
    } else {
      head = m;
    }
    tail = m;
    objects += m->count;
  }
  void push_front(magazine* m) noexcept {
    m->next = head;
    head = m;
    if (tail == nullptr) tail = m;
    objects += m->count;
  }
  magazine* pop_front() noexcept {
    magazine* m = head;
    head = m->next;
    if (head == nullptr) tail = nullptr;
    objects -= m->count;
    m->next = nullptr;
    return m;
  }
};

struct chunk;

struct alignas(64) pool_cache {
  // The fast paths touch only this first cache line.
  std::atomic<bool> held{false};  // (A1)/(A2)
  // (P3): the plain fields below belong to the holder.
  magazine* loaded = nullptr;  // ready objects; allocate() pops from here
  magazine* freed = nullptr;   // deallocated objects, not yet sealed
  // Counters written by the holder (relaxed load + store, no RMW: holds are ordered by
  // (A1)/(A2)), summed by stats(). Relaxed: approximate by design.
  std::atomic<std::uint64_t> allocated{0};
  std::atomic<std::uint64_t> deallocated{0};

  magazine_fifo waiting;       // sealed, waiting for their cookie, oldest first
  magazine_fifo ready;         // full magazines whose cookie has elapsed
  magazine* empty = nullptr;   // spare empty magazines
  std::uint32_t empty_count = 0;
  std::uint32_t carved = 0;    // objects already cut from `carving`
  chunk* carving = nullptr;    // the chunk fresh objects are cut from
  std::uint64_t allocated_at_last_trim = 0;  // the idle trim's activity mark
  std::uint64_t allocated_at_last_shed = 0;  // deallocate_slow's: does this CPU allocate?
  std::uint32_t magazines_freed_without_allocating = 0;  // ... and for how long it has not
  std::atomic<std::uint64_t> reused{0};
  std::atomic<std::uint64_t> fresh{0};
  std::atomic<std::uint64_t> ready_gauge{0};    // refreshed on slow paths
  std::atomic<std::uint64_t> waiting_gauge{0};  // refreshed on slow paths
};

inline void bump(std::atomic<std::uint64_t>& counter, std::uint64_t by = 1) noexcept {
  // Relaxed load + store: only the cache holder writes the counter (P3).
  counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

}  // namespace grace::detail
