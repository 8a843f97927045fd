// Internal. Do not include directly.
//
// The retire pipeline's data structures.
//
//   retire()            GP thread                       reclaim worker
//   shard.open --full--> submitted_ --synchronize_rcu--> reclaim_queue_ --deleters--> spare
//   (per CPU)            (Treiber stack)                 (Treiber stack, FIFO on take)
//
// A retire_block is a page: a header and an array of (object, deleter) entries. Retirers on
// one CPU share that CPU's shard. shard.open holds the open block, nullptr, or shard_held():
// a thread takes the shard by exchanging shard_held() in, and gives it back by storing a
// block or nullptr. A thread that finds shard_held() did not take it (it wrote the same
// value back) and uses a block of its own.
//
// Invariants:
//   (I1) A block is owned by exactly one party at a time: the shard (in `open` or `spare`),
//        the one thread holding the shard, the submitted stack, the GP thread, or the reclaim
//        worker. Only the owner writes its entries.
//   (I0) A thread that holds a shard hands its block to submitted_ (or puts it back in
//        `open`) before it releases the shard. So a flusher that waits while the shard is
//        held, then takes `open`, misses no entry written before its flush began.
//   (I2) Every entry of a block in submitted_ was written before the block was pushed, and
//        was unreachable from shared memory when retire() was called (the caller's promise).
//   (I3) A block reaches the reclaim worker only after a grace period that began after it
//        was taken from submitted_ (or after gp_cookie elapsed); so every reader that could
//        see one of its objects has left its read section.
//   (I4) The reclaim worker takes nodes oldest first; a barrier_marker is reached only after
//        every node pushed to submitted_ before it has been reclaimed.
//
// Ordering guarantees:
//   (R1) Release CAS push onto submitted_ / reclaim_queue_ publishes the node's fields; pairs
//        with the Acquire exchange that takes the whole stack (R2).
//   (R2) Acquire exchange(nullptr) on submitted_ / reclaim_queue_; and the GP thread's Acquire
//        load of submitted_ that looks at the chain without taking it (hold_batch()).
//   (R3) Acquire exchange(shard_held()) on shard.open takes the shard and its block with the
//        entries written by the previous holder; pairs with the Release store (R4).
//   (R4) Release store of a block or nullptr to shard.open ends a hold; Release CAS
//        (nullptr -> block) on shard.spare recycles an empty block.
//
// Progress guarantees: retire() is lock-free: one exchange and one store on its shard; a
// thread that finds the shard held never waits for the holder, it submits a block of its
// own. Pushes onto the stacks are lock-free; takes are wait-free (one exchange). Flushing
// (the GP thread, barrier()) waits for a shard's holder: a handful of instructions unless
// the holder is preempted. Only the GP thread, the worker, barrier() and back-pressure block.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace grace::detail {

struct batch_node {
  enum class kind : std::uint8_t { objects, barrier };

  batch_node* next = nullptr;  // link in submitted_ or reclaim_queue_ (owner writes it)
  kind node_kind;

  explicit batch_node(kind k) noexcept : node_kind(k) {}
};

struct retire_entry {
  void* object;
  void (*deleter)(void*);
};

struct retire_block : batch_node {
  std::uint64_t gp_cookie = 0;  // domain::gp_cookie() taken when the block was submitted
  std::uint64_t bytes = 0;      // sum of the sizes retire() was given
  std::uint32_t count = 0;
  std::uint32_t capacity;
  std::uint32_t home_shard;     // the shard whose spare slots receive it when empty

  retire_block(std::uint32_t block_capacity, std::uint32_t shard) noexcept
      : batch_node(kind::objects), capacity(block_capacity), home_shard(shard) {}

  retire_entry* entries() noexcept { return reinterpret_cast<retire_entry*>(this + 1); }
  bool full() const noexcept { return count == capacity; }
  void push(void* object, void (*deleter)(void*), std::size_t object_bytes) noexcept {
    entries()[count++] = retire_entry{object, deleter};
    bytes += object_bytes;
  }

  static constexpr std::size_t bytes_for(std::uint32_t capacity) noexcept {
    return sizeof(retire_block) + capacity * sizeof(retire_entry);
  }
};

// A page-sized block: the kvfree_rcu() bulk-block size.
inline constexpr std::size_t kRetireBlockBytes = 4096;
inline constexpr std::uint32_t kRetireBlockCapacity =
    (kRetireBlockBytes - sizeof(retire_block)) / sizeof(retire_entry);
static_assert(retire_block::bytes_for(kRetireBlockCapacity) <= kRetireBlockBytes);
static_assert(alignof(retire_entry) <= alignof(retire_block));

// Empty blocks kept per shard for reuse (kvfree_rcu keeps 5 pages per CPU).
inline constexpr unsigned kSpareBlocksPerShard = 4;

// The value of shard.open while a thread holds the shard. Never dereferenced.
inline retire_block* shard_held() noexcept {
  return reinterpret_cast<retire_block*>(alignof(retire_block));
}

struct retire_shard {
  // The block retirers on this CPU append to, nullptr, or shard_held().
  alignas(64) std::atomic<retire_block*> open{nullptr};
  // Empty blocks, refilled by the reclaim worker (on another CPU: its own cache line).
  alignas(64) std::atomic<retire_block*> spare[kSpareBlocksPerShard]{};
};

// A node the reclaim worker marks done when it reaches it (I4); lives on barrier()'s stack.
struct barrier_marker : batch_node {
  std::atomic<std::uint32_t> done{0};
  barrier_marker() noexcept : batch_node(kind::barrier) {}
};

// Grace-period tickets: every synchronize_rcu() run through a domain takes a ticket first and
// raises `completed` to it afterwards. A cookie is `started + 1` read after the caller's
// unlink, so any ticket >= cookie belongs to a grace period that began after the unlink.
struct gp_sequence {
  alignas(64) std::atomic<std::uint64_t> started{0};
  alignas(64) std::atomic<std::uint64_t> completed{0};
};

}  // namespace grace::detail
