// Internal. Do not include directly.
//
// The object pool's data structures.
//
//   deallocate()                        allocate()
//      |                                   ^
//      v                                   |
//   cache.freed --full, stamped--> cache.waiting --cookie elapsed--> cache.ready -> cache.loaded
//   (per CPU)     with gp_cookie    (FIFO)                      surplus |  ^ (stack)
//                                                                     v  |
//                                  depot (slots of ready magazines, any CPU takes one)
//                                  full depot: surplus released to its chunks
//
// A magazine is an array of object pointers. Objects in the caches and the depot are never
// linked through their own memory: a reader may still be reading a freed object until its
// grace period ends, so the pool writes nothing into it. Objects are carved from 64 KiB
// chunks aligned to their size, so an object finds its chunk by masking its address. A
// chunk keeps a bitmap of its free slots: objects released to it are handed out again by
// the next refill before any new chunk is cut. A chunk whose every slot is free is kept for
// the next chunk a refill cuts, up to kRetainedChunks of them; the idle trim gives back
// those that no refill took for a whole pass (at its next pass), and a chunk past that
// number goes back at once.
//
// Invariants:
//   (P1) An object in `freed` or `waiting` has not been handed out since its deallocate().
//        A magazine's gp_cookie is taken after its last object was added.
//   (P2) An object in `ready` or `loaded` had its magazine's cookie elapsed (or came fresh
//        from a chunk): a full grace period has passed since its deallocate(). Only such
//        objects are handed out by allocate() (with reuse_after_gp; the `immediate` reference
//        mode skips the wait and is unsafe for readers).
//   (P3) A cache's lists are touched only by the thread holding it (held == true), and by a
//        restartable sequence on its CPU (P9). A holder waits for nothing but the pool's
//        system_allocator and, holding another CPU's cache, membarrier()'s fence (A8), which
//        waits for an IPI to that CPU and may wait for CPU hotplug: no lock of grace's or
//        the user's, fork gate, retire(), grace period, pool construction or destruction, or
//        pool_options::destroy (fork() relies on it: it holds every cache itself, waiting
//        for the holders; object_pool.cc).
//   (P4) A magazine in a depot slot is owned by the slot; it moves out by one exchange.
//        Only ready magazines enter the depot.
//   (P5) A chunk's free-slot bitmap and free_slots, and the pool's lists of chunks with
//        free slots (partial_head, partial_chunks) and of chunks with no slot in use
//        (retained, retained_old, retained_chunks, emptied), change only under the pool's
//        chunk lock. A slot is in exactly one place:
//        uncarved (at or past cache.carved of the cache carving the chunk, or on the
//        deferred chunk stack), handed out, in a magazine, on the deferred object stack, in
//        the hands of the holder that took that stack, or free (its bit set; free_slots
//        counts the bits). A chunk is on the partial list iff
//        0 < free_slots < capacity; at capacity it moves to `retained` (kept for reuse: a
//        refill that needs a new chunk takes it back, bitmap cleared, as uncarved) or, with
//        kRetainedChunks retained already, to `emptied`; the idle trim moves `retained_old`
//        to `emptied` and `retained` to `retained_old`; the holder frees `emptied` after
//        unlocking. Only objects past their grace period (from a ready magazine, a
//        retire() deleter, never handed out, or handed out but never seen:
//        deallocate_unconstructed(); or, without reuse_after_gp, any deallocated object)
//        are released, so a free slot may be handed out at once (P2). The lock is only
//        ever tried. It holds the fork generation it was taken under
//        (grace/reclaim/detail/fork.h, bumped in the child before grace starts any thread
//        there): a thread that finds it held under an older generation takes it over (the
//        holder was a thread of a parent) and rebuilds free_slots and the lists from the
//        bitmaps.
//   (P6) A release that finds the chunk lock held is deferred to the holder: objects onto
//        the deferred object stack, linked through their first word (they are free and past
//        their grace period: nobody reads them), an uncarved tail as its chunk onto the
//        deferred chunk stack. Pushes are CASes; the holder takes each stack whole (no ABA)
//        and frees its slots before it unlocks, and looks again after (A5), for at most
//        kDeferredPasses passes; what is left then waits for the next holder, and whoever
//        sees it once it holds no cache schedules the idle trim, which takes the lock.
//   (P7) With pool_options::destroy, a magazine whose `constructed` is set holds objects
//        still constructed: the `freed` and `waiting` ones (the depot holds only ready
//        magazines). A holder that finds one elapsed takes it out of the cache, recording
//        the take in a free slot of the cache's `finishing` (none free: it takes nothing),
//        so that destroy_deallocated() can wait for it; after the hold, release_and_finish() runs
//        destroy on each object (make_ready()) and files the magazine as ready. So destroy
//        never runs under a cache hold, and every object handed out, or released to a chunk,
//        has been destroyed (release_objects() destroys a constructed magazine's objects
//        first). A fork() child loses the takes its parent's other threads had in hand, and
//        frees their slots.
//   (P8) Fast paths (allocate() and deallocate(), in a restartable sequence or holding the
//        cache) only pop from `loaded` and push onto `freed` (or `loaded`, without
//        reuse_after_gp), bumping the magazine's `pushed`; they count nothing. Everything
//        else a slow path does under a hold that began with settle() and ends with
//        release_hold(): settle() adds the pops (loaded_mark + loaded->pushed -
//        loaded->count) and the pushes (`pushed` of loaded and freed) to the cache's
//        counters and zeroes `pushed`; release_hold() sets loaded_mark to loaded->count. So
//        `pushed` is 0 on every magazine but a cache's loaded and freed, and stats(), which
//        settles every cache it can hold, is exact when no operation is in flight.
//   (P9) A restartable sequence (detail/rseq_fast_path.h) works on the cache of the CPU it
//        runs on, and only if that CPU's number is below the number of caches; it checks
//        `held` and commits its pop or push with one store. The kernel restarts it (at its
//        abort label, which falls back to the held paths) if it is preempted, migrated or
//        signalled before the commit. So on each CPU's cache at most one sequence runs at a
//        time, and it never overlaps a hold (A8).
//
// Ordering guarantees:
//   (A1) Acquire exchange(true) on cache.held takes the cache with every change its previous
//        holder made; pairs with the Release store(false) that ended that hold (A2).
//   (A2) Release store(false) on cache.held.
//   (A3) Release CAS of a magazine into a depot slot publishes its contents; pairs with the
//        Acquire exchange that takes it (A4).
//   (A4) Acquire exchange(nullptr) on a depot slot.
//   (A5) The Acquire CAS that takes the chunk lock sees the bitmaps, the partial list and
//        the retained lists as the previous holder left them; pairs with the store that
//        ended that hold. The deferred stacks: CAS push, Acquire exchange take-all. A
//        pusher then tries the lock, and a holder looks at the stacks after its unlock:
//        the push, the pusher's load of the lock, the unlock and the holder's loads are
//        SeqCst (Dekker), so one of the two frees the pushed slots.
//   (A6) Release store of a new chunk into its record (after its header and cleared
//        bitmap); pairs with the Acquire load in the repair after a fork(), which may run
//        while another thread of the child cuts a chunk.
//   (A7) A finishing slot (P7): the end of a take is a Release store, and so is a claim,
//        whose Acquire check of the free slot carries on the destroy calls of the take it
//        replaces; destroy_deallocated()'s Acquire loads see the destroy calls of every take
//        whose end, or a later claim of its slot, they read.
//   (A8) A thread that takes cache i by exchange (A1) while a restartable sequence may run
//        on CPU i makes sure none is between its check of `held` and its commit before it
//        touches the cache: if it runs on CPU i itself after the exchange, any sequence
//        there was preempted by it (restarted, or committed before the switch, whose
//        barriers order the commit before the holder's reads); from any other CPU it calls
//        membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ) on CPU i, which restarts a
//        sequence running there and orders a committed one before the holder's reads. A
//        sequence that starts after that sees `held` set (x86-64's ordered stores and
//        loads; the sequence reads `held` before the fields it then reads). A hold's
//        release store (A2) is seen by later sequences with the holder's changes, in order.
//
// Progress guarantees: allocate() and deallocate() never wait for another thread. A thread
// that finds its CPU's cache held takes a bounded detour, then the lock-free fallback (a
// chunk's free slots or a new chunk, or retire() for a free):
//   - allocate() yields once, tries a restartable sequence (with them), then every cache
//     once, starting with the cache of the CPU it runs on after the yield;
//   - deallocate() with restartable sequences does the same;
//   - deallocate() without them tries every other cache once at once, no yield.
// A cache taken from another CPU than its own costs a fence (A8). The chunk lock is
// only ever tried: a refill that finds it held cuts a new chunk, a release defers (P6). The
// slow paths may call the system allocator and, on the caller-driven grace-period path,
// synchronize() outside any read section.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace grace::detail {

struct magazine {
  magazine* next = nullptr;     // link in a cache's waiting / ready / empty list
  std::uint64_t gp_cookie = 0;  // (P1) taken when the magazine was sealed
  // count and pushed form one 64-bit word, which a restartable push commits in one store.
  std::uint32_t count = 0;
  std::uint32_t pushed = 0;     // (P8) fast-path pushes since the last settle
  std::uint32_t capacity;
  bool constructed = false;     // (P7) its objects still wait for pool_options::destroy

  explicit magazine(std::uint32_t magazine_capacity) noexcept : capacity(magazine_capacity) {}

  void** objects() noexcept { return reinterpret_cast<void**>(this + 1); }
  bool full() const noexcept { return count == capacity; }
  bool empty() const noexcept { return count == 0; }

  // A fast path's pop and push (P8: counted at the next settle, not here).
  void* pop() noexcept { return objects()[--count]; }
  bool can_push() const noexcept { return !full() && pushed != kMaxPushed; }
  void push(void* object) noexcept {
    objects()[count++] = object;
    ++pushed;
  }
  static constexpr std::uint32_t kMaxPushed = 0xffffffff;

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

// Takes of constructed magazines out of one cache that may be finished at once (P7).
inline constexpr unsigned kFinishingSlots = 4;

struct alignas(64) pool_cache {
  // The fast paths touch only this first cache line.
  std::atomic<bool> held{false};  // (A1)/(A2)
  // (P3): the plain fields below belong to the holder.
  magazine* loaded = nullptr;  // ready objects; allocate() pops from here
  magazine* freed = nullptr;   // deallocated objects, not yet sealed
  std::uint32_t loaded_mark = 0;  // (P8) loaded->count at the end of the last slow hold
  // Counters written by slow-path holders (relaxed load + store, no RMW: holds are ordered
  // by (A1)/(A2)), summed by stats(). Relaxed: approximate by design.
  std::atomic<std::uint64_t> allocated{0};
  std::atomic<std::uint64_t> deallocated{0};

  magazine_fifo waiting;       // sealed, waiting for their cookie, oldest first
  magazine_fifo ready;         // full magazines whose cookie has elapsed
  magazine* empty = nullptr;   // spare empty magazines
  std::uint32_t empty_count = 0;
  std::uint32_t carved = 0;    // objects already cut from `carving`
  chunk* carving = nullptr;    // the chunk fresh objects are cut from
  std::uint64_t allocated_at_last_trim = 0;  // the idle trim's activity mark
  std::uint32_t idle_trim_passes = 0;  // trim passes in a row that found it idle
  std::uint64_t allocated_at_last_shed = 0;  // deallocate_slow's: does this CPU allocate?
  std::uint32_t magazines_freed_without_allocating = 0;  // ... and for how long it has not
  std::atomic<std::uint64_t> reused{0};
  std::atomic<std::uint64_t> fresh{0};
  std::atomic<std::uint64_t> reused_from_chunks{0};
  std::atomic<std::uint64_t> ready_gauge{0};    // refreshed on slow paths
  std::atomic<std::uint64_t> waiting_gauge{0};  // refreshed on slow paths
  // (P7): the takes of constructed magazines out of this cache still being finished. A slot
  // holds 2 x the take's number + 1 while its take is finished, an even value while free;
  // holders claim free slots (a hold that finds none takes nothing), release_and_finish() frees
  // them, and destroy_deallocated() waits for the takes it saw.
  std::atomic<std::uint64_t> finishing[kFinishingSlots] = {};
  std::uint64_t takes = 0;  // the holder's: numbers the takes
};

// Test seam: when set, every pool calls it at the end of each hold of its chunk lock, still
// holding the lock (tests/alloc/object_pool_chunk_lock_test.cc parks a thread there).
// Relaxed: set before the threads that call it start.
extern std::atomic<void (*)()> chunk_lock_held_hook;

inline void bump(std::atomic<std::uint64_t>& counter, std::uint64_t by = 1) noexcept {
  // Relaxed load + store: only the cache holder writes the counter (P3).
  counter.store(counter.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
}

}  // namespace grace::detail
