// Internal. Do not include directly.
//
// The lock-free core of grace::hash_map: one split-ordered list (Shalev & Shavit, JACM 2006)
// of every element, with one dummy node per bucket marking where that bucket's elements
// begin. Deletion follows Michael (SPAA 2002): a node is deleted by setting the mark bit of
// its own `next`, then unlinked by a CAS on its predecessor's `next`.
//
// The list is sorted by so_key. An element's so_key is its hash times a Fibonacci constant
// (or the hash itself, for a Hash that avalanches), with bit 0 set; at 2^k buckets its
// bucket is its so_key's top k bits, its prefix. A dummy's so_key is its bucket's prefix
// followed by zeros. Growing to 2^(k+1) splits bucket t into 2t, whose dummy is t's, and
// 2t+1, whose new dummy lands in the middle of t's elements. This is Shalev & Shavit's list
// with its buckets renamed: they take a bucket from the hash's low bits and sort by the
// reversed hash (their bucket t splits into t and t + 2^k); taking it from the top bits sorts
// by the so_key itself, without the ~20 instructions of a reversal on every operation
// (map/README.md, "The algorithm" item 5; map/MEASUREMENTS.md, "Session 11: buckets from
// the top bits").
//
//   size 4:  d(00) -> e(00..) -> d(01) -> e(01..) -> e(01..) -> d(10) -> d(11) -> e(11..)
//
// Dummies live in levels that are never copied or moved: level 0 holds the dummy of prefix
// 0, and level L (L >= 1) the dummies of the L-bit prefixes that end in 1, in order (entry i:
// prefix 2i+1). At 2^k buckets, prefix t's dummy is that of t without its z trailing zeros:
// entry t >> (z + 1) of level k - z. The dummies are the level arrays' entries, so a lookup
// goes hash -> level array entry (the dummy) -> first element, with no bucket-pointer array
// in between. Where links carry tags (L7) a dummy is its `next` alone, 8 bytes: its level
// comes from the tag of any link to it, its so_key from its place in the level. Growing
// inserts the next level's dummies into the list and publishes the larger size; no element
// moves. Shrinking publishes the smaller size, waits one grace
// period (no operation starts from the top level's dummies any more), unlinks those dummies,
// and frees the level after another grace period.
//
// Invariants:
//   (L1) The list is sorted by so_key (ties only between elements whose hashes give the same
//        so_key). A dummy's so_key is even, an element's odd; all so_keys of dummies are
//        distinct.
//   (L2) A node whose `next` is marked is logically deleted; its `next` never changes again.
//        Only an unmarked node's `next` is ever CASed.
//   (L3) A node is unlinked by exactly one successful CAS on its live predecessor's `next`;
//        that CAS's thread reclaims it (elements only: dummies belong to their level).
//   (L4) An element is replaced by marking it with the new element as its successor: the
//        new element carries the same key and so_key, so every traversal that passes the old
//        one (it skips marked nodes) reaches the new one. A node's key, so_key and value never
//        change while it is reachable.
//   (L5) At 2^size_log2 buckets every bucket has its dummy (levels 0..size_log2) linked;
//        dummies of levels above it are never a starting point for an operation that began
//        after the size was published.
//   (L6) A node is reclaimed (returned to the pool, reused after a grace period) only after
//        it was unlinked, and every operation runs inside a read section: no operation can
//        hold a node that is reused under it, so no CAS suffers ABA.
//   (L7) A `next` link carries, besides the mark bit, a tag that is a pure function of the
//        successor it points to: 0 for an element (element_link()), 1 + level for a dummy of
//        that level (dummy_link()). Every link value is built by one of them, by the resizer
//        that knows the dummy's level, or keeps the bits of one that was, so
//        a CAS's expected value always matches. Since the successor never changes level, a
//        link's tag is as stable as its pointer. A lookup that started from bucket b at size
//        2^k stops at a link tagged with a level <= k without touching the node: that
//        dummy's so_key ends in at least 64 - k zeros, so it is the dummy of a bucket at size
//        2^k; it follows b's in the list, so its prefix is larger than b's and its so_key
//        exceeds every key of b's elements (L1).
//   (L8) Between two resizes, levels_[size_log2 + 1] is null: a grow stores a level only
//        once it is allocated and publishes its size before it ends; a shrink frees its
//        level before it ends. A level there at the start of a resize was left by a resizer
//        that a fork() copied mid-way (its thread is not in this process); every resize
//        first rolls it back as a shrink ends one: size_log2 already excludes it (a grow had
//        not published it, a shrink had), so unlinking its dummies and freeing it after
//        grace periods is safe whichever it was.
//
// Ordering guarantees:
//   (M1) Release CAS of a predecessor's `next` (insert, replace, unlink) publishes the new
//        node's fields and, for a dummy, its level's pointer, read by so_key_at(); pairs
//        with the Acquire loads of `next` in every traversal (M2).
//   (M2) Acquire load of a `next`.
//   (M3) Release store of size_log2 publishes the linked dummies of a new level and the
//        level pointer; pairs with the Acquire load in bucket_of() (M4).
//   (M4) Acquire load of size_log2.
//
// Progress guarantees: lookups are wait-free in the absence of unbounded insertion before
// them in the same bucket, never block, never help, and write no shared memory. Updates are
// lock-free: a CAS fails only because another operation succeeded. A resize is serialized
// with other resizes (a resizer triggered by an update skips if another runs; reserve()
// outside a read section waits its turn) and never with readers or updaters. In the child
// of a fork() that copied a resize mid-way, resizes inside a read section are skipped until
// one outside has rolled the abandoned level back (L8). After its
// linearization point, outside its read section, an update may do housekeeping that
// blocks: a shrink (it waits for grace periods), or a grace period the element pool asks
// its thread to run (object_pool's caller_gp_threshold).
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "grace/alloc/detail/rseq_fast_path.h"
#include "grace/reclaim/detail/cpu.h"
#include "grace/reclaim/domain.h"

namespace grace::detail {

inline constexpr std::uintptr_t kMarked = 1;
// Level 0 plus levels 1..48: up to 2^48 buckets.
inline constexpr unsigned kMaxLevels = 49;
// The fewest changes of the size a CPU counts between two looks at the load factor, once the
// table has more than 256 buckets (look_interval_).
inline constexpr std::uint64_t kLookIntervalFloor = 64;

// (L7): the successor's level tag lives in pointer bits 57..62, which x86-64 user-space
// addresses never use (47 bits, or 56 with 5-level paging) unless pointer tagging is on:
// HWASan and Intel LAM_U57 tag exactly those bits, so builds with HWASan carry no link tags,
// and check_untagged() stops a process whose allocator returns tagged addresses. Other
// targets (aarch64 top-byte tags, 32-bit) carry no tags: lookups read every successor, and
// dummies carry their so_keys. (Defining GRACE_MAP_LINK_TAGS=0 builds that layout here too:
// tests/map does, to test it.)
#if defined(__x86_64__) && defined(__LP64__) && !defined(__SANITIZE_HWADDRESS__)
#if defined(__has_feature)
#if __has_feature(hwaddress_sanitizer)
#define GRACE_MAP_LINK_TAGS 0
#endif
#endif
#ifndef GRACE_MAP_LINK_TAGS
#define GRACE_MAP_LINK_TAGS 1
#endif
#elif defined(GRACE_MAP_LINK_TAGS) && GRACE_MAP_LINK_TAGS
#error "GRACE_MAP_LINK_TAGS=1 needs x86-64 without HWASan: elsewhere links carry no tags"
#else
#undef GRACE_MAP_LINK_TAGS
#define GRACE_MAP_LINK_TAGS 0
#endif
inline constexpr bool kLinkTags = GRACE_MAP_LINK_TAGS;
// The layout is part of split_list's ABI: its out-of-line members, built into the grace::map
// library, must see links as the code that calls them does. This tag goes into the mangled
// name of every member, so a translation unit built with the other layout (its own
// GRACE_MAP_LINK_TAGS, or HWASan in one part of a program) fails to link, naming the tag it
// misses, instead of walking the library's list with the wrong layout.
#if GRACE_MAP_LINK_TAGS
#define GRACE_MAP_LAYOUT_ABI_TAG "link_tags"
#else
#define GRACE_MAP_LAYOUT_ABI_TAG "no_link_tags"
#endif
inline constexpr unsigned kTagShift = 57;
inline constexpr std::uintptr_t kTagMask =
    kLinkTags ? static_cast<std::uintptr_t>(std::uint64_t{0x3F} << kTagShift) : 0;
static_assert(kMaxLevels + 1 <= 0x3F, "a level tag must fit in six bits");

// Nodes must not come with the tag bits set (a tagged-pointer allocator): abort, naming it.
[[gnu::cold, gnu::noinline]] void untagged_check_failed(const void* address) noexcept;
inline void check_untagged(const void* address) noexcept {
  if ((reinterpret_cast<std::uintptr_t>(address) & kTagMask) != 0) [[unlikely]] {
    untagged_check_failed(address);
  }
}

// Every node of the list. Where links carry tags (L7), this is all of a dummy: 8 bytes, its
// so_key implied by its place in its level (split_list::so_key_at()).
struct list_node {
  std::atomic<std::uintptr_t> next{0};  // successor | its tag (L7) | kMarked
};
// An element (hash_map's node derives from it), and a dummy where links carry no tags.
struct keyed_node : list_node {
  std::uint64_t so_key = 0;  // (L1) split-order key
};
using dummy_node = std::conditional_t<kLinkTags, list_node, keyed_node>;

inline list_node* node_of(std::uintptr_t link) noexcept {
  return reinterpret_cast<list_node*>(link & ~(kMarked | kTagMask));
}
inline bool is_marked(std::uintptr_t link) noexcept { return (link & kMarked) != 0; }
// (L7): the level tag of a link: 0 for an element (or the end), 1 + level for a dummy.
inline unsigned tag_of(std::uintptr_t link) noexcept {
  // Bit 63 of a user-space link is 0, so the shift leaves the tag alone.
  return static_cast<unsigned>(static_cast<std::uint64_t>(link) >> kTagShift);
}
// Whether the node a non-null `link` points to is a dummy: by the link's tag (L7), or, where
// links carry none, by the node's so_key (L1: a dummy's is even).
inline bool is_dummy_link(std::uintptr_t link) noexcept {
  if constexpr (kLinkTags) return tag_of(link) != 0;
  return (static_cast<const keyed_node*>(node_of(link))->so_key & 1) == 0;
}

// 2^64 divided by the golden ratio (Fibonacci hashing): bit j of the product depends on bits
// 0..j of the hash, so the top bits, which choose the bucket, depend on all of them. A Hash
// whose entropy sits in its low bits (std::hash of an integer is the identity) still spreads.
inline constexpr std::uint64_t kSoKeyMultiplier = 0x9E3779B97F4A7C15ull;

// (L1): an element's so_key is odd. An `avalanching` 64-bit hash, each of whose bits depends
// on every bit of the key, is taken as it is: the multiply would only lengthen the path from
// the key to its bucket's dummy (map/MEASUREMENTS.md, "Session 11: buckets from the top bits").
inline std::uint64_t element_so_key(std::uint64_t hash, bool avalanching) noexcept {
  return (avalanching ? hash : hash * kSoKeyMultiplier) | 1;
}
// (L1): the so_key of entry `index` of `level`: its prefix, 2 x index + 1 in `level` bits,
// followed by zeros (0 for level 0's only entry).
inline std::uint64_t dummy_so_key(unsigned level, std::uint64_t index) noexcept {
  return level == 0 ? 0 : (2 * index + 1) << (64 - level);
}
// The bucket of `so_key` at 2^size_log2 buckets: its top size_log2 bits, in two shifts (at
// size 2^0 a single one would shift by 64).
constexpr std::uint64_t prefix_of(std::uint64_t so_key, unsigned size_log2) noexcept {
  return (so_key >> 1) >> (63 - size_log2);
}
// Where the dummy of the bucket whose prefix, `bits` long, is `prefix` lives: it is that of
// the prefix without its z trailing zeros, entry prefix >> (z + 1) of level bits - z. The
// bit set above the prefix gives prefix 0 z = bits: level 0, entry 0.
struct dummy_position {
  unsigned level;
  std::uint64_t index;
};
constexpr dummy_position dummy_position_of(std::uint64_t prefix, unsigned bits) noexcept {
  const auto zeros =
      static_cast<unsigned>(std::countr_zero(prefix | (std::uint64_t{1} << bits)));
  return {bits - zeros, prefix >> (zeros + 1)};
}

// (L7): the link to an element (tag 0), and to the dummy of `level`.
inline std::uintptr_t element_link(const keyed_node* element) noexcept {
  return reinterpret_cast<std::uintptr_t>(element);
}
inline std::uintptr_t dummy_link(const list_node* dummy, unsigned level) noexcept {
  const auto address = reinterpret_cast<std::uintptr_t>(dummy);
  if constexpr (!kLinkTags) return address;
  return address | ((std::uintptr_t{level} + 1) << kTagShift);
}
// (L7): whether `link` points to a dummy of level <= size_log2, one of a bucket at
// 2^size_log2 buckets, which ends the elements of any such bucket that precede it.
inline bool ends_bucket(std::uintptr_t link, unsigned size_log2) noexcept {
  if constexpr (!kLinkTags) return false;
  // Unsigned wrap turns tag 0 (an element) into a huge value:
  // tag - 1 < size_log2 + 1 <=> 1 <= tag <= size_log2 + 1.
  return tag_of(link) - 1u < size_log2 + 1u;
}

// Type erasure for the out-of-line paths (abseil's PolicyFunctions): how to reclaim an
// element this core unlinked while helping.
struct element_ops {
  void (*reclaim)(void* map, list_node* element) noexcept;
  void* map;
};

struct hash_map_config {
  std::size_t initial_buckets;
  std::size_t min_buckets;
  std::size_t max_buckets;
  double grow_load_factor;
  double shrink_load_factor;
  // pool_options::restartable_sequences: false keeps the element count off them too.
  bool restartable_sequences;
};

class [[gnu::abi_tag(GRACE_MAP_LAYOUT_ABI_TAG)]] split_list {
 public:
  // Throws std::bad_alloc; the levels for config.initial_buckets are built at once.
  split_list(const hash_map_config& config, domain& reclamation, element_ops ops);
  // Frees the levels. Requires: no operation in flight; the owner has released elements.
  ~split_list();

  split_list(const split_list&) = delete;
  split_list& operator=(const split_list&) = delete;

  // The dummy of the bucket that an element's `so_key` falls in at the current size.
  list_node* bucket_of(std::uint64_t so_key) const noexcept {
    unsigned size_log2;
    return bucket_of(so_key, size_log2);
  }
  // The same, and the size (log2) it was taken at, for ends_bucket() (L7).
  list_node* bucket_of(std::uint64_t so_key, unsigned& size_log2) const noexcept {
    // Acquire (M4): the dummies of every bucket at that size are linked; pairs with (M3).
    size_log2 = size_log2_.load(std::memory_order_acquire);
    return dummy_of_prefix(prefix_of(so_key, size_log2), size_log2);
  }
  list_node* head() const noexcept { return dummy_of_prefix(0, 0); }

  // (L1): the so_key of the node a non-null `link` points to. A dummy's, where links carry
  // tags, comes from the tag (its level) and its place in that level's array; the caller
  // holds a read section, so the level outlives the link (L6: a shrink frees a level only
  // after a grace period since its dummies were unlinked).
  std::uint64_t so_key_at(std::uintptr_t link) const noexcept {
    if constexpr (kLinkTags) {
      if (const unsigned tag = tag_of(link); tag != 0) {
        // Relaxed: the level was stored before its dummies were linked (M1), and that store
        // happens-before this load: through the Acquire load that found this link (M2), and
        // through every Release CAS and store that copied the link on its way (M1).
        const dummy_node* level = levels_[tag - 1].load(std::memory_order_relaxed);
        const auto* dummy = static_cast<const dummy_node*>(node_of(link));
        return dummy_so_key(tag - 1, static_cast<std::uint64_t>(dummy - level));
      }
    }
    return static_cast<const keyed_node*>(node_of(link))->so_key;
  }

  // Element count bookkeeping: per-CPU counters, summed on read (size()). The add is a
  // restartable sequence where the process may use them, not a locked instruction: ~20%
  // more batch_add_batch_del (map/MEASUREMENTS.md, "Session 22").
  void count(std::int64_t delta) noexcept {
    counter& mine = counters_[current_cpu() & counter_mask_];
    if (!counts_by_sequences_ ||
        !rseq_add<kCounterShift>(&counters_[0].by_sequences, counter_mask_ + 1, delta)) {
      // Relaxed: a count, summed on read. Any CPU's word will do: the add is atomic.
      mine.by_atomic_adds.fetch_add(delta, std::memory_order_relaxed);
    }
    // Look at the load factor once this CPU has counted look_interval_ changes since its
    // last look. Counting changes, not sampling keys, bounds how far the size drifts between
    // two looks whichever keys change. Relaxed: the count is a hint; a lost increment only
    // delays a look.
    const std::uint64_t magnitude = delta < 0 ? 0 - static_cast<std::uint64_t>(delta)
                                              : static_cast<std::uint64_t>(delta);
    const std::uint64_t changes = mine.changes.load(std::memory_order_relaxed) + magnitude;
    if (changes >= look_interval_.load(std::memory_order_relaxed)) [[unlikely]] {
      // If another thread holds the turn, its look may have missed these changes, and only
      // its end sets the next look: try again after kLookIntervalFloor more (or at once, for
      // short intervals).
      const bool looked = consider_resize_slow();
      mine.changes.store(looked || changes < kLookIntervalFloor ? 0 : changes - kLookIntervalFloor,
                         std::memory_order_relaxed);
      return;
    }
    mine.changes.store(changes, std::memory_order_relaxed);
  }
  std::size_t size() const noexcept;
  std::size_t bucket_count() const noexcept {
    return std::size_t{1} << size_log2_.load(std::memory_order_relaxed);
  }
  std::uint64_t grows() const noexcept { return grows_.load(std::memory_order_relaxed); }
  std::uint64_t shrinks() const noexcept { return shrinks_.load(std::memory_order_relaxed); }

  // Grows until `elements` fit under the grow load factor (bounded by max_buckets), and keeps
  // shrinks from going below that size until drop_reservation(). Inside a read section it
  // only tries: if another resize runs, or a level must first be rolled back (L8), it
  // returns without growing.
  void reserve(std::size_t elements);
  // Forgets what reserve() asked for (clear()).
  void drop_reservation() noexcept {
    reserved_elements_.store(0, std::memory_order_relaxed);  // Relaxed: see the member.
    // A shrink may be due now. Relaxed: see the member.
    look_interval_.store(1, std::memory_order_relaxed);
  }
  // Resizes if the load factor left [shrink, grow]. Grows inline; shrinks, and rolls back a
  // level a fork() left (L8), only outside a read section (they wait for grace periods),
  // otherwise leaves them for a later update; never shrinks below what reserve() asked for.
  // False, without looking, if another thread holds the resizer's turn.
  [[gnu::cold, gnu::noinline]] bool consider_resize_slow() noexcept;
  // The same, but outside a read section it waits for the turn (clear(): whatever a resizer
  // that ran meanwhile decided, the look that counts comes after the clear).
  void resize_if_due() noexcept;

  // Unlinks `node` (already marked) from the list if still linked, helping along the way;
  // used by updaters whose own unlink CAS failed. Type-erased: reclaims through element_ops.
  [[gnu::cold, gnu::noinline]] void unlink_slow(list_node* start, keyed_node* element) noexcept;

  // Calls the owner's reclaim for an element this thread unlinked (L3).
  void reclaim(list_node* element) const noexcept { ops_.reclaim(ops_.map, element); }

  domain& reclamation() const noexcept { return domain_; }

 private:
  // Inserts minus erases on one CPU are by_sequences + by_atomic_adds: a thread adds to the
  // first by rseq_add(), which commits only on the CPU it read, and to the second, with an
  // atomic add, where it cannot (no rseq, or restarted); a plain add there could lose a
  // concurrent atomic one.
  struct alignas(64) counter {
    std::atomic<std::int64_t> by_sequences{0};  // written only by rseq_add(); read Relaxed
    std::atomic<std::int64_t> by_atomic_adds{0};
    std::atomic<std::uint64_t> changes{0};  // elements counted on this CPU since its last look
  };
  static constexpr int kCounterShift = 6;
  static_assert(sizeof(counter) == std::size_t{1} << kCounterShift, "rseq_add's stride");

  // The dummy of the bucket whose prefix, `bits` long, is `prefix` (dummy_position_of()).
  dummy_node* dummy_of_prefix(std::uint64_t prefix, unsigned bits) const noexcept {
    const dummy_position at = dummy_position_of(prefix, bits);
    // Relaxed: ordered by the Acquire load of size_log2 (M4) that bounded `bits`.
    return levels_[at.level].load(std::memory_order_relaxed) + at.index;
  }
  // The resizer's turn (resizing_). try_begin_resize() takes it, or returns false while another
  // thread of this process holds it; a turn held under an older fork generation was copied
  // from a thread the process does not have, and is taken over.
  bool try_begin_resize() noexcept;
  // Outside a read section, waits for the turn; inside one only tries. True if it has it.
  bool wait_for_turn() noexcept;
  void end_resize() noexcept;
  // Holding the turn, before any resize: rolls back a level a fork() left (L8). False, with
  // the turn ended and a look soon, if that must wait for a caller outside a read section.
  bool begin_turn_work() noexcept;
  // Ends the turn, setting the next look from `elements` at the current size.
  void end_turn(std::size_t elements) noexcept;
  // Holding the turn: looks at the load factor, resizes if due, and ends the turn.
  void look_and_resize() noexcept;
  // (L8): rolls back a level a fork() left mid-resize. False if there is one and the caller
  // is inside a read section (rolling back waits for grace periods): resize later.
  bool roll_back_abandoned_level() noexcept;
  bool grow_to(unsigned size_log2) noexcept;
  unsigned floor_log2() const noexcept;  // the smallest size a shrink may reach
  void raise_reservation(std::size_t elements) noexcept;  // reserved_elements_ = max(it, n)
  // log2 of the smallest power of two of at least `buckets`, at most max_log2_: safe for any
  // value, where converting a double past SIZE_MAX to an integer is undefined.
  unsigned log2_for_buckets(double buckets) const noexcept;
  // How many changes of the size may pass, from `elements` at 2^size_log2 buckets, before a
  // grow or shrink can be due (0: one is due, or held back by the caller's read section).
  std::uint64_t changes_until_resize_due(std::size_t elements, unsigned size_log2) const noexcept;
  // The resizer, after every look: sets look_interval_ from that distance.
  void schedule_next_look(std::uint64_t distance) noexcept;
  void shrink_to(unsigned size_log2) noexcept;
  // Marks and unlinks the dummies of `level`, which size_log2 already excludes, then frees
  // it: the end of a shrink, and the roll-back of (L8).
  void unlink_level(unsigned level) noexcept;
  // Links entry `index` of `level` (its array stored in levels_) after `start`.
  void link_dummy(list_node* start, unsigned level, std::uint64_t index) noexcept;
  dummy_node* allocate_level(unsigned level) noexcept;
  void free_level(dummy_node* level_array, unsigned level) noexcept;

  hash_map_config config_;
  domain& domain_;
  element_ops ops_;
  unsigned min_log2_;
  unsigned max_log2_;
  // The element count reserve() asked room for: shrinking stops at the size it needs until
  // clear(). 0: none. Relaxed: a hint for the one resizer.
  std::atomic<std::size_t> reserved_elements_{0};
  std::atomic<unsigned> size_log2_{0};
  // Changes of the size each CPU counts between two looks at the load factor: a share of
  // the distance to the nearest threshold (no resize can be due before the size has moved
  // that far), but at least kLookIntervalFloor once the table has more than 256 buckets, so
  // that the size's drift past a threshold stays bounded and the sum of counters stays
  // cheap. Relaxed: a hint that every turn of the resizer (a look, reserve()) sets before it
  // ends; a CPU whose look found the turn taken tries again kLookIntervalFloor changes later;
  // clear() takes a turn to look.
  std::atomic<std::uint64_t> look_interval_{1};
  std::atomic<dummy_node*> levels_[kMaxLevels]{};
  // 0, or (the fork generation of the process whose thread resizes << 1) | 1.
  std::atomic<std::uint32_t> resizing_{0};
  std::atomic<std::uint64_t> grows_{0};
  std::atomic<std::uint64_t> shrinks_{0};
  std::unique_ptr<counter[]> counters_;
  unsigned counter_mask_;
  bool counts_by_sequences_;  // rseq_add() may commit: asked at construction
};

// Test seam: called by a resizer half-way through linking (grow) or unlinking (shrink) a
// level's dummies, between two of its read sections (a grow may run inside the caller's
// own), so that another thread can fork() there; not fork() from the hook itself (the
// child would keep a live resizer under an older turn). Relaxed loads: a test sets it before
// the threads it coordinates start.
extern std::atomic<void (*)()> resize_half_way_hook;

}  // namespace grace::detail
