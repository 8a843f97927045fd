// grace::object_pool: a per-CPU object pool that reuses a freed object only after a full
// grace period (the Linux BPF allocator's reuse-after-GP design).
//
// A lock-free structure that frees an element and hands the same memory out again at once
// lets a reader still holding the old pointer see a different object. object_pool closes
// that hole without paying malloc + call_rcu per object:
//
//   grace::object_pool pool(sizeof(node));
//   node* n = new (pool.allocate()) node{...};   // publish n
//   ...                                          // unlink n
//   pool.deallocate(n);   // handed out again only after every reader that saw n has left
//
// Guarantee: an object passed to deallocate() is never returned by allocate() before a full
// grace period of the pool's domain has elapsed since that deallocate() (unless the pool was
// built with reuse_after_gp = false, the unsafe speed reference). Objects are never written
// by the pool while they wait, so readers see them intact until they leave.
//
// Memory: per-CPU caches refill below the low watermark and give surplus above the high one
// (beyond a grace period's worth, for a cache that allocates) to a shared depot other CPUs
// draw from, or back to its chunks; an idle cache is trimmed to between the two (keeping
// its loaded magazine, which may hold more), and one still idle at the next trim pass
// gives back the rest. Objects
// come from 64 KiB chunks: a refill takes the free slots of chunks already held before it
// cuts a new one. A chunk whose slots are all free is kept, up to 16, and cut again before
// the system is asked for a new one; the idle trim returns those no refill took for a
// pass, and the chunks past 16 return to the system at once.
// Objects waiting for a grace period are bounded by asking the domain for a grace period
// (domain::request_gp()) and, past caller_gp_threshold, by the deallocating thread running
// one itself at its next quiescent point (never inside a read section).
//
// Destroying a pool runs its domain's barrier() once and releases every chunk. Destroying it
// while objects are still allocated is a usage error: debug builds abort with the count;
// release builds release the memory anyway.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <utility>

#include "grace/alloc/detail/asan.h"
#include "grace/alloc/detail/magazine.h"
#include "grace/alloc/detail/rseq_fast_path.h"
#include "grace/reclaim/detail/cpu.h"
#include "grace/reclaim/domain.h"

namespace grace {

namespace detail {
struct pool_core;
}  // namespace detail

struct pool_options {
  // Ready objects a CPU cache keeps: below low it refills a batch; above high (plus a grace
  // period's worth for a cache that allocates) it gives the surplus to the depot; idle, it
  // is trimmed to (low + high) / 2 plus its loaded magazine, then emptied if still idle
  // (alloc/README.md, "Memory").
  // 0 picks the BPF allocator's defaults by object size: 32/96/48 up to 256 bytes, scaled by
  // 256/size above.
  std::size_t low_watermark = 0;
  std::size_t high_watermark = 0;
  std::size_t batch = 0;
  // Object pointers a magazine holds: deallocate() fills one before it is stamped and waits
  // for its grace period, and allocate() empties one before its slow path takes the next, so
  // the slow paths (a grace-period cookie, a request to the domain) run once per this many
  // calls. At least batch (a refill cuts batch objects into one), at most 4096. 0 means
  // max(batch, 16 KiB of objects by their stride, at most 4096): 256 of 64 bytes, 1024 of
  // the smallest with the default alignment (an 8 KiB magazine) (alloc/README.md,
  // "Magazines").
  std::size_t magazine_capacity = 0;
  // Objects' alignment: a power of two; 0 means alignof(std::max_align_t).
  std::size_t alignment = 0;
  // false: a freed object is reused at once. UNSAFE for RCU readers: it exists only as the
  // speed reference that shows what the grace period costs.
  bool reuse_after_gp = true;
  // Objects waiting for a grace period in one CPU cache above which the pool asks its domain
  // for one (domain::request_gp(), the rcu_request_urgent_qs_task analogue: answered by the
  // next grace period anyone runs, or by the engine after domain_options::requested_gp_delay).
  // 0 means 2 x magazine_capacity (past it, at least one magazine is sealed).
  std::size_t gp_request_threshold = 0;
  // Waiting objects in one CPU cache above which the deallocating thread runs a grace period
  // itself, at its next quiescent point (domain::synchronize_when_unpinned()); below it, the
  // thread also does so when domain::request_gp_claiming_overdue() says the domain's request
  // has waited long.
  // On a busy machine the engine's thread competes for a core with the threads producing
  // garbage; the producers paying for grace periods keeps memory flat and costs far fewer
  // membarrier() calls. Each grace period costs membarrier() IPIs, so the threshold trades
  // memory (up to this many objects waiting per CPU) for update speed: 16384 holds ~1.4 MiB
  // of 88-byte map elements per CPU and runs a quarter of the grace periods 4096 did
  // (alloc/README.md, "Who drives grace periods"). 0 disables both: allocate() and
  // deallocate() then never run a grace period.
  std::size_t caller_gp_threshold = 16384;
  // Where chunks and magazines come from. Called while a cache is held, so it must not wait
  // for anything a fork() holds (grace, another thread's fork, or a lock that a
  // pthread_atfork prepare handler registered after grace's takes), nor fork itself.
  system_allocator allocator{};
  // Set, deallocate() takes an object that is still constructed, and the pool runs
  // destroy(object) once, after the object's grace period and before its memory is handed
  // out again or released (alloc/README.md, "Destroying after the grace period"). It runs
  // one or two magazines at a time on the thread whose pool call finds the grace period over
  // (inside that allocate() or deallocate(), and so inside the caller's read section and
  // under the caller's locks), on the domain's worker (the idle trim, or a retire() deleter
  // for an object that found no magazine), in destroy_deallocated() or in ~object_pool();
  // never while a cache is held. So it may allocate memory and use this pool (except from
  // ~object_pool()); it must not wait for a grace period, fork, call destroy_deallocated(),
  // nor take a lock that a thread calling this pool may hold. Requires reuse_after_gp.
  void (*destroy)(void* object) noexcept = nullptr;
  // allocate() and deallocate() pop and push in a restartable sequence (rseq) on the CPU's
  // cache where the machine allows it (x86-64 Linux with glibc's rseq area and membarrier's
  // RSEQ fence; not under ThreadSanitizer, which cannot see it): no atomic instruction on
  // the fast path. false, or where unavailable, they take the cache's flag by an exchange.
  // object_pool::uses_restartable_sequences() tells which (alloc/README.md, "Fast paths").
  bool restartable_sequences = true;
};

// Approximate snapshot; fields are not mutually consistent. Never reset.
struct pool_stats {
  std::uint64_t allocated = 0;            // allocate() calls served
  std::uint64_t deallocated = 0;          // deallocate() calls
  std::uint64_t reused_after_gp = 0;      // objects made allocatable again after a GP
  std::uint64_t fresh = 0;                // objects cut from new (or retained) chunks
  std::uint64_t reused_from_chunks = 0;   // objects handed out again from chunks' free slots
  std::uint64_t destroyed = 0;            // objects pool_options::destroy ran on
  std::uint64_t returned_to_system = 0;   // objects released to their chunks
  std::uint64_t ready = 0;                // gauge: allocatable objects held (per-cache lag)
  std::uint64_t waiting_for_gp = 0;       // gauge: deallocated, grace period not yet elapsed
  std::uint64_t held_bytes = 0;           // chunk memory held now
  std::uint64_t peak_held_bytes = 0;
  std::uint64_t chunks = 0;               // chunks held now
  std::uint64_t retained_chunks = 0;      // of those, with no object in use, kept for reuse
};

class object_pool {
 public:
  // The largest object a pool takes: a quarter of a 64 KiB chunk past its header. Larger
  // objects belong behind a pointer, or to malloc.
  static constexpr std::size_t max_object_size = 16368;

  // Throws std::invalid_argument naming the option for bad options, an object_size of 0 or
  // one above max_object_size.
  explicit object_pool(std::size_t object_size, pool_options options = {},
                       domain& reclamation = domain::global());
  ~object_pool();

  object_pool(const object_pool&) = delete;
  object_pool& operator=(const object_pool&) = delete;

  // Returns uninitialized memory for one object. Throws std::bad_alloc when the system has
  // no memory, leaving the pool consistent.
  void* allocate();
  // Requires: object came from this pool's allocate() and is deallocated once (with
  // pool_options::destroy, still constructed). May be called inside a read section. nullptr
  // is ignored.
  void deallocate(void* object) noexcept;
  // Memory from allocate() that holds no object (its construction threw) and that nobody
  // else has seen: handed out again without a grace period, and never destroyed.
  void deallocate_unconstructed(void* object) noexcept;
  // Returns once pool_options::destroy has run on every object deallocated before the call,
  // running it here on those whose grace period this call waits for (without a destroy hook,
  // it only waits for a grace period), and waiting for other threads running it on the
  // others. In a fork() child, objects a thread of the parent was destroying are lost with
  // that thread. Requires: the caller is not in a read section or a retire() deleter
  // (std::logic_error from the domain), nor in a destroy hook or holding a lock one takes
  // (it would wait for itself).
  void destroy_deallocated();
  // All or nothing: on std::bad_alloc no object is left allocated.
  void allocate_bulk(void** objects, std::size_t count);
  void deallocate_bulk(void* const* objects, std::size_t count) noexcept;

  // The pool whose allocate() returned `object`.
  static object_pool& owner_of(void* object) noexcept;
  // Objects still allocated when the pool is destroyed are released with it, without the
  // usage-error check. For an owner that tears down everything it allocated at once (a
  // container's destructor), when no reader can see any of the objects any more.
  void forget_allocated() noexcept;

  pool_stats stats() const noexcept;
  std::size_t object_size() const noexcept { return object_size_; }
  domain& reclamation_domain() const noexcept { return *domain_; }
  const pool_options& options() const noexcept { return options_; }
  // Whether allocate() and deallocate() run their rseq fast path (pool_options).
  bool uses_restartable_sequences() const noexcept { return restartable_sequences_; }

 private:
  friend struct detail::pool_core;
  friend struct object_pool_test_access;

  // The holder's slow paths: called with `cache` held; they release it.
  [[gnu::cold, gnu::noinline]] void* allocate_slow(detail::pool_cache& cache);
  [[gnu::cold, gnu::noinline]] void deallocate_slow(detail::pool_cache& cache,
                                                    void* object) noexcept;
  // allocate_slow()'s end: counts `object` (taken from the held `cache`) and releases it.
  void* finish_allocate(detail::pool_cache& cache, void* object) noexcept;
  // The CPU's cache was held by another thread.
  [[gnu::cold, gnu::noinline]] void* allocate_contended_slow(unsigned home);
  [[gnu::cold, gnu::noinline]] void deallocate_contended_slow(unsigned home,
                                                              void* object) noexcept;
  // Takes `cache` (index `home`) if nobody holds it. A fast-path hold: only pops from
  // `loaded` and pushes onto its target, leaving the counting to the next settle (P8).
  bool take_fast(detail::pool_cache& cache, unsigned home) const noexcept {
    // Acquire (A1): take the cache with its previous holder's changes; pairs with (A2).
    if (cache.held.exchange(true, std::memory_order_acquire)) return false;
    // (A8): no restartable sequence on this cache is still between its check and its commit.
    if (restartable_sequences_ && !detail::running_on(home)) fence_fast_paths_slow(home);
    return true;
  }
  // Ends a fast-path hold.
  static void end_fast_hold(detail::pool_cache& cache) noexcept {
    // Release (A2): the next holder sees this holder's changes; pairs with (A1).
    cache.held.store(false, std::memory_order_release);
  }
  // A slow path's hold, from take_fast() or take_cache(): counts what fast paths did since
  // the last one, and is ended by release_hold() (P8).
  static void settle(detail::pool_cache& cache) noexcept;
  bool take_cache(detail::pool_cache& cache, unsigned home) const noexcept {
    if (!take_fast(cache, home)) return false;
    settle(cache);
    return true;
  }
  // (P8): what the next settle() counts pops from.
  static void mark_loaded(detail::pool_cache& cache) noexcept {
    cache.loaded_mark = cache.loaded != nullptr ? cache.loaded->count : 0;
  }
  static void release_hold(detail::pool_cache& cache) noexcept {
    mark_loaded(cache);
    end_fast_hold(cache);
  }
  // Where deallocate() pushes (P1)/(P2): the offset of `freed`, or of `loaded`.
  std::size_t target_offset() const noexcept {
    return options_.reuse_after_gp ? offsetof(detail::pool_cache, freed)
                                   : offsetof(detail::pool_cache, loaded);
  }
  unsigned index_of(const detail::pool_cache& cache) const noexcept {
    return static_cast<unsigned>(&cache - caches_.get());
  }
  // Waits until no restartable sequence on CPU `cpu` is between its check of `held` and its
  // commit (membarrier's RSEQ fence): the caller holds that CPU's cache from another CPU.
  [[gnu::cold, gnu::noinline]] static void fence_fast_paths_slow(unsigned cpu) noexcept;
  // The same for every CPU at once: the caller holds every cache (fork()).
  [[gnu::cold, gnu::noinline]] static void fence_all_fast_paths_slow() noexcept;

  std::size_t object_size_;
  pool_options options_;
  // Counts the pool on its domain until the destructor's body, the domain's last use, is done.
  detail::domain_user domain_;
  std::unique_ptr<detail::pool_cache[]> caches_;
  unsigned cache_mask_;
  bool restartable_sequences_;  // (A8): set once, before the pool is shared
  std::unique_ptr<detail::pool_core> core_;
};

inline void* object_pool::allocate() {
  if (restartable_sequences_) {
    if (void* object = detail::rseq_pop(caches_.get(), cache_mask_ + 1)) [[likely]] {
      detail::asan_unpoison(object, object_size_);
      return object;
    }
  }
  const unsigned home = detail::current_cpu() & cache_mask_;
  detail::pool_cache& cache = caches_[home];
  if (!take_fast(cache, home)) [[unlikely]] return allocate_contended_slow(home);
  detail::magazine* loaded = cache.loaded;
  if (loaded == nullptr || loaded->empty()) [[unlikely]] return allocate_slow(cache);
  void* object = loaded->pop();
  end_fast_hold(cache);
  detail::asan_unpoison(object, object_size_);
  return object;
}

inline void object_pool::deallocate(void* object) noexcept {
  if (object == nullptr) return;
  // (P1)/(P2): with reuse_after_gp the object waits in `freed`; without, it is ready at once
  // (and poisoned before it is anybody else's to take).
  if (!options_.reuse_after_gp) detail::asan_poison(object, object_size_);
  if (restartable_sequences_ &&
      detail::rseq_push(caches_.get(), cache_mask_ + 1, target_offset(), object)) [[likely]] {
    return;
  }
  const unsigned home = detail::current_cpu() & cache_mask_;
  detail::pool_cache& cache = caches_[home];
  if (!take_fast(cache, home)) [[unlikely]] {
    deallocate_contended_slow(home, object);
    return;
  }
  detail::magazine* target = options_.reuse_after_gp ? cache.freed : cache.loaded;
  if (target == nullptr || !target->can_push()) [[unlikely]] {
    deallocate_slow(cache, object);
    return;
  }
  target->push(object);
  end_fast_hold(cache);
}

// A typed face over object_pool: create() constructs, destroy() destroys and deallocates.
// destroy() runs ~T() at once: for an object readers may still see, either T is trivially
// destructible, or retire it through the domain and destroy it from the deleter. (For ~T()
// after the grace period, use an object_pool with pool_options::destroy directly.)
template <class T>
class typed_pool {
 public:
  // Throws std::invalid_argument for options.destroy: destroy() runs ~T() itself.
  explicit typed_pool(pool_options options = {}, domain& reclamation = domain::global())
      : pool_(sizeof(T), checked(options), reclamation) {}

  template <class... Args>
  T* create(Args&&... args) {
    void* memory = pool_.allocate();
    try {
      return new (memory) T(std::forward<Args>(args)...);
    } catch (...) {
      pool_.deallocate_unconstructed(memory);
      throw;
    }
  }
  void destroy(T* object) noexcept {
    if (object == nullptr) return;
    object->~T();
    pool_.deallocate(object);
  }

  object_pool& pool() noexcept { return pool_; }
  pool_stats stats() const noexcept { return pool_.stats(); }

 private:
  static pool_options checked(pool_options options) {
    if (options.destroy != nullptr) {
      throw std::invalid_argument(
          "grace::typed_pool: pool_options.destroy must be null: destroy() runs ~T() itself");
    }
    if (options.alignment == 0) options.alignment = alignof(T);
    return options;
  }
  object_pool pool_;
};

}  // namespace grace
