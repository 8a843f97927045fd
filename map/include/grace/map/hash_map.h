// grace::hash_map: a lock-free hash map with grace-period memory reclamation built in.
//
// A drop-in for a mutex around std::unordered_map, for maps shared between threads:
//
//   grace::hash_map<std::uint64_t, session> sessions;
//   sessions.insert_or_assign(id, session{...});      // lock-free (see below)
//   if (auto s = sessions.find(id)) use(*s);          // wait-free, writes no shared memory*
//   sessions.visit(id, [](const session& s) { ... }); // no copy, under a read guard
//   auto view = sessions.pin();                       // zero-copy reads while `view` lives
//   const session* s = view.find(id);
//   { auto g = grace::pin(); for (...) sessions.insert_or_assign(...); }  // one read section
//                                                     // for a batch of updates
//
// How it differs from std::unordered_map:
//   - Every member is safe to call from any number of threads at once.
//   - A value is never modified in place: assign/update/insert_or_assign publish a new
//     element and retire the old one, so a reader holding a pointer (visit, pin) keeps
//     seeing a complete, unchanging value until it leaves its read section.
//   - No iterators: for_each() visits every element present for the whole iteration
//     exactly once, even across concurrent resizes.
//   - size() is exact only when no update is in flight.
//   - Any Hash spreads: the map multiplies its result by 2^64/phi and takes the bucket from
//     the top bits. A 64-bit Hash whose every result bit depends on every bit of the key may
//     skip that by declaring `using is_avalanching = std::true_type;`; absl::Hash, the
//     default, is taken as one.
//   - Neither copyable nor movable (readers hold pointers into it): keep it where it is
//     built, or behind a std::unique_ptr.
//   - An erased or replaced element's ~Key and ~Value run after a grace period, not inside
//     erase(), assign() or insert_or_assign(): on the domain's reclaim worker thread, or,
//     with hash_map_options::destruction = element_destruction::by_updaters, inside a later
//     update on the same CPU (faster for values that own memory, such as std::string).
//   - Updates take no lock, but one may wait for a grace period: the update that leaves its
//     CPU with pool_options::caller_gp_threshold elements waiting for reuse runs one (0
//     turns that off), a shrink waits for some (shrink_load_factor 0 turns shrinking off),
//     and so does a retire() under its domain's back-pressure. A grace period waits for every
//     read section in the process, so a thread must not wait for another thread's update
//     while it holds one (a pin(), a guard, a callback of visit, for_each, update or
//     erase_if): each would wait for the other.
//   - update()'s and erase_if()'s callbacks must not update the map: they run again when
//     another update of the key wins the race, and one that updates that key makes its
//     caller lose every race (GRACE_CHECK_MISUSE builds throw std::logic_error).
//   * With GRACE_CHECK_MISUSE (debug builds), each operation also counts itself in a
//     shared counter, so that ~hash_map() can report a map destroyed while in use.
//
// Elements come from a grace::object_pool and go back to it when erased or replaced; the
// pool hands them out again only after a grace period. The table grows and shrinks on its
// own (load factors with hysteresis, bounded by min/max buckets); growing never moves an
// element, shrinking waits for grace periods and runs only outside read sections.
//
// Algorithm and proofs: map/README.md; invariants and ordering: detail/split_list.h.
#pragma once

#include <absl/hash/hash.h>

#include <algorithm>
#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "grace/alloc/object_pool.h"
#include "grace/map/detail/split_list.h"
#include "grace/map/fwd.h"
#include "grace/reclaim/domain.h"

// Misuse checks: with GRACE_CHECK_MISUSE set to 1 (the default when NDEBUG is not defined),
// every operation and pinned view counts itself in flight, and ~hash_map() aborts with a
// message naming the map if any is (a map destroyed while another thread still uses it).
// The count is a shared write per operation, so release builds leave it out. No layout
// depends on it: a map or pinned view shared by code built with and without it (a release
// library, a debug program) is the same object to both, and only the checks differ. Define
// it alike everywhere all the same: inline functions that differ break the ODR.
#ifndef GRACE_CHECK_MISUSE
#ifdef NDEBUG
#define GRACE_CHECK_MISUSE 0
#else
#define GRACE_CHECK_MISUSE 1
#endif
#endif

namespace grace {

// Where an erased or replaced element's destructor runs, always after a grace period (only
// for a Key or Value that is not trivially destructible). map/README.md, "Destroying erased
// elements", has the measurements.
enum class element_destruction : int {
  // Retired through the domain, destroyed on its reclaim worker thread, then pooled:
  // domain::barrier() waits for it. The destructor may do anything but wait for a grace
  // period.
  on_reclaim_worker,
  // Pooled still constructed, and destroyed a magazine at a time (16 KiB of elements: 186
  // of 88 bytes) once the grace period is over, by the thread whose update on that CPU finds it
  // over (inside that update and its read section), or by the pool's idle trim on the
  // reclaim worker within tens of milliseconds: the memory the elements own is freed where
  // it was mostly allocated, and the element is reused without a second grace period
  // (2.4-3x the update rate of on_reclaim_worker with std::string values). The
  // destructor must not wait for a grace period, nor take a lock that a thread updating
  // the map may hold. domain::barrier() does not wait for it: destroy_erased() and clear()
  // do.
  by_updaters,
};

struct hash_map_options {
  // Buckets at construction, rounded up to a power of two and clamped to [min, max]; min and
  // max are rounded up to powers of two as well.
  std::size_t initial_buckets = 64;
  std::size_t min_buckets = 64;
  std::size_t max_buckets = std::size_t{1} << 30;
  // Elements per bucket above which the table grows, and below which it shrinks. Growing
  // aims at this load factor; shrinking at half of it (hysteresis), and shrink_load_factor
  // must stay below that half. The defaults spend 16 to 32 bytes of buckets per element
  // after a grow, and up to 128 before a shrink: grow at 0.5 where a bucket costs 8 bytes
  // (x86-64), so a lookup passes ~1.25 elements where at 1.0 it passes ~1.5 (map/MEASUREMENTS.md,
  // "Session 19"); 1.0 where links carry no tags and a bucket costs 16 (split_list.h, L7).
  // The shrink default is an eighth of the grow default in both, so that a shrink lands at
  // twice the shrink load factor or more, and the next erases do not shrink again.
  static constexpr double kDefaultGrowLoadFactor = detail::kLinkTags ? 0.5 : 1.0;
  double grow_load_factor = kDefaultGrowLoadFactor;
  double shrink_load_factor = kDefaultGrowLoadFactor / 8;
  // The domain whose grace periods protect readers; nullptr means domain::global().
  domain* reclamation = nullptr;
  // The element pool's tuning (watermarks, caller-driven grace periods, allocator); its
  // destroy hook belongs to the map (see `destruction`) and must stay null.
  pool_options pool{};
  element_destruction destruction = element_destruction::on_reclaim_worker;
};

// Approximate snapshot; fields are not mutually consistent.
struct hash_map_stats {
  std::uint64_t size = 0;
  std::uint64_t buckets = 0;
  std::uint64_t grows = 0;
  std::uint64_t shrinks = 0;
  pool_stats pool;
  domain_stats reclamation;
};

namespace detail {
hash_map_config validate_hash_map_options(const hash_map_options& options);

// True when Key is a std::basic_string and K converts to its std::basic_string_view.
template <class Key, class K>
inline constexpr bool views_string_v = false;
template <class Char, class Traits, class Allocator, class K>
inline constexpr bool views_string_v<std::basic_string<Char, Traits, Allocator>, K> =
    std::is_convertible_v<const K&, std::basic_string_view<Char, Traits>>;
// Whether every bit of Hash's result depends on every bit of the key, so that the map may
// take the hash's top bits as they are (split_list.h, element_so_key()): absl::Hash does,
// and any Hash may say so with `using is_avalanching = std::true_type;` (or `= void`, as
// Boost.Unordered before 1.86 and ankerl::unordered_dense spell it).
template <class Hash>
inline constexpr bool avalanching_v =
    requires { requires std::is_void_v<typename Hash::is_avalanching>; } ||
    requires { requires Hash::is_avalanching::value; };
template <class T>
inline constexpr bool avalanching_v<absl::Hash<T>> = true;
// Whether the map takes Hash's result for Key as it is: it avalanches, and is 64 bits wide.
// A narrower hash (absl::Hash on a 32-bit target) would leave the top bits, which choose the
// bucket, zero: it is multiplied whatever it declares.
template <class Hash, class Key>
inline constexpr bool hash_taken_as_it_is_v =
    avalanching_v<Hash> &&
    sizeof(std::invoke_result_t<const Hash&, const Key&>) >= sizeof(std::uint64_t);
#if GRACE_CHECK_MISUSE
// The maps whose update() f or erase_if() pred this thread is running, innermost first: a
// stack of frames on the callers' stacks.
struct retried_callback_frame {
  const void* map;
  const retried_callback_frame* outer;
};
inline thread_local const retried_callback_frame* retried_callbacks = nullptr;
#endif
}  // namespace detail

template <class Key, class Value, class Hash, class KeyEqual>
class hash_map {
  struct node : detail::keyed_node {
    Key key;
    Value value;

    template <class K, class... Args>
    node(std::uint64_t split_key, K&& k, Args&&... args)
        : key(std::forward<K>(k)), value(std::forward<Args>(args)...) {
      so_key = split_key;
    }
  };
  static_assert(sizeof(node) <= object_pool::max_object_size,
                "grace::hash_map: an element (key, value and 16 bytes of links) must fit "
                "grace::object_pool::max_object_size; hold a large value behind a pointer");
  static constexpr bool kTrivialNode =
      std::is_trivially_destructible_v<Key> && std::is_trivially_destructible_v<Value>;

  // Every operation and pinned view runs inside one: a read section, and the in-flight count
  // that ~hash_map() checks when GRACE_CHECK_MISUSE is on.
  // Its layout is the same whatever GRACE_CHECK_MISUSE is, as the map's is (see
  // operations_in_flight_), so a pinned_view passed between translation units built with
  // and without the checks is the same object to both.
  class operation_scope {
   public:
    explicit operation_scope(const hash_map& map) noexcept : map_(map) {
#if GRACE_CHECK_MISUSE
      // Relaxed: a diagnostic; a destructor racing with the increment may miss it.
      map_.operations_in_flight_.fetch_add(1, std::memory_order_relaxed);
#endif
    }
    ~operation_scope() {
#if GRACE_CHECK_MISUSE
      map_.operations_in_flight_.fetch_sub(1, std::memory_order_relaxed);  // Relaxed: as above.
#endif
    }
    operation_scope(const operation_scope&) = delete;
    operation_scope& operator=(const operation_scope&) = delete;

   private:
    read_guard guard_;
    [[maybe_unused]] const hash_map& map_;
  };

 public:
  using key_type = Key;
  using mapped_type = Value;
  using hasher = Hash;
  using key_equal = KeyEqual;

  // The key types the reads and erases take: Key, and, when Hash and KeyEqual are both
  // transparent, any K that they accept (other types still convert to a Key).
  template <class K>
  static constexpr bool lookup_key =
      std::is_same_v<K, Key> ||
      (requires { typename Hash::is_transparent; } &&
       requires { typename KeyEqual::is_transparent; } &&
       std::is_invocable_v<const Hash&, const K&> &&
       std::is_invocable_r_v<bool, const KeyEqual&, const Key&, const K&>);

  // Throws std::invalid_argument naming a bad option, std::bad_alloc.
  explicit hash_map(hash_map_options options = {}, const Hash& hash = Hash(),
                    const KeyEqual& equal = KeyEqual())
      : config_(detail::validate_hash_map_options(options)),
        domain_(options.reclamation != nullptr ? *options.reclamation : domain::global()),
        pool_(sizeof(node), node_pool_options(options), domain_),
        hash_(hash),
        equal_(equal),
        list_(config_, domain_, detail::element_ops{&reclaim_element, this}) {}

  // Releases every element in bulk and waits for grace periods once (the pool's barrier).
  // Requires: no other thread uses the map any more (checked with GRACE_CHECK_MISUSE), and
  // the caller holds no read_guard.
  ~hash_map() {
    check_unused();
    check_not_in_read_section();
    destroy_all();
  }

  hash_map(const hash_map&) = delete;
  hash_map& operator=(const hash_map&) = delete;

  // --- reads: wait-free, no shared writes -------------------------------------------------

  // Each read and erase that takes a key also takes, when Hash and KeyEqual both declare
  // is_transparent, any K they accept without building a Key (heterogeneous lookup, as in
  // std::unordered_map): find(std::string_view) on std::string keys allocates nothing.
  // hash(k) must equal hash(Key(k)), and KeyEqual must agree with it.

  // A copy of the value: for a Value that cannot be copied, read it with visit() or pin().
  std::optional<Value> find(const Key& key) const
    requires std::copy_constructible<Value>
  {
    return find<Key>(key);
  }
  template <class K>
    requires lookup_key<K> && std::copy_constructible<Value>
  std::optional<Value> find(const K& key) const {
    auto guard = pin_reader();
    const node* n = lookup(key);
    if (n == nullptr) return std::nullopt;
    return n->value;
  }
  bool contains(const Key& key) const { return contains<Key>(key); }
  template <class K>
    requires lookup_key<K>
  bool contains(const K& key) const {
    auto guard = pin_reader();
    return lookup(key) != nullptr;
  }
  // std::unordered_map's spelling of contains(): 1 or 0.
  std::size_t count(const Key& key) const { return count<Key>(key); }
  template <class K>
    requires lookup_key<K>
  std::size_t count(const K& key) const {
    return contains(key) ? 1 : 0;
  }
  // Calls f(const Value&) inside a read section, without copying; false if absent.
  template <class F>
  bool visit(const Key& key, F&& f) const {
    return visit<Key, F>(key, std::forward<F>(f));
  }
  template <class K, class F>
    requires lookup_key<K>
  bool visit(const K& key, F&& f) const {
    auto guard = pin_reader();
    const node* n = lookup(key);
    if (n == nullptr) return false;
    std::forward<F>(f)(n->value);
    return true;
  }

  // Zero-copy reads: pointers from find() stay valid while the view lives (it holds a
  // read_guard: keep it short, and never call synchronize() or barrier() meanwhile).
  class pinned_view {
   public:
    const Value* find(const Key& key) const { return find<Key>(key); }
    template <class K>
      requires lookup_key<K>
    const Value* find(const K& key) const {
      const node* n = map_.lookup(key);
      return n == nullptr ? nullptr : &n->value;
    }
    bool contains(const Key& key) const { return contains<Key>(key); }
    template <class K>
      requires lookup_key<K>
    bool contains(const K& key) const {
      return map_.lookup(key) != nullptr;
    }

   private:
    friend class hash_map;
    explicit pinned_view(const hash_map& map) noexcept : in_flight_(map), map_(map) {}
    operation_scope in_flight_;
    const hash_map& map_;
  };
  [[nodiscard]] pinned_view pin() const noexcept { return pinned_view(*this); }

  // --- updates: lock-free -------------------------------------------------------------------

  // Inserts if absent (BPF_NOEXIST). The value is built only when the key is absent at the
  // time of the check; a racing insert of the same key makes it go back to the pool unused.
  // A key passed as an rvalue is moved into the element, and moved back if the element is
  // not inserted (where Key is move-assignable): the key was present, a racing insert won,
  // or Hash or KeyEqual threw. Only an exception from Value's constructor, which runs after
  // the key moved in, leaves it moved from.
  bool insert(const Key& key, Value value) { return try_emplace(key, std::move(value)); }
  bool insert(Key&& key, Value value) { return try_emplace(std::move(key), std::move(value)); }
  template <class... Args>
  bool try_emplace(const Key& key, Args&&... args) {
    return emplace_if_absent(so_key_of(key), key, std::forward<Args>(args)...);
  }
  template <class... Args>
  bool try_emplace(Key&& key, Args&&... args) {
    const std::uint64_t so_key = so_key_of(std::as_const(key));
    return emplace_if_absent(so_key, std::move(key), std::forward<Args>(args)...);
  }

  // Inserts or replaces (BPF_ANY); true if inserted. An rvalue key is moved into the element.
  bool insert_or_assign(const Key& key, Value value) {
    return store(key, std::move(value));
  }
  bool insert_or_assign(Key&& key, Value value) { return store(std::move(key), std::move(value)); }

  // Replaces if present (BPF_EXIST); false if absent. The replacement holds a copy of the key.
  bool assign(const Key& key, Value value)
    requires std::copy_constructible<Key>
  {
    check_not_in_retried_callback();
    const std::uint64_t so_key = so_key_of(key);
    auto guard = pin_reader();
    detail::list_node* start;
    if (lookup_in_bucket(so_key, key, start) == nullptr) return false;
    node* fresh = make_node(so_key, key, std::move(value));
    return discard_on_throw(fresh, [&] {
             return upsert(start, fresh, key, /*may_insert=*/false);
           }) == upsert_result::replaced;
  }

  // Atomically replaces the value with f(old); f may run again if another update wins the
  // race, and must not update the map (GRACE_CHECK_MISUSE: std::logic_error); reading it is
  // fine. False if absent.
  template <class F>
  bool update(const Key& key, F&& f)
    requires std::copy_constructible<Key>
  {
    return update_hashed(so_key_of(key), key, f);
  }

  // Replaces the value with f(old) if the key is present, else inserts `value` (a counter's
  // "++counts[key]": insert_or_update(key, 1, [](auto n) { return n + 1; })); true if
  // inserted. Each attempt is one update() or one insert, retried while a racing update of
  // the key turns presence around; f is as in update().
  template <class F>
  bool insert_or_update(const Key& key, const Value& value, F&& f)
    requires std::copy_constructible<Key> && std::copy_constructible<Value>
  {
    const std::uint64_t so_key = so_key_of(key);  // once for every attempt
    for (;;) {
      if (update_hashed(so_key, key, f)) return false;
      if (emplace_if_absent(so_key, key, value)) return true;
    }
  }

  bool erase(const Key& key) { return erase<Key>(key); }
  template <class K>
    requires lookup_key<K>
  bool erase(const K& key) {
    return erase_if(key, [](const Value&) { return true; });
  }
  // Erases if pred(value) holds for the current value; false if absent or pred says no.
  // pred runs again if another update of the key wins the race; like update()'s f, it must
  // not update the map.
  template <class Pred>
  bool erase_if(const Key& key, Pred&& pred) {
    return erase_if<Key, Pred>(key, std::forward<Pred>(pred));
  }
  template <class K, class Pred>
    requires lookup_key<K>
  bool erase_if(const K& key, Pred&& pred) {
    check_not_in_retried_callback();
    const std::uint64_t so_key = so_key_of(key);
    bool erased = false;
    {
      auto guard = pin_reader();
      detail::list_node* start = list_.bucket_of(so_key);
      for (;;) {
        position at = search(start, key, so_key);
        if (at.found == nullptr ||
            !run_retried_callback(pred, static_cast<const Value&>(at.found->value))) {
          break;
        }
        if (remove(start, at)) {
          erased = true;
          break;
        }
      }
    }
    if (erased) list_.count(-1);
    return erased;
  }

  // Erases every element for which pred(key, value) holds, in one walk (std::erase_if for
  // this map); returns how many it erased. Elements inserted or replaced during the walk
  // may or may not be looked at; pred runs again, on the new value, for an element replaced
  // between its check and its erase, and must not update the map. The walk is one read
  // section: the erased elements wait for a grace period that starts after it.
  template <class Pred>
    requires std::is_invocable_r_v<bool, Pred&, const Key&, const Value&>
  std::size_t erase_if(Pred pred) {
    check_not_in_retried_callback();
    std::size_t erased = 0;
    for_each([&](const Key& key, const Value&) {
      // The element's own key: it stays readable for the rest of this read section.
      if (erase_if(key, [&](const Value& current) { return pred(key, current); })) ++erased;
    });
    // The erases ran inside the walk's read section, where a due shrink waits (it waits for
    // grace periods): look at the load factor now, as clear() does.
    if (erased != 0) list_.resize_if_due();
    return erased;
  }

  // Erases the key and returns the value it had when erased; nullopt if absent.
  std::optional<Value> extract(const Key& key)
    requires std::copy_constructible<Value>
  {
    return extract<Key>(key);
  }
  template <class K>
    requires lookup_key<K> && std::copy_constructible<Value>
  std::optional<Value> extract(const K& key) {
    std::optional<Value> taken;
    // The predicate runs once per attempt; the copy of the attempt that erases is kept.
    if (!erase_if(key, [&](const Value& value) {
          taken.emplace(value);
          return true;
        })) {
      return std::nullopt;
    }
    return taken;
  }

  // --- whole map ------------------------------------------------------------------------------

  // Exact when no update is in flight.
  std::size_t size() const noexcept { return list_.size(); }
  bool empty() const noexcept { return size() == 0; }
  // The table's size now (it grows and shrinks on its own), and size() over it.
  std::size_t bucket_count() const noexcept { return list_.bucket_count(); }
  float load_factor() const noexcept {
    return static_cast<float>(size()) / static_cast<float>(bucket_count());
  }
  // The load factor above which the table grows (hash_map_options::grow_load_factor).
  float max_load_factor() const noexcept { return static_cast<float>(config_.grow_load_factor); }
  Hash hash_function() const { return hash_; }
  KeyEqual key_eq() const { return equal_; }
  // Grows the table so `n` elements fit under the grow load factor, and never shrinks it
  // below that size again until clear(), so a workload that swings between empty and n
  // elements never resizes (like std::unordered_map::reserve(), whose buckets stay; a
  // smaller n than an earlier one changes nothing). Inside a read section it is best effort:
  // it skips growing if another resize is running (waiting could deadlock), or, in the child
  // of a fork() that copied a resize mid-way, until a resize outside a read section has
  // rolled it back.
  void reserve(std::size_t n) {
    check_not_in_retried_callback();
    list_.reserve(n);
  }

  // Erases every element. Concurrent updates may leave elements inserted meanwhile. Outside
  // a read section it then waits once (destroy_erased()) so that erased elements with
  // non-trivial destructors have been destroyed when it returns.
  void clear() {
    check_not_in_retried_callback();
    list_.drop_reservation();
    erase_all();
    // One update of many elements, or none (an empty map that only had a reservation):
    // look at the load factor now, not at the next scheduled look.
    list_.resize_if_due();
  }

  // Returns once every element erased or replaced before the call has been destroyed: one
  // domain::barrier(), or, with element_destruction::by_updaters, the pool's
  // destroy_deallocated(), which waits for a grace period and runs the due destructors on
  // this thread. Throws std::logic_error inside a read section.
  void destroy_erased() {
    if (pool_destroys_elements()) {
      pool_.destroy_deallocated();
    } else {
      domain_.barrier();
    }
  }

  // Calls f(const Key&, const Value&) for every element, in no particular order, inside one
  // read section: every element present for the whole call is visited exactly once, even
  // across concurrent resizes; elements inserted or erased meanwhile may or may not be. An f
  // that returns bool stops the walk by returning false.
  template <class F>
  void for_each(F&& f) const {
    auto guard = pin_reader();
    const node* last = nullptr;
    // Acquire (M2): pairs with (M1).
    std::uintptr_t link = list_.head()->next.load(std::memory_order_acquire);
    while (const detail::list_node* cur = detail::node_of(link)) {
      const bool dummy = detail::is_dummy_link(link);
      // Acquire (M2): as above.
      link = cur->next.load(std::memory_order_acquire);
      if (dummy || detail::is_marked(link)) continue;
      const node* element = static_cast<const node*>(cur);
      // (L4): a replacement sits right after the element it replaced: visit the key once.
      if (last != nullptr && last->so_key == element->so_key && equal_(last->key, element->key)) {
        continue;
      }
      if constexpr (std::is_same_v<std::invoke_result_t<F&, const Key&, const Value&>, bool>) {
        if (!f(static_cast<const Key&>(element->key), static_cast<const Value&>(element->value))) {
          return;
        }
      } else {
        f(static_cast<const Key&>(element->key), static_cast<const Value&>(element->value));
      }
      last = element;
    }
  }

  hash_map_stats stats() const noexcept {
    hash_map_stats s;
    s.size = size();
    s.buckets = list_.bucket_count();
    s.grows = list_.grows();
    s.shrinks = list_.shrinks();
    s.pool = pool_.stats();
    s.reclamation = domain_.stats();
    return s;
  }

  domain& reclamation_domain() const noexcept { return domain_; }

 private:
  struct position {
    detail::list_node* pred;
    std::uintptr_t cur_link;  // pred's link to the first node at or past the key's place
    node* found;              // the live element with the key, or nullptr
  };

  // A node is aligned for its Key and Value whatever alignment the caller asks for; a larger
  // one is kept (a cache line, say). With element_destruction::by_updaters the pool destroys
  // the elements it gets back (validate_hash_map_options() rejects a caller's hook).
  static pool_options node_pool_options(const hash_map_options& options) {
    pool_options pool = options.pool;
    pool.alignment = std::max(pool.alignment, alignof(node));
    if (!kTrivialNode && options.destruction == element_destruction::by_updaters) {
      pool.destroy = &destroy_node;
    }
    return pool;
  }
  static void destroy_node(void* element) noexcept { static_cast<node*>(element)->~node(); }
  // Whether elements go back to the pool still constructed (element_destruction::by_updaters).
  bool pool_destroys_elements() const noexcept {
    return !kTrivialNode && pool_.options().destroy != nullptr;
  }

  operation_scope pin_reader() const noexcept { return operation_scope(*this); }

  // update()'s f and erase_if()'s pred run again whenever another update of their key wins;
  // one that updates the map itself, directly or through other maps' callbacks, would make
  // its caller lose for ever. GRACE_CHECK_MISUSE builds keep a stack of the maps whose such
  // callbacks the thread is running, and every update looks for its own map in it.
  template <class F, class... Args>
  decltype(auto) run_retried_callback(F& f, Args&&... args) const {
#if GRACE_CHECK_MISUSE
    struct push_frame {
      detail::retried_callback_frame frame;
      explicit push_frame(const void* map) : frame{map, detail::retried_callbacks} {
        detail::retried_callbacks = &frame;
      }
      ~push_frame() { detail::retried_callbacks = frame.outer; }
    } pushed(this);
#endif
    return f(std::forward<Args>(args)...);
  }
  void check_not_in_retried_callback() const {
#if GRACE_CHECK_MISUSE
    for (const detail::retried_callback_frame* frame = detail::retried_callbacks;
         frame != nullptr; frame = frame->outer) {
      if (frame->map != this) continue;
      throw std::logic_error(
          "grace::hash_map: the map updated from inside its own update() f or erase_if() "
          "pred, which run again whenever another update of the key wins: the outer call "
          "would never finish");
    }
#endif
  }

  // The destructor waits for grace periods, which would wait for the caller's own section.
  void check_not_in_read_section() const noexcept {
    if (in_read_section()) {
      std::fprintf(stderr,
                   "grace::hash_map at %p destroyed inside a read section (a grace::pin() guard, "
                   "a pinned view or a callback of some map): its destructor waits for grace "
                   "periods, which would wait for that section. Destroy it after the section "
                   "ends.\n",
                   static_cast<const void*>(this));
      std::abort();
    }
  }
  void check_unused() const noexcept {
#if GRACE_CHECK_MISUSE
    // Relaxed: see operation_scope.
    const std::uint64_t in_flight = operations_in_flight_.load(std::memory_order_relaxed);
    if (in_flight != 0) {
      std::fprintf(stderr,
                   "grace::hash_map at %p destroyed while %llu operation(s) or pinned view(s) "
                   "on it are still in flight: every thread must be done with a map before it "
                   "is destroyed.\n",
                   static_cast<const void*>(this), static_cast<unsigned long long>(in_flight));
      std::abort();
    }
#endif
  }

  template <class K, class... Args>
  node* make_node(std::uint64_t so_key, K&& key, Args&&... args) {
    void* memory = pool_.allocate();
    try {
      detail::check_untagged(memory);
      return new (memory) node(so_key, std::forward<K>(key), std::forward<Args>(args)...);
    } catch (...) {
      pool_.deallocate_unconstructed(memory);
      throw;
    }
  }
  // update() and insert_or_update(), `so_key` being the key's.
  template <class F>
  bool update_hashed(std::uint64_t so_key, const Key& key, F& f) {
    check_not_in_retried_callback();
    auto guard = pin_reader();
    detail::list_node* start = list_.bucket_of(so_key);
    for (;;) {
      position at = search(start, key, so_key);
      if (at.found == nullptr) return false;
      node* fresh = make_node(
          so_key, key, run_retried_callback(f, static_cast<const Value&>(at.found->value)));
      if (replace(start, at, fresh)) return true;
      discard(fresh);
    }
  }
  // try_emplace(), insert() and insert_or_update(), `so_key` being the key's; K is const
  // Key& or Key.
  template <class K, class... Args>
  bool emplace_if_absent(std::uint64_t so_key, K&& key, Args&&... args) {
    check_not_in_retried_callback();
    bool inserted;
    {
      auto guard = pin_reader();
      detail::list_node* start;
      if (lookup_in_bucket(so_key, std::as_const(key), start) != nullptr) return false;
      node* fresh = make_node(so_key, std::forward<K>(key), std::forward<Args>(args)...);
      // The element's own key from here on: the caller's may have been moved into it.
      try {
        inserted = link_new(start, fresh, fresh->key);
      } catch (...) {
        give_back_and_discard<K>(key, fresh);  // link_new publishes nothing before it throws
        throw;
      }
      if (!inserted) give_back_and_discard<K>(key, fresh);
    }
    if (inserted) list_.count(+1);
    return inserted;
  }
  // An element that was never published is still ours alone: the caller gets back the key
  // it moved in (K is emplace_if_absent's: Key for an rvalue), and the element goes back to
  // the pool even if that move throws.
  template <class K>
  void give_back_and_discard(std::remove_reference_t<K>& key, node* fresh) {
    struct discard_on_exit {
      hash_map& map;
      node* element;
      ~discard_on_exit() { map.discard(element); }
    } discard_later{*this, fresh};
    if constexpr (!std::is_reference_v<K> && std::is_move_assignable_v<Key>) {
      key = std::move(fresh->key);
    }
  }
  // insert_or_assign(); K is const Key& or Key.
  template <class K>
  bool store(K&& key, Value&& value) {
    check_not_in_retried_callback();
    const std::uint64_t so_key = so_key_of(std::as_const(key));
    bool inserted;
    {
      auto guard = pin_reader();
      node* fresh = make_node(so_key, std::forward<K>(key), std::move(value));
      // The element's own key: the caller's may have been moved into it. It stays readable
      // after fresh is published, for this read section keeps fresh from reclamation.
      inserted = discard_on_throw(fresh, [&] {
        return upsert(list_.bucket_of(so_key), fresh, fresh->key, /*may_insert=*/true);
      }) == upsert_result::inserted;
    }
    if (inserted) list_.count(+1);
    return inserted;
  }

  // A node that was never published.
  void discard(node* n) noexcept {
    if (!pool_destroys_elements()) n->~node();
    pool_.deallocate(n);
  }
  // Runs `link` (which may throw from Hash or KeyEqual before it publishes `fresh`), and
  // discards `fresh` if it throws.
  template <class Link>
  auto discard_on_throw(node* fresh, Link&& link) {
    try {
      return link();
    } catch (...) {
      discard(fresh);
      throw;
    }
  }

  // (L3): an unlinked element goes back to the pool; the pool reuses it only after a grace
  // period. With a non-trivial destructor, the destructor waits for one too: in the pool
  // (element_destruction::by_updaters), or through retire().
  static void reclaim_element(void* map, detail::list_node* element) noexcept {
    auto* self = static_cast<hash_map*>(map);
    auto* n = static_cast<node*>(element);
    if (kTrivialNode || self->pool_destroys_elements()) {
      self->pool_.deallocate(n);
    } else {
      self->domain_.retire(n, &destroy_and_deallocate, sizeof(node));
    }
  }
  static void destroy_and_deallocate(void* element) noexcept {
    auto* n = static_cast<node*>(element);
    n->~node();
    object_pool::owner_of(n).deallocate(n);
  }

  // The reader's walk (M2): skips dummies and marked nodes, never writes.
  template <class K>
  const node* lookup(const K& key) const {
    detail::list_node* start;
    return lookup_in_bucket(so_key_of(key), key, start);
  }
  // The hash of a key. With GRACE_CHECK_MISUSE, a K other than Key that converts to one
  // implicitly, or a string view for a string Key (an explicit conversion, but the one
  // heterogeneous lookup exists for), must hash like that Key: otherwise std::logic_error.
  // The check builds the Key. Other explicit conversions are left alone: one may take
  // ownership (std::unique_ptr from a raw pointer) or cost much (std::vector from a size).
  template <class K>
  std::uint64_t hash_of(const K& key) const {
    const std::uint64_t hash = hash_(key);
#if GRACE_CHECK_MISUSE
    if constexpr (!std::is_same_v<K, Key> &&
                  (std::is_convertible_v<const K&, Key> || detail::views_string_v<Key, K>)) {
      if (hash != static_cast<std::uint64_t>(hash_(Key(key)))) {
        throw std::logic_error(
            "grace::hash_map: the transparent Hash gives a lookup key another hash than the Key "
            "it converts to; heterogeneous lookup needs both to hash alike");
      }
    }
#endif
    return hash;
  }
  // (L1): the split-order key of an element with `key`, from its hash_of(): every public
  // operation computes it once, and the paths below take it as it is.
  template <class K>
  std::uint64_t so_key_of(const K& key) const {
    return detail::element_so_key(hash_of(key), detail::hash_taken_as_it_is_v<Hash, Key>);
  }
  // The reader's walk for a key whose split-order key is `so_key`; `start` receives the
  // dummy of its bucket, where an update that follows the lookup begins its own walk.
  template <class K>
  const node* lookup_in_bucket(std::uint64_t so_key, const K& key,
                               detail::list_node*& start) const {
    unsigned size_log2;
    start = list_.bucket_of(so_key, size_log2);
    return lookup_from(start, size_log2, key, so_key);
  }
  // `start` is the dummy of the key's bucket at size 2^size_log2.
  template <class K>
  const node* lookup_from(const detail::list_node* start, unsigned size_log2, const K& key,
                          std::uint64_t so_key) const {
    // Acquire (M2): pairs with (M1).
    std::uintptr_t link = start->next.load(std::memory_order_acquire);
    // (L7): the next bucket's dummy ends the walk before it is touched.
    if (detail::ends_bucket(link, size_log2)) return nullptr;
    while (const detail::list_node* cur = detail::node_of(link)) {
      // Where links carry tags (L7), a dummy here is one of a level above the size the walk
      // began at: one a grow is linking or has published since, one a shrink is unlinking,
      // or one a fork left (L8). Untagged walks meet every dummy in their bucket.
      const std::uint64_t cur_key = list_.so_key_at(link);
      if (cur_key > so_key) return nullptr;  // (L1): sorted
      // Acquire (M2): as above.
      link = cur->next.load(std::memory_order_acquire);
      if (cur_key == so_key && !detail::is_marked(link) &&
          equal_(static_cast<const node*>(cur)->key, key)) [[likely]] {
        return static_cast<const node*>(cur);
      }
      if (detail::ends_bucket(link, size_log2)) return nullptr;  // (L7): as above
    }
    return nullptr;
  }

  // Michael's search: like lookup, but unlinks marked nodes on the way (L3) and reports the
  // predecessor, so the caller can CAS.
  template <class K>
  position search(detail::list_node* start, const K& key, std::uint64_t so_key) {
  retry:
    detail::list_node* pred = start;
    // Acquire (M2): pairs with (M1).
    std::uintptr_t cur_link = pred->next.load(std::memory_order_acquire) & ~detail::kMarked;
    for (;;) {
      detail::list_node* cur = detail::node_of(cur_link);
      if (cur == nullptr) return {pred, 0, nullptr};
      // Acquire (M2): as above.
      const std::uintptr_t next = cur->next.load(std::memory_order_acquire);
      if (detail::is_marked(next)) {
        std::uintptr_t expected = cur_link;
        // Release (M1): readers through pred see the successor's fields; pairs with (M2).
        if (!pred->next.compare_exchange_strong(expected, next & ~detail::kMarked,
                                                std::memory_order_release,
                                                std::memory_order_relaxed)) {
          goto retry;
        }
        if (!detail::is_dummy_link(cur_link)) list_.reclaim(cur);
        cur_link = next & ~detail::kMarked;
        continue;
      }
      const std::uint64_t cur_key = list_.so_key_at(cur_link);
      if (cur_key > so_key) return {pred, cur_link, nullptr};
      if (cur_key == so_key && equal_(static_cast<node*>(cur)->key, key)) {
        return {pred, cur_link, static_cast<node*>(cur)};
      }
      pred = cur;
      cur_link = next;
    }
  }

  // Links `fresh` where its key belongs unless a live element has the key.
  bool link_new(detail::list_node* start, node* fresh, const Key& key) {
    for (;;) {
      position at = search(start, key, fresh->so_key);
      if (at.found != nullptr) return false;
      // Relaxed: published by the Release CAS below.
      fresh->next.store(at.cur_link, std::memory_order_relaxed);
      std::uintptr_t expected = at.cur_link;
      // Release (M1): the element's fields are visible before it is reachable.
      if (at.pred->next.compare_exchange_strong(expected, detail::element_link(fresh),
                                                std::memory_order_release,
                                                std::memory_order_relaxed)) {
        return true;
      }
    }
  }

  // Replaces the found element with `fresh` (L4): one CAS marks the old element and makes
  // `fresh` its successor; that CAS is the linearization point. False if it lost a race.
  bool replace(detail::list_node* start, const position& at, node* fresh) {
    node* old = at.found;
    // Acquire (M2): pairs with (M1).
    std::uintptr_t next = old->next.load(std::memory_order_acquire);
    if (detail::is_marked(next)) return false;
    // Relaxed: published by the Release CAS below.
    fresh->next.store(next, std::memory_order_relaxed);
    // Release (M1): fresh's fields are visible to every traversal that passes `old`.
    if (!old->next.compare_exchange_strong(next, detail::element_link(fresh) | detail::kMarked,
                                           std::memory_order_release,
                                           std::memory_order_relaxed)) {
      return false;
    }
    unlink(start, at.pred, old, detail::element_link(fresh));
    return true;
  }

  // Deletes the found element: marks it (the linearization point), then unlinks it.
  bool remove(detail::list_node* start, const position& at) {
    node* old = at.found;
    // Acquire (M2): pairs with (M1).
    std::uintptr_t next = old->next.load(std::memory_order_acquire);
    while (!detail::is_marked(next)) {
      // Release (M1)/(L2): the mark freezes old's successor; pairs with (M2).
      if (old->next.compare_exchange_weak(next, next | detail::kMarked,
                                          std::memory_order_release,
                                          std::memory_order_acquire)) {
        unlink(start, at.pred, old, next);  // next: the unmarked link, tag included (L7)
        return true;
      }
    }
    return false;  // another update deleted or replaced it first
  }

  // `successor_link`: the link old's `next` froze, unmarked; never rebuilt from the node,
  // which another thread may have unlinked and reclaimed already.
  void unlink(detail::list_node* start, detail::list_node* pred, node* old,
              std::uintptr_t successor_link) noexcept {
    std::uintptr_t expected = detail::element_link(old);
    // Release (M1): readers through pred see the successor; pairs with (M2).
    if (pred->next.compare_exchange_strong(expected, successor_link,
                                           std::memory_order_release,
                                           std::memory_order_relaxed)) {
      list_.reclaim(old);  // (L3)
    } else {
      list_.unlink_slow(start, old);  // pred changed: make sure someone unlinks old
    }
  }

  enum class upsert_result { inserted, replaced, absent };

  // Replaces the live element with fresh's key, or inserts `fresh` if `may_insert`.
  upsert_result upsert(detail::list_node* start, node* fresh, const Key& key, bool may_insert) {
    for (;;) {
      position at = search(start, key, fresh->so_key);
      if (at.found != nullptr) {
        if (replace(start, at, fresh)) return upsert_result::replaced;
        continue;
      }
      if (!may_insert) {
        discard(fresh);
        return upsert_result::absent;
      }
      // Relaxed: published by the Release CAS below.
      fresh->next.store(at.cur_link, std::memory_order_relaxed);
      std::uintptr_t expected = at.cur_link;
      // Release (M1): as in link_new().
      if (at.pred->next.compare_exchange_strong(expected, detail::element_link(fresh),
                                                std::memory_order_release,
                                                std::memory_order_relaxed)) {
        return upsert_result::inserted;
      }
    }
  }

  // clear(): erases every element present during one walk, then waits for the grace periods
  // their reclamation needs (outside a read section).
  void erase_all() {
    std::int64_t erased = 0;
    // However the walk ends (KeyEqual may throw), the count reflects what it erased.
    struct count_erased {
      detail::split_list& list;
      std::int64_t& erased;
      ~count_erased() {
        if (erased != 0) list.count(-erased);
      }
    } counting{list_, erased};
    {
      auto guard = pin_reader();
      // Acquire (M2): pairs with (M1).
      std::uintptr_t link = list_.head()->next.load(std::memory_order_acquire);
      while (detail::list_node* cur = detail::node_of(link)) {
        const bool dummy = detail::is_dummy_link(link);
        link = cur->next.load(std::memory_order_acquire);  // Acquire (M2): as above.
        if (dummy || detail::is_marked(link)) continue;
        if (erase_element(static_cast<node*>(cur))) ++erased;
      }
    }
    if (!in_read_section()) destroy_erased();
  }

  // ~hash_map(): nobody can see an element any more, so the pool releases them wholesale
  // with its chunks, none handed back one by one. Elements with a destructor get it first,
  // in one walk.
  void destroy_all() noexcept {
    if constexpr (!kTrivialNode) {
      // Relaxed: the destructor's thread is the only one using the map.
      std::uintptr_t link = list_.head()->next.load(std::memory_order_relaxed);
      while (detail::list_node* cur = detail::node_of(link)) {
        const bool dummy = detail::is_dummy_link(link);
        link = cur->next.load(std::memory_order_relaxed);  // read before the node dies
        if (!dummy && !detail::is_marked(link)) static_cast<node*>(cur)->~node();
      }
    }
    pool_.forget_allocated();
  }

  // clear(): erases one element found by a walk.
  bool erase_element(node* element) {
    detail::list_node* start = list_.bucket_of(element->so_key);
    for (;;) {
      position at = search(start, element->key, element->so_key);
      if (at.found != element) return false;  // erased or replaced meanwhile
      if (remove(start, at)) return true;
    }
  }

  detail::hash_map_config config_;
  domain& domain_;
  object_pool pool_;
  [[no_unique_address]] Hash hash_;
  [[no_unique_address]] KeyEqual equal_;
  detail::split_list list_;
  // Operations and pinned views in flight (GRACE_CHECK_MISUSE); present in every build so
  // that the layout does not depend on NDEBUG.
  mutable std::atomic<std::uint64_t> operations_in_flight_{0};
};

}  // namespace grace
