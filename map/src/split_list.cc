// The out-of-line paths of the split-ordered list: construction, resize, helping unlinks.
#include "grace/map/detail/split_list.h"

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <thread>
#include <type_traits>

#include "grace/reclaim/detail/fork.h"

namespace grace::detail {

constinit std::atomic<void (*)()> resize_half_way_hook{nullptr};

void untagged_check_failed(const void* address) noexcept {
  std::fprintf(stderr,
               "grace::hash_map: memory at %p has pointer bits 57-62 set (a tagged-pointer "
               "allocator, or Intel LAM_U57 enabled); the map keeps bucket tags in those bits "
               "and cannot use it.\n",
               address);
  std::abort();
}

namespace {

// The largest distance to a resize that the look schedule counts (beyond it: as good as never).
constexpr double kMaxLookDistance = 0x1p40;

unsigned log2_ceil(std::size_t n) noexcept {
  return static_cast<unsigned>(std::bit_width(std::max<std::size_t>(n, 1) - 1));
}

struct position {
  list_node* pred;
  std::uintptr_t cur_link;  // pred's link to the node found (unmarked, tag included), or 0
};

// Michael's search from `start` (a linked, unmarked dummy (L5)): returns the first unmarked
// node whose so_key is >= so_key (or > so_key when `past_equal`) and its predecessor,
// unlinking every marked node on the way (L3).
position locate(const split_list& list, list_node* start, std::uint64_t so_key,
                bool past_equal) noexcept {
retry:
  list_node* pred = start;
  // Acquire (M2): pairs with the Release CAS (M1) that linked the node.
  std::uintptr_t cur_link = pred->next.load(std::memory_order_acquire) & ~kMarked;
  for (;;) {
    list_node* cur = node_of(cur_link);
    if (cur == nullptr) return {pred, 0};
    // Acquire (M2): as above.
    const std::uintptr_t next = cur->next.load(std::memory_order_acquire);
    if (is_marked(next)) {
      std::uintptr_t expected = cur_link;
      // Release (M1): the successor stays visible to readers through pred; pairs with (M2).
      if (!pred->next.compare_exchange_strong(expected, next & ~kMarked,
                                              std::memory_order_release,
                                              std::memory_order_relaxed)) {
        goto retry;  // pred was deleted or changed under us
      }
      if (!is_dummy_link(cur_link)) list.reclaim(cur);  // (L3): this CAS unlinked it
      cur_link = next & ~kMarked;
      continue;
    }
    const std::uint64_t cur_key = list.so_key_at(cur_link);
    if (cur_key > so_key || (!past_equal && cur_key == so_key)) return {pred, cur_link};
    pred = cur;
    cur_link = next;
  }
}

}  // namespace

split_list::split_list(const hash_map_config& config, domain& reclamation, element_ops ops)
    : config_(config),
      domain_(reclamation),
      ops_(ops),
      min_log2_(log2_ceil(config.min_buckets)),
      max_log2_(log2_ceil(config.max_buckets)),
      counters_(std::make_unique<counter[]>(cpu_shard_count())),
      counter_mask_(cpu_shard_count() - 1),
      counts_by_sequences_(config.restartable_sequences && per_cpu_adds_available()) {
  dummy_node* level0 = allocate_level(0);
  if (level0 == nullptr) throw std::bad_alloc();
  // Relaxed: the map is not shared yet; publishing it to other threads orders this.
  levels_[0].store(level0, std::memory_order_relaxed);
  const unsigned initial =
      std::clamp(log2_ceil(config.initial_buckets), min_log2_, max_log2_);
  if (!grow_to(initial)) {
    for (unsigned level = initial; level > 0; --level) {
      if (dummy_node* array = levels_[level].load(std::memory_order_relaxed)) {
        free_level(array, level);
      }
    }
    free_level(level0, 0);
    throw std::bad_alloc();
  }
  // Relaxed: construction does not count as a resize.
  grows_.store(0, std::memory_order_relaxed);
}

split_list::~split_list() {
  for (unsigned level = 0; level < kMaxLevels; ++level) {
    // Relaxed: no operation is in flight (precondition).
    if (dummy_node* array = levels_[level].load(std::memory_order_relaxed)) {
      free_level(array, level);
    }
  }
}

namespace {
// Level arrays of at least this size are mapped on their own, aligned to it, and backed by
// transparent huge pages where the system allows (madvise mode): every lookup starts at a
// random dummy, and on 4 KiB pages a table of two million buckets (16 MiB) misses the TLB
// on almost every one.
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

void* map_huge(std::size_t bytes) noexcept {
  void* mapped = ::mmap(nullptr, bytes + kHugePageBytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(mapped);
  const std::uintptr_t aligned = (start + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  if (aligned != start) ::munmap(mapped, aligned - start);
  if (const std::size_t tail = start + kHugePageBytes - aligned; tail != 0) {
    ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  }
  // Advice only: without transparent huge pages the mapping works on small pages.
  ::madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

// A dummy, which carries its so_key (L1) where links carry no tags.
template <class Dummy>
void construct_dummy(Dummy* at, std::uint64_t so_key) noexcept {
  Dummy* dummy = new (at) Dummy();
  if constexpr (std::is_same_v<Dummy, keyed_node>) dummy->so_key = so_key;
}
}  // namespace

dummy_node* split_list::allocate_level(unsigned level) noexcept {
  const std::size_t count = level == 0 ? 1 : std::size_t{1} << (level - 1);
  const std::size_t bytes = count * sizeof(dummy_node);
  void* memory = bytes >= kHugePageBytes
                     ? map_huge(bytes)
                     : ::operator new(bytes, std::align_val_t{64}, std::nothrow);
  if (memory == nullptr) return nullptr;
  check_untagged(memory);
  auto* array = static_cast<dummy_node*>(memory);
  for (std::size_t i = 0; i < count; ++i) construct_dummy(&array[i], dummy_so_key(level, i));
  return array;
}

void split_list::free_level(dummy_node* array, unsigned level) noexcept {
  const std::size_t count = level == 0 ? 1 : std::size_t{1} << (level - 1);
  const std::size_t bytes = count * sizeof(dummy_node);
  for (std::size_t i = 0; i < count; ++i) array[i].~dummy_node();
  if (bytes >= kHugePageBytes) {
    ::munmap(array, bytes);
  } else {
    ::operator delete(array, std::align_val_t{64});
  }
}

std::size_t split_list::size() const noexcept {
  std::int64_t total = 0;
  // Relaxed: exact only when no update is in flight (documented).
  for (unsigned i = 0; i <= counter_mask_; ++i) {
    total += counters_[i].by_sequences.load(std::memory_order_relaxed) +
             counters_[i].by_atomic_adds.load(std::memory_order_relaxed);
  }
  return total > 0 ? static_cast<std::size_t>(total) : 0;
}

void split_list::link_dummy(list_node* start, unsigned level, std::uint64_t index) noexcept {
  // Relaxed: stored by this resizer before it links the level's dummies.
  dummy_node* dummy = &levels_[level].load(std::memory_order_relaxed)[index];
  for (;;) {
    const position at = locate(*this, start, dummy_so_key(level, index), /*past_equal=*/false);
    // Relaxed: published by the Release CAS below.
    dummy->next.store(at.cur_link, std::memory_order_relaxed);
    std::uintptr_t expected = at.cur_link;
    // Release (M1): the dummy's next, and its level's pointer (so_key_at()), are visible
    // before it is reachable.
    if (at.pred->next.compare_exchange_strong(expected, dummy_link(dummy, level),
                                              std::memory_order_release,
                                              std::memory_order_relaxed)) {
      return;
    }
  }
}

bool split_list::grow_to(unsigned target) noexcept {
  // Relaxed: only resizers (serialized by resizing_, or the constructor) store it.
  unsigned current = size_log2_.load(std::memory_order_relaxed);
  while (current < target) {
    const unsigned level = current + 1;
    dummy_node* array = allocate_level(level);
    if (array == nullptr) return false;  // stay at the current size; lookups still work
    const std::uint64_t first = std::uint64_t{1} << current;
    // Relaxed: published with the size below (M3), and to traversals that meet one of its
    // dummies by the CAS that links it (M1).
    levels_[level].store(array, std::memory_order_relaxed);
    // Each new dummy (prefix 2i+1) goes in after its parent's (prefix i at the current
    // size), whose elements it splits off (L1). The walk is an operation like any other and
    // holds a read section (L6): one per dummy, so a large grow does not hold back grace
    // periods.
    for (std::uint64_t i = 0; i < first; ++i) {
      if (i == first / 2) {
        // Relaxed: see resize_half_way_hook.
        if (auto hook = resize_half_way_hook.load(std::memory_order_relaxed)) [[unlikely]] {
          hook();
        }
      }
      read_guard guard;
      link_dummy(dummy_of_prefix(i, current), level, i);
    }
    // Release (M3): every new dummy is linked before any operation can start from one;
    // pairs with the Acquire load in bucket_of() (M4).
    size_log2_.store(level, std::memory_order_release);
    current = level;
    grows_.fetch_add(1, std::memory_order_relaxed);
  }
  return true;
}

void split_list::shrink_to(unsigned target) noexcept {
  // Relaxed: see grow_to().
  unsigned current = size_log2_.load(std::memory_order_relaxed);
  while (current > target) {
    // Release (M3): operations that start from now on use the smaller size.
    size_log2_.store(current - 1, std::memory_order_release);
    unlink_level(current);
    current = current - 1;
    shrinks_.fetch_add(1, std::memory_order_relaxed);
  }
}

void split_list::unlink_level(unsigned level) noexcept {
  // (L5): after this, no operation still uses one of the level's dummies as its starting
  // point.
  domain_.synchronize();
  // Relaxed: stored by this resizer (a shrink), or copied by the fork (L8).
  dummy_node* array = levels_[level].load(std::memory_order_relaxed);
  const std::uint64_t first = std::uint64_t{1} << (level - 1);
  for (std::uint64_t i = 0; i < first; ++i) {
    if (i == first / 2) {
      // Relaxed: see resize_half_way_hook.
      if (auto hook = resize_half_way_hook.load(std::memory_order_relaxed)) [[unlikely]] hook();
    }
    {
      read_guard guard;  // (L6), one per dummy: never across the synchronize() calls
      dummy_node* victim = &array[i];
      std::uintptr_t next = victim->next.load(std::memory_order_relaxed);
      // Release: mark the dummy deleted (L2); concurrent inserts after it now fail their CAS
      // and retry from a live predecessor. Pairs with the Acquire loads of `next` (M2). A
      // dummy a rolled-back shrink had marked already is left alone (L2).
      while (!is_marked(next) &&
             !victim->next.compare_exchange_weak(next, next | kMarked, std::memory_order_release,
                                                 std::memory_order_relaxed)) {
      }
      // Unlinks it, from its parent's dummy (prefix i), which stays.
      locate(*this, dummy_of_prefix(i, level - 1), dummy_so_key(level, i), /*past_equal=*/false);
    }
  }
  // Traversals that were passing through the unlinked dummies have finished.
  domain_.synchronize();
  // Relaxed: nothing can reach the level any more.
  levels_[level].store(nullptr, std::memory_order_relaxed);
  free_level(array, level);
}

bool split_list::try_begin_resize() noexcept {
  const std::uint32_t mine = (process_fork_generation() << 1) | 1;
  // Relaxed: only chooses the expected value; the CAS below orders.
  std::uint32_t seen = resizing_.load(std::memory_order_relaxed);
  for (;;) {
    // Another thread of this process resizes. (A tag is never newer than ours: the
    // generation only grows from parent to child.)
    if (seen == mine) return false;
    // Free (0), or held under an older generation by a thread this process does not have.
    // Acquire: the previous resizer's levels and size; pairs with end_resize()'s Release
    // store (a copied turn: the fork orders what its holder wrote).
    if (resizing_.compare_exchange_weak(seen, mine, std::memory_order_acquire,
                                        std::memory_order_relaxed)) {
      return true;
    }
  }
}

void split_list::end_resize() noexcept {
  // Release: this resize's levels and size before the next resizer's; pairs with the Acquire
  // CAS in try_begin_resize().
  resizing_.store(0, std::memory_order_release);
}

bool split_list::roll_back_abandoned_level() noexcept {
  // Relaxed (both): only resizers store them, and we hold the turn.
  const unsigned size_log2 = size_log2_.load(std::memory_order_relaxed);
  if (size_log2 + 1 >= kMaxLevels ||
      levels_[size_log2 + 1].load(std::memory_order_relaxed) == nullptr) [[likely]] {
    return true;
  }
  if (in_read_section()) return false;
  unlink_level(size_log2 + 1);
  return true;
}

bool split_list::consider_resize_slow() noexcept {
  if (!try_begin_resize()) return false;  // one resizer at a time
  look_and_resize();
  return true;
}

void split_list::resize_if_due() noexcept {
  if (!wait_for_turn()) return;  // inside a read section, behind another resizer
  look_and_resize();
}

bool split_list::wait_for_turn() noexcept {
  // Outside a read section wait; inside one only try: a shrink holding the turn waits for
  // this very read section.
  while (!try_begin_resize()) {
    if (in_read_section()) return false;
    std::this_thread::yield();
  }
  return true;
}

bool split_list::begin_turn_work() noexcept {
  if (roll_back_abandoned_level()) return true;
  schedule_next_look(0);  // inside a read section: look again soon
  end_resize();
  return false;
}

void split_list::end_turn(std::size_t elements) noexcept {
  // Relaxed: we are the only resizer.
  schedule_next_look(
      changes_until_resize_due(elements, size_log2_.load(std::memory_order_relaxed)));
  end_resize();
}

void split_list::look_and_resize() noexcept {
  if (!begin_turn_work()) return;
  const std::size_t elements = size();
  // Relaxed: we are the only resizer.
  const unsigned current = size_log2_.load(std::memory_order_relaxed);
  const double buckets = std::ldexp(1.0, static_cast<int>(current));
  const auto count = static_cast<double>(elements);
  if (count > buckets * config_.grow_load_factor && current < max_log2_) {
    grow_to(log2_for_buckets(std::floor(count / config_.grow_load_factor) + 1));
  } else if (const unsigned floor = floor_log2();
             count < buckets * config_.shrink_load_factor && current > floor &&
             !in_read_section()) {
    // Hysteresis: shrink to half the grow load factor, not to the edge of growing again.
    shrink_to(std::max(floor,
                       log2_for_buckets(std::floor(2.0 * count / config_.grow_load_factor) + 1)));
  }
  // Relaxed: as above. A resize took time (a shrink waits for grace periods): count again.
  end_turn(size_log2_.load(std::memory_order_relaxed) == current ? elements : size());
}

std::uint64_t split_list::changes_until_resize_due(std::size_t elements,
                                                   unsigned size_log2) const noexcept {
  const double buckets = std::ldexp(1.0, static_cast<int>(size_log2));
  const auto count = static_cast<double>(elements);
  double distance = kMaxLookDistance;
  if (size_log2 < max_log2_) distance = buckets * config_.grow_load_factor - count;
  if (size_log2 > floor_log2()) {
    // A shrink the caller's read section held back is due now: distance 0.
    distance = std::min(distance, count - buckets * config_.shrink_load_factor);
  }
  return distance <= 0 ? 0 : static_cast<std::uint64_t>(std::min(distance, kMaxLookDistance));
}

void split_list::schedule_next_look(std::uint64_t distance) noexcept {
  // Every CPU looks after its own share of the distance: by the time the size has moved
  // that far, at least one of them has.
  const std::uint64_t share = distance / (std::uint64_t{counter_mask_} + 1);
  // Relaxed: we are the only resizer.
  const std::uint64_t at_least =
      size_log2_.load(std::memory_order_relaxed) > 8 ? kLookIntervalFloor : 1;
  // Relaxed: see the member.
  look_interval_.store(std::max(share, at_least), std::memory_order_relaxed);
}

void split_list::reserve(std::size_t elements) {
  const unsigned target =
      log2_for_buckets(static_cast<double>(elements) / config_.grow_load_factor);
  if (!wait_for_turn() || !begin_turn_work()) {
    // Inside a read section, behind another resizer or a rollback: no grow (best effort,
    // see hash_map::reserve()), but the reservation still keeps the table from shrinking.
    raise_reservation(elements);
    return;
  }
  const bool grown = grow_to(target);
  // Only a table that did grow is reserved: a reservation left by a failed grow would keep
  // the levels it built from ever shrinking. Holding the turn, no shrink runs before this.
  if (grown) raise_reservation(elements);
  // Looks that came due meanwhile found the turn taken: the next one is ours to set.
  end_turn(size());
  if (!grown) throw std::bad_alloc();
}

void split_list::raise_reservation(std::size_t elements) noexcept {
  // Relaxed: a floor the resizer reads (see reserved_elements_).
  std::size_t reserved = reserved_elements_.load(std::memory_order_relaxed);
  while (reserved < elements &&
         !reserved_elements_.compare_exchange_weak(reserved, elements, std::memory_order_relaxed)) {
  }
}

unsigned split_list::floor_log2() const noexcept {
  // Relaxed: see reserved_elements_.
  const std::size_t reserved = reserved_elements_.load(std::memory_order_relaxed);
  if (reserved == 0) return min_log2_;
  return std::max(min_log2_,
                  log2_for_buckets(static_cast<double>(reserved) / config_.grow_load_factor));
}

unsigned split_list::log2_for_buckets(double buckets) const noexcept {
  const double wanted = std::ceil(buckets);
  if (!(wanted < std::ldexp(1.0, static_cast<int>(max_log2_)))) return max_log2_;
  return log2_ceil(static_cast<std::size_t>(wanted));
}

void split_list::unlink_slow(list_node* start, keyed_node* element) noexcept {
  locate(*this, start, element->so_key, /*past_equal=*/true);
}

}  // namespace grace::detail
