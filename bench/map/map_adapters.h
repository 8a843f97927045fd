// The maps `grace-bench map` compares, each behind the same small adapter so one templated
// loop drives them all (no virtual call in the measured loop):
//
//   struct some_map {
//     static constexpr const char* kName;           // the map= value
//     static constexpr const char* kHashName;       // the hash= value (Hashes, below)
//     static constexpr bool kConcurrent;            // false: one thread at a time only
//     static constexpr bool kReadSections;          // RCU map: its reads take read sections
//     struct thread_scope;                          // per-thread setup (liburcu registration)
//     class batch_scope;                            // RAII: one read section around a batch
//                                                   // of operations (RCU maps); else nothing
//     using value_type;                             // value64 or std::string (map_value.h)
//     explicit some_map(std::size_t capacity_hint);
//     // If absent; true if inserted.
//     bool insert(std::uint64_t key, value_arg<value_type> value);
//     // insert_or_assign (BPF_ANY); true if inserted.
//     bool upsert(std::uint64_t key, value_arg<value_type> value);
//     bool erase(std::uint64_t key);  // true if erased
//     // f(const value_type&) in place, under the map's read protection; false if absent.
//     template <class F> bool visit(std::uint64_t key, F f);
//     static void release_cached_memory();  // after destruction: give cached memory back
//   };
//
// Each adapter is a template on the value type (some_map_of<Value>; oneTBB's and libcuckoo's
// also on their hash); some_map names the value64 one.
//
// Every operation of a map, including its constructor and destructor, runs on a thread that
// holds the map's thread_scope (cds_lfht needs registered threads for everything, including
// the destructor's drain).
//
// batch_scope: the htab-mem cases run each batch of 64 operations the way the kernel's BPF
// program does, inside one RCU read section (--read-sections batch, the default). For the
// RCU maps it enters one, and their operations nest inside it: grace's cost a thread-local
// increment; cds_lfht's skip their own _urcu_memb_read_lock(), as a cds_lfht caller holding
// the lock around a batch would write them. The other maps take no read section at all.
//
// Peers (Value: value64, or std::string with --value string):
//   grace        grace::hash_map<uint64_t, Value>, default options (the global domain, or
//                one whose worker runs at --grace-worker-nice; destruction from
//                --grace-destruction); reads through visit()
//   cds_lfht     liburcu 0.13 rculfhash, urcu-memb flavor, AUTO_RESIZE | ACCOUNTING; malloc'd
//                (new'd) nodes embedding cds_lfht_node + rcu_head, deleted through
//                call_rcu();
//                every operation under liburcu's read lock (its own, or its batch's:
//                see batch_scope below), liburcu's own inline functions from
//                <urcu/static/urcu-memb.h>, so that both RCU maps pay an inline read
//                section (grace's speaks the same protocol); registered threads
//   absl_sharded absl::flat_hash_map behind 64 absl::Mutex shards (readers take the shard
//                lock shared)
//   absl_single  one absl::flat_hash_map, no lock: the single-thread reference (-p 1 only)
//   tbb          oneTBB concurrent_hash_map: accessor for updates, const_accessor for reads
//   libcuckoo    libcuckoo::cuckoohash_map: insert_or_assign / insert / erase / find_fn
//
// Hashes: grace, cds_lfht and absl hash keys with absl::Hash. oneTBB and libcuckoo use their
// own defaults, std::hash, which libstdc++ and libc++ make the identity on an integer:
// consecutive keys (htab-mem's t, t+p, ...) land in consecutive buckets, whose buckets and
// locks sit on neighbouring cache lines (oneTBB's 16-byte buckets share them) that the
// hardware prefetcher streams in. `AbslHash` (--peer-hash absl) gives them absl::Hash too,
// so that every map spreads keys alike.
#pragma once

#include <absl/container/flat_hash_map.h>
#include <absl/hash/hash.h>
#include <absl/synchronization/mutex.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "grace/map/hash_map.h"
#include "map/map_value.h"

#if GRACE_BENCH_HAVE_CDS_LFHT
#include <urcu/urcu-memb.h>
#include <urcu/static/urcu-memb.h>
// rculfhash.h needs a flavor header first (above).
#include <urcu/rculfhash.h>
#endif
#if GRACE_BENCH_HAVE_TBB
#include <oneapi/tbb/concurrent_hash_map.h>
#include <oneapi/tbb/scalable_allocator.h>
#endif
#if GRACE_BENCH_HAVE_LIBCUCKOO
#include <libcuckoo/cuckoohash_map.hh>
#endif

namespace grace::bench {

// How the adapters take a value: a value that owns memory (std::string) by value, so a map
// takes the caller's temporary without copying it; value64 by reference.
template <class Value>
using value_arg = std::conditional_t<std::is_trivially_copyable_v<Value>, const Value&, Value>;

// --- grace -------------------------------------------------------------------------------

// The reclaim worker's nice value for grace's maps (--grace-worker-nice): 0 uses the global
// domain, as a default-constructed grace::hash_map does; above 0, a domain of this process's
// own whose worker runs at that value (domain_options::worker_nice). Set by the tool before
// any map is built; each job runs in a process of its own.
inline int grace_worker_nice = 0;
inline grace::domain& grace_bench_domain() {
  if (grace_worker_nice == 0) return grace::domain::global();
  static grace::domain own(grace::domain_options{.worker_nice = grace_worker_nice});
  return own;
}

// Where grace's maps destroy erased and replaced elements (--grace-destruction), for values
// with a destructor (--value string). Set by the tool before any map is built.
inline grace::element_destruction grace_destruction =
    grace::element_destruction::on_reclaim_worker;

// Whether grace's element pools run their fast paths as restartable sequences
// (--grace-fast-path; pool_options::restartable_sequences). Set by the tool before any map is
// built.
inline bool grace_restartable_sequences = true;

template <class Value>
class grace_map_of {
 public:
  using value_type = Value;
  static constexpr const char* kName = "grace";
  static constexpr const char* kHashName = "absl";
  static constexpr bool kConcurrent = true;
  static constexpr bool kReadSections = true;
  static void release_cached_memory() {}

  // grace registers a thread on its first pin; take it here, outside the timed loop.
  struct thread_scope {
    thread_scope() { auto g = grace::pin(); }
  };
  class batch_scope {
    grace::read_guard guard_;
  };

  explicit grace_map_of(std::size_t capacity_hint)
      : map_(grace::hash_map_options{
            .reclamation = &grace_bench_domain(),
            .pool = {.restartable_sequences = grace_restartable_sequences},
            .destruction = grace_destruction}) {
    map_.reserve(capacity_hint);
  }

  bool insert(std::uint64_t key, value_arg<Value> value) {
    return map_.insert(key, std::move(value));
  }
  bool upsert(std::uint64_t key, value_arg<Value> value) {
    return map_.insert_or_assign(key, std::move(value));
  }
  bool erase(std::uint64_t key) { return map_.erase(key); }
  template <class F>
  bool visit(std::uint64_t key, F f) const {
    return map_.visit(key, f);
  }

  grace::hash_map<std::uint64_t, Value>& raw() { return map_; }

 private:
  grace::hash_map<std::uint64_t, Value> map_;
};

// --- cds_lfht ------------------------------------------------------------------------------

#if GRACE_BENCH_HAVE_CDS_LFHT
template <class Value>
class cds_lfht_map_of {
 public:
  using value_type = Value;
  static constexpr const char* kName = "cds_lfht";
  static constexpr const char* kHashName = "absl";
  static constexpr bool kConcurrent = true;
  static constexpr bool kReadSections = true;
  static void release_cached_memory() {}

  struct thread_scope {
    thread_scope() { urcu_memb_register_thread(); }
    ~thread_scope() { urcu_memb_unregister_thread(); }
    thread_scope(const thread_scope&) = delete;
    thread_scope& operator=(const thread_scope&) = delete;
  };

  // One read section for a batch; the operations inside it take none of their own.
  class batch_scope {
   public:
    batch_scope() {
      _urcu_memb_read_lock();
      ++batch_depth;
    }
    ~batch_scope() {
      --batch_depth;
      _urcu_memb_read_unlock();
    }
    batch_scope(const batch_scope&) = delete;
    batch_scope& operator=(const batch_scope&) = delete;
  };

  explicit cds_lfht_map_of(std::size_t capacity_hint) {
    // Start liburcu's call_rcu worker now, not in the timed loop.
    (void)urcu_memb_get_default_call_rcu_data();
    const unsigned long init_size = std::bit_ceil(capacity_hint < 1 ? 1UL : capacity_hint);
    table_ =
        cds_lfht_new_flavor(init_size, /*min_nr_alloc_buckets=*/1, /*max_nr_buckets=*/0,
                            CDS_LFHT_AUTO_RESIZE | CDS_LFHT_ACCOUNTING, &urcu_memb_flavor, nullptr);
    if (table_ == nullptr) throw std::bad_alloc();
  }

  // Requires a registered thread outside any read section: unlinks every node (call_rcu),
  // destroys the table, and waits for the callbacks so the memory is back before the next
  // measurement.
  ~cds_lfht_map_of() {
    cds_lfht_iter iter;
    _urcu_memb_read_lock();
    cds_lfht_first(table_, &iter);
    while (cds_lfht_node* n = cds_lfht_iter_get_node(&iter)) {
      cds_lfht_next(table_, &iter);
      if (cds_lfht_del(table_, n) == 0) urcu_memb_call_rcu(&node_of(n)->head, &free_node);
    }
    _urcu_memb_read_unlock();
    (void)cds_lfht_destroy(table_, nullptr);
    urcu_memb_barrier();
  }
  cds_lfht_map_of(const cds_lfht_map_of&) = delete;
  cds_lfht_map_of& operator=(const cds_lfht_map_of&) = delete;

  // Looks first (as a caller would), so a present key costs no malloc/free.
  bool insert(std::uint64_t key, value_arg<Value> value) {
    const unsigned long hash = hash_of(key);
    lfht_node* fresh;
    cds_lfht_node* got;
    {
      const op_section section;
      cds_lfht_iter iter;
      cds_lfht_lookup(table_, hash, &match, &key, &iter);
      if (cds_lfht_iter_get_node(&iter) != nullptr) return false;
      fresh = make_node(key, std::move(value));
      got = cds_lfht_add_unique(table_, hash, &match, &key, &fresh->node);
    }
    if (got != &fresh->node) {
      delete fresh;  // never published
      return false;
    }
    return true;
  }
  bool upsert(std::uint64_t key, value_arg<Value> value) {
    lfht_node* fresh = make_node(key, std::move(value));
    const op_section section;
    cds_lfht_node* old = cds_lfht_add_replace(table_, hash_of(key), &match, &key, &fresh->node);
    if (old != nullptr) urcu_memb_call_rcu(&node_of(old)->head, &free_node);
    return old == nullptr;
  }
  bool erase(std::uint64_t key) {
    const op_section section;
    cds_lfht_iter iter;
    cds_lfht_lookup(table_, hash_of(key), &match, &key, &iter);
    cds_lfht_node* n = cds_lfht_iter_get_node(&iter);
    if (n == nullptr || cds_lfht_del(table_, n) != 0) return false;
    urcu_memb_call_rcu(&node_of(n)->head, &free_node);
    return true;
  }
  template <class F>
  bool visit(std::uint64_t key, F f) const {
    const op_section section;
    cds_lfht_iter iter;
    cds_lfht_lookup(table_, hash_of(key), &match, &key, &iter);
    const cds_lfht_node* n = cds_lfht_iter_get_node(&iter);
    if (n != nullptr) f(static_cast<const Value&>(node_of(n)->value));
    return n != nullptr;
  }

 private:
  // batch_scopes this thread is inside.
  static inline thread_local unsigned batch_depth = 0;

  // An operation's read section, unless a batch_scope already holds one.
  class op_section {
   public:
    op_section() {
      if (batch_depth == 0) _urcu_memb_read_lock();
    }
    ~op_section() {
      if (batch_depth == 0) _urcu_memb_read_unlock();
    }
    op_section(const op_section&) = delete;
    op_section& operator=(const op_section&) = delete;
  };

  struct lfht_node {
    cds_lfht_node node;  // first: node_of() casts back
    rcu_head head;
    std::uint64_t key;
    Value value;
  };

  static unsigned long hash_of(std::uint64_t key) { return absl::Hash<std::uint64_t>{}(key); }
  static lfht_node* node_of(const cds_lfht_node* n) {
    return reinterpret_cast<lfht_node*>(const_cast<cds_lfht_node*>(n));
  }
  static int match(cds_lfht_node* n, const void* key) {
    return node_of(n)->key == *static_cast<const std::uint64_t*>(key);
  }
  static lfht_node* make_node(std::uint64_t key, value_arg<Value> value) {
    auto* n = new lfht_node{{}, {}, key, std::move(value)};
    cds_lfht_node_init(&n->node);
    return n;
  }
  static void free_node(rcu_head* head) {
    // container_of: head sits at a fixed offset in the node.
    delete reinterpret_cast<lfht_node*>(reinterpret_cast<char*>(head) - offsetof(lfht_node, head));
  }

  cds_lfht* table_ = nullptr;
};
#endif

// --- absl::flat_hash_map, sharded and single ----------------------------------------------

template <class Value>
class absl_sharded_map_of {
 public:
  using value_type = Value;
  static constexpr const char* kName = "absl_sharded";
  static constexpr const char* kHashName = "absl";
  static constexpr bool kConcurrent = true;
  static constexpr bool kReadSections = false;
  static void release_cached_memory() {}
  static constexpr unsigned kShards = 64;

  struct thread_scope {};
  struct batch_scope {};  // no read sections

  explicit absl_sharded_map_of(std::size_t capacity_hint) : shards_(new shard[kShards]) {
    for (unsigned i = 0; i < kShards; ++i) shards_[i].map.reserve(capacity_hint / kShards);
  }

  bool insert(std::uint64_t key, value_arg<Value> value) {
    shard& s = shard_of(key);
    absl::MutexLock lock(&s.mutex);
    return s.map.try_emplace(key, std::move(value)).second;
  }
  bool upsert(std::uint64_t key, value_arg<Value> value) {
    shard& s = shard_of(key);
    absl::MutexLock lock(&s.mutex);
    return s.map.insert_or_assign(key, std::move(value)).second;
  }
  bool erase(std::uint64_t key) {
    shard& s = shard_of(key);
    absl::MutexLock lock(&s.mutex);
    return s.map.erase(key) != 0;
  }
  template <class F>
  bool visit(std::uint64_t key, F f) const {
    shard& s = shard_of(key);
    absl::ReaderMutexLock lock(&s.mutex);
    auto it = s.map.find(key);
    if (it == s.map.end()) return false;
    f(static_cast<const Value&>(it->second));
    return true;
  }

 private:
  struct alignas(64) shard {
    absl::Mutex mutex;
    absl::flat_hash_map<std::uint64_t, Value> map;
  };
  // The shard from a multiplicative hash's top bits, independent of the bits the shard's own
  // absl::Hash-based table uses for its slots.
  shard& shard_of(std::uint64_t key) const {
    return shards_[(key * 0x9e3779b97f4a7c15ULL) >> (64 - std::countr_zero(kShards))];
  }

  std::unique_ptr<shard[]> shards_;
};

template <class Value>
class absl_single_map_of {
 public:
  using value_type = Value;
  static constexpr const char* kName = "absl_single";
  static constexpr const char* kHashName = "absl";
  static constexpr bool kConcurrent = false;
  static constexpr bool kReadSections = false;
  static void release_cached_memory() {}

  struct thread_scope {};
  struct batch_scope {};  // no read sections

  explicit absl_single_map_of(std::size_t capacity_hint) { map_.reserve(capacity_hint); }

  bool insert(std::uint64_t key, value_arg<Value> value) {
    return map_.try_emplace(key, std::move(value)).second;
  }
  bool upsert(std::uint64_t key, value_arg<Value> value) {
    return map_.insert_or_assign(key, std::move(value)).second;
  }
  bool erase(std::uint64_t key) { return map_.erase(key) != 0; }
  template <class F>
  bool visit(std::uint64_t key, F f) const {
    auto it = map_.find(key);
    if (it == map_.end()) return false;
    f(static_cast<const Value&>(it->second));
    return true;
  }

 private:
  absl::flat_hash_map<std::uint64_t, Value> map_;
};

// --- oneTBB --------------------------------------------------------------------------------

// The peers' hash under --peer-hash (the comment at the top): their default, or absl::Hash.
template <bool AbslHash>
inline constexpr const char* kPeerHashName = AbslHash ? "absl" : "std";

#if GRACE_BENCH_HAVE_TBB
// oneTBB's HashCompare with absl::Hash (its default, tbb_hash_compare, calls std::hash).
struct tbb_absl_hash_compare {
  static std::size_t hash(std::uint64_t key) { return absl::Hash<std::uint64_t>{}(key); }
  static bool equal(std::uint64_t a, std::uint64_t b) { return a == b; }
};

template <class Value, bool AbslHash = false>
class tbb_map_of {
 public:
  using value_type = Value;
  static constexpr const char* kName = "tbb";
  static constexpr const char* kHashName = kPeerHashName<AbslHash>;
  static constexpr bool kConcurrent = true;
  static constexpr bool kReadSections = false;
  // oneTBB's default allocator is tbbmalloc (when installed), which keeps freed memory in its
  // own pools, where malloc_trim() does not reach: release it so the next baseline is clean.
  static void release_cached_memory() {
    (void)scalable_allocation_command(TBBMALLOC_CLEAN_ALL_BUFFERS, nullptr);
  }

  struct thread_scope {};
  struct batch_scope {};  // no read sections

  explicit tbb_map_of(std::size_t capacity_hint) : map_(capacity_hint) {}

  bool insert(std::uint64_t key, value_arg<Value> value) {
    return map_.emplace(key, std::move(value));
  }
  // In place under the element's write lock (oneTBB's way; no allocation for a present key).
  bool upsert(std::uint64_t key, value_arg<Value> value) {
    typename table::accessor access;
    const bool inserted = map_.insert(access, key);
    access->second = std::move(value);
    return inserted;
  }
  bool erase(std::uint64_t key) { return map_.erase(key); }
  template <class F>
  bool visit(std::uint64_t key, F f) const {
    typename table::const_accessor access;
    if (!map_.find(access, key)) return false;
    f(static_cast<const Value&>(access->second));
    return true;
  }

 private:
  using table = oneapi::tbb::concurrent_hash_map<
      std::uint64_t, Value,
      std::conditional_t<AbslHash, tbb_absl_hash_compare,
                         oneapi::tbb::tbb_hash_compare<std::uint64_t>>>;
  table map_;
};
#endif

// --- libcuckoo -----------------------------------------------------------------------------

#if GRACE_BENCH_HAVE_LIBCUCKOO
template <class Value, bool AbslHash = false>
class libcuckoo_map_of {
 public:
  using value_type = Value;
  static constexpr const char* kName = "libcuckoo";
  static constexpr const char* kHashName = kPeerHashName<AbslHash>;
  static constexpr bool kConcurrent = true;
  static constexpr bool kReadSections = false;
  static void release_cached_memory() {}

  struct thread_scope {};
  struct batch_scope {};  // no read sections

  explicit libcuckoo_map_of(std::size_t capacity_hint) : map_(capacity_hint) {}

  bool insert(std::uint64_t key, value_arg<Value> value) {
    return map_.insert(key, std::move(value));
  }
  bool upsert(std::uint64_t key, value_arg<Value> value) {
    return map_.insert_or_assign(key, std::move(value));
  }
  bool erase(std::uint64_t key) { return map_.erase(key); }
  template <class F>
  bool visit(std::uint64_t key, F f) const {
    return map_.find_fn(key, [&f](const Value& v) { f(v); });
  }

 private:
  libcuckoo::cuckoohash_map<
      std::uint64_t, Value,
      std::conditional_t<AbslHash, absl::Hash<std::uint64_t>, std::hash<std::uint64_t>>>
      map_;
};
#endif

// The value64 maps, by the names the rest of the tool uses.
using grace_map = grace_map_of<value64>;
#if GRACE_BENCH_HAVE_CDS_LFHT
using cds_lfht_map = cds_lfht_map_of<value64>;
#endif
using absl_sharded_map = absl_sharded_map_of<value64>;
using absl_single_map = absl_single_map_of<value64>;
#if GRACE_BENCH_HAVE_TBB
using tbb_map = tbb_map_of<value64>;
#endif
#if GRACE_BENCH_HAVE_LIBCUCKOO
using libcuckoo_map = libcuckoo_map_of<value64>;
#endif

}  // namespace grace::bench
