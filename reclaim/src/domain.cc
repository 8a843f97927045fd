// grace::domain: construction, the retire slow paths, and the public blocking calls.
#include "grace/reclaim/domain.h"

#include <sys/mman.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "fork_internal.h"
#include "grace/reclaim/detail/fork.h"
#include "reclaim_engine_internal.h"

namespace grace {
namespace {

void validate(const domain_options& options) {
  using std::chrono::milliseconds;
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("grace::domain_options: " + what);
  };
  if (options.drain_interval < milliseconds(1) || options.drain_interval > milliseconds(10'000)) {
    fail("drain_interval must be between 1 ms and 10 s, got " +
         std::to_string(options.drain_interval.count()) + " ms");
  }
  if (options.requested_gp_delay < std::chrono::microseconds(0) ||
      options.requested_gp_delay > milliseconds(10'000)) {
    fail("requested_gp_delay must be between 0 and 10 s, got " +
         std::to_string(options.requested_gp_delay.count()) + " us");
  }
  if (options.soft_limit_objects == 0) fail("soft_limit_objects must be at least 1");
  if (options.soft_limit_bytes == 0) fail("soft_limit_bytes must be at least 1");
  if (options.hard_limit_objects < options.soft_limit_objects) {
    fail("hard_limit_objects (" + std::to_string(options.hard_limit_objects) +
         ") must be >= soft_limit_objects (" + std::to_string(options.soft_limit_objects) + ")");
  }
  if (options.hard_limit_bytes < options.soft_limit_bytes) {
    fail("hard_limit_bytes (" + std::to_string(options.hard_limit_bytes) +
         ") must be >= soft_limit_bytes (" + std::to_string(options.soft_limit_bytes) + ")");
  }
  if (options.worker_nice < 0 || options.worker_nice > 19) {
    fail("worker_nice must be between 0 and 19, got " + std::to_string(options.worker_nice));
  }
  if (options.batching != batching::per_cpu_blocks && options.batching != batching::per_object) {
    fail("batching is not a grace::batching value");
  }
  if (options.allocator.allocate == nullptr || options.allocator.deallocate == nullptr) {
    fail("allocator must have both allocate and deallocate");
  }
}

void flush_global_domain_at_exit() {
  if (in_read_section()) return;  // exit() inside a read section: barrier() would deadlock
  domain::global().barrier();
}

}  // namespace

namespace detail {
namespace {
// The highest possible CPU number + 1, from the kernel's list of possible CPUs ("0-3",
// "0,2-5"); get_nprocs_conf() (which counts CPUs) where the list cannot be read.
unsigned possible_cpu_numbers() noexcept {
  unsigned highest_plus_one = 0;
  if (std::FILE* list = std::fopen("/sys/devices/system/cpu/possible", "re")) {
    unsigned number = 0;
    bool in_number = false;
    for (int c = std::fgetc(list);; c = std::fgetc(list)) {
      if (c >= '0' && c <= '9') {
        number = number * 10 + static_cast<unsigned>(c - '0');
        in_number = true;
        continue;
      }
      if (in_number) highest_plus_one = std::max(highest_plus_one, number + 1);
      number = 0;
      in_number = false;
      if (c == EOF) break;
    }
    std::fclose(list);
  }
  const int configured = get_nprocs_conf();
  return std::max(highest_plus_one, configured > 0 ? static_cast<unsigned>(configured) : 1u);
}
}  // namespace

unsigned cpu_shard_count() noexcept {
  // The list of possible CPUs does not change. A cache, not a function-local static: a
  // fork() child must never inherit the static's guard taken by a thread it does not have.
  // Relaxed: every thread computes the same value.
  static constinit std::atomic<unsigned> shards{0};
  unsigned count = shards.load(std::memory_order_relaxed);
  if (count == 0) [[unlikely]] {
    count = std::bit_ceil(possible_cpu_numbers());
    shards.store(count, std::memory_order_relaxed);
  }
  return count;
}
}  // namespace detail

namespace {
// Requests of at least this many bytes, in whole pages, are mapped directly. glibc serves an
// aligned 64 KiB request (the pool's chunks) from its heap by carving a block of twice the
// size and freeing the ends, and writes a header into each end: a page of resident waste per
// chunk (5 MiB in a map of a million elements) and fragments that keep the heap from
// shrinking. A mapping costs no resident byte beyond the request and is returned whole.
constexpr std::size_t kMappedMinBytes = std::size_t{64} << 10;

std::size_t page_bytes() noexcept {
  // A cache, not a function-local static: see cpu_shard_count(). Relaxed: the same value.
  static constinit std::atomic<std::size_t> bytes{0};
  std::size_t size = bytes.load(std::memory_order_relaxed);
  if (size == 0) [[unlikely]] {
    size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    bytes.store(size, std::memory_order_relaxed);
  }
  return size;
}

bool served_by_mapping(std::size_t bytes) noexcept {
  return bytes >= kMappedMinBytes && bytes % page_bytes() == 0;
}

void* map_aligned(std::size_t bytes, std::size_t alignment) noexcept {
  const std::size_t slack = alignment > page_bytes() ? alignment - page_bytes() : 0;
  void* mapped = ::mmap(nullptr, bytes + slack, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(mapped);
  const std::uintptr_t aligned = (start + alignment - 1) & ~(std::uintptr_t{alignment} - 1);
  // Unmap the slack on both sides of the aligned block.
  if (aligned != start) ::munmap(mapped, aligned - start);
  if (const std::size_t tail = start + bytes + slack - (aligned + bytes); tail != 0) {
    ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  }
  return reinterpret_cast<void*>(aligned);
}
}  // namespace

void* system_allocator::malloc_allocate(std::size_t bytes, std::size_t alignment,
                                        void*) noexcept {
  if (served_by_mapping(bytes)) return map_aligned(bytes, alignment);
  if (alignment <= alignof(std::max_align_t)) return std::malloc(bytes);
  return std::aligned_alloc(alignment, (bytes + alignment - 1) & ~(alignment - 1));
}

void system_allocator::malloc_deallocate(void* memory, std::size_t bytes, void*) noexcept {
  if (served_by_mapping(bytes)) {
    ::munmap(memory, bytes);
  } else {
    std::free(memory);
  }
}

domain::domain(domain_options options)
    : options_((validate(options), options)),
      shards_(std::make_unique<detail::retire_shard[]>(detail::cpu_shard_count())),
      shard_mask_(detail::cpu_shard_count() - 1),
      block_capacity_(options_.batching == batching::per_object ? 1
                                                                 : detail::kRetireBlockCapacity),
      // A block holding more than its share of the soft byte limit is handed in at once, so
      // open blocks never hide more than the soft limit.
      block_bytes_budget_(
          std::max<std::uint64_t>(1, options_.soft_limit_bytes / (shard_mask_ + 1))),
      engine_(std::make_unique<detail::reclaim_engine>(*this)) {}

domain::~domain() {
  // Relaxed: see users_.
  if (const std::size_t users = users_.load(std::memory_order_relaxed); users != 0) {
    std::fprintf(stderr,
                 "grace: grace::domain at %p destroyed while %zu object pool(s) built on it "
                 "still exist (each grace::hash_map has one); destroy them first%s\n",
                 static_cast<void*>(this), users,
                 detail::process_fork_generation() != 0
                     ? " (in a fork() child, pools of the parent's threads count too: leave "
                       "the domain alive or end the child with _exit())"
                     : "");
    std::abort();
  }
  barrier();
  engine_.reset();  // stops the threads after a last flush
  const std::size_t size = detail::retire_block::bytes_for(block_capacity_);
  for (unsigned i = 0; i <= shard_mask_; ++i) {
    for (auto& slot : shards_[i].spare) {
      // Relaxed: the engine's threads have been joined; nothing else touches the shards.
      if (detail::retire_block* block = slot.load(std::memory_order_relaxed)) {
        block->~retire_block();
        options_.allocator.deallocate(block, size, options_.allocator.context);
      }
    }
  }
}

namespace {
// Built once, under detail::global_domain_mutex (fork_internal.h), never destroyed: threads
// may retire during exit.
constinit std::atomic<domain*> global_domain{nullptr};
}  // namespace

domain& domain::global() noexcept {
  // Acquire: the built domain; pairs with the Release store below.
  if (domain* built = global_domain.load(std::memory_order_acquire)) [[likely]] return *built;
  // Before the lock: pthread_atfork() waits for a fork() in progress, which waits for the lock.
  // A failure is reported by the domain's constructor.
  (void)detail::install_fork_handlers();
  std::lock_guard lock(detail::global_domain_mutex);
  // Relaxed: builders are ordered by the mutex.
  if (domain* built = global_domain.load(std::memory_order_relaxed)) return *built;
  auto* created = new domain();
  std::atexit(flush_global_domain_at_exit);
  // Release: publishes the built domain to the Acquire load above.
  global_domain.store(created, std::memory_order_release);
  return *created;
}

void domain::retire_slow(detail::retire_shard& shard, detail::retire_block* taken,
                         void* object, void (*deleter)(void*), std::size_t bytes) noexcept {
  const auto shard_index = static_cast<unsigned>(&shard - shards_.get());
  const bool holds_shard = taken != detail::shard_held();
  detail::retire_block* block = engine_->take_block(shard_index);
  if (block == nullptr) [[unlikely]] {
    // Release (R4): end the hold before the emergency path, which may block.
    if (holds_shard) shard.open.store(nullptr, std::memory_order_release);
    engine_->emergency_reclaim(object, deleter, bytes);
    return;
  }
  block->push(object, deleter, bytes);
  if (!holds_shard) {
    // Another thread holds this CPU's shard (it was preempted there, or migrated): never
    // wait for it; our own block goes straight to the engine.
    engine_->hand_in(block);
    engine_->check_limits_after_submit();
    return;
  }
  if (block->full() || block->bytes >= block_bytes_budget_) {
    submit_slow(shard, block);
    return;
  }
  // SeqCst (R4): ends the hold (Release for the entries) and is ordered before
  // note_block_opened()'s flag load: a Dekker pair with flush_shards()'s flag store and
  // shard scan, so the GP thread either sees this block or is told to drain it later.
  shard.open.store(block, std::memory_order_seq_cst);
  engine_->note_block_opened();
}

void domain::submit_slow(detail::retire_shard& shard, detail::retire_block* block) noexcept {
  engine_->hand_in(block);  // (I0): submitted before the hold ends
  // Release (R4): end the hold; pairs with (R3).
  shard.open.store(nullptr, std::memory_order_release);
  engine_->check_limits_after_submit();
}

void domain::synchronize() {
  if (in_read_section()) {
    throw std::logic_error(
        "grace::domain::synchronize() called inside a read section: the grace period would "
        "wait for the caller's own read_guard. Call it after the guard is destroyed.");
  }
  engine_->run_grace_period();
}

void domain::barrier() { engine_->barrier(); }

void domain::request_gp() noexcept { engine_->request_gp(gp_cookie(), /*claim_overdue=*/false); }

bool domain::request_gp_claiming_overdue() noexcept {
  return engine_->request_gp(gp_cookie(), /*claim_overdue=*/true);
}

void domain::synchronize_when_unpinned() noexcept {
  if (in_read_section()) {
    detail::defer_grace_period(engine_.get());
  } else {
    engine_->run_grace_period();
  }
}

domain_stats domain::stats() const noexcept { return engine_->stats(); }

}  // namespace grace
