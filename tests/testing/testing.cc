#include "tests/testing/testing.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "grace/reclaim/detail/cpu.h"
#include "grace/reclaim/read_guard.h"

namespace grace::testing {

std::size_t iterations(std::size_t plain) noexcept {
  const std::size_t n = kSanitized ? plain / kSanitizerDivisor : plain;
  return std::max<std::size_t>(n, 1);
}

std::size_t iterations(std::size_t plain, std::size_t sanitized) noexcept {
  return std::max<std::size_t>(kSanitized ? sanitized : plain, 1);
}

// ---------------------------------------------------------------------------------------------

watchdog::watchdog(std::chrono::milliseconds timeout, std::string what) : what_(std::move(what)) {
  thread_ = std::thread([this, timeout] {
    std::unique_lock lock(mutex_);
    started_ = true;
    done_cv_.notify_all();
    if (!done_cv_.wait_for(lock, timeout, [this] { return done_; })) {
      std::fprintf(stderr, "watchdog: '%s' did not finish within %lld ms (deadlock?)\n",
                   what_.c_str(), static_cast<long long>(timeout.count()));
      std::fflush(stderr);
      std::abort();
    }
  });
  // Return only once the thread waits (it released the mutex in wait_for): a test that
  // forks right after must not copy the process while the new thread is still starting,
  // inside the allocator (fork_test.cc).
  std::unique_lock lock(mutex_);
  done_cv_.wait(lock, [this] { return started_; });
}

watchdog::~watchdog() {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
  }
  done_cv_.notify_one();
  thread_.join();
}

void guard_holder::start() {
  thread_ = std::thread([this] {
    auto g = grace::pin();
    // Release: the guard is held; pairs with the Acquire load below.
    inside_.store(true, std::memory_order_release);
    // Acquire: pairs with the Release store in release().
    while (!leave_.load(std::memory_order_acquire)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  // Acquire: the thread is inside its read section; pairs with the Release store above.
  while (!inside_.load(std::memory_order_acquire)) std::this_thread::yield();
}

void guard_holder::release() {
  // Release: lets the thread leave; pairs with the Acquire load in its loop.
  leave_.store(true, std::memory_order_release);
  thread_.join();
}

guard_holder::~guard_holder() {
  if (thread_.joinable()) release();
}

lingering_reader::lingering_reader(std::chrono::milliseconds hold, unsigned goes,
                                   section enter) {
  if (!enter) {
    enter = [](const std::function<void()>& body) {
      auto g = grace::pin();
      body();
    };
  }
  thread_ = std::thread([this, hold, goes, enter = std::move(enter)] {
    enter([&] {
      // Release: the reader is inside; pairs with the Acquire load in wait_until_inside().
      inside_.store(true, std::memory_order_release);
      // Acquire: pairs with the Release increments in go() (only gates the sequence).
      while (goes_.load(std::memory_order_acquire) < goes) std::this_thread::yield();
      std::this_thread::sleep_for(hold);  // widens the window; not synchronization
      // Release: the last act inside the section; pairs with the Acquire load in
      // left_section() and in whatever checks leaving().
      leaving_->store(true, std::memory_order_release);
    });
  });
}

lingering_reader::~lingering_reader() {
  // A test that ends early (a failed assertion, an exception) may not have said go() as
  // often as the reader waits for: let it leave, or the join would wait for ever. Release:
  // pairs with the reader's Acquire spin on goes_.
  goes_.store(std::numeric_limits<unsigned>::max(), std::memory_order_release);
  join();
}

void lingering_reader::wait_until_inside() const {
  // Acquire: pairs with the reader's Release store of inside_.
  while (!inside_.load(std::memory_order_acquire)) std::this_thread::yield();
}

void lingering_reader::go() {
  // Release: pairs with the reader's Acquire spin on goes_.
  goes_.fetch_add(1, std::memory_order_release);
}

bool lingering_reader::left_section() const {
  // Acquire: pairs with the reader's Release store of leaving_, its last act inside.
  return leaving_->load(std::memory_order_acquire);
}

void lingering_reader::join() {
  if (thread_.joinable()) thread_.join();
}

bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return condition();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// ---------------------------------------------------------------------------------------------

grace::system_allocator failing_allocator::get() noexcept {
  grace::system_allocator allocator;
  allocator.allocate = &failing_allocator::allocate;
  allocator.deallocate = &failing_allocator::deallocate;
  allocator.context = this;
  return allocator;
}

void failing_allocator::fail_all(bool on) noexcept {
  // Relaxed: a test switch; the test orders it against its retire() calls by program order
  // or by its own thread synchronization.
  fail_all_.store(on, std::memory_order_relaxed);
}

void failing_allocator::fail_nth(std::uint64_t n) noexcept {
  // Relaxed (both): counters compared by value; which concurrent attempt is "n-th" is
  // arbitrary anyway.
  const std::uint64_t now = attempts_.load(std::memory_order_relaxed);
  fail_at_.store(n == 0 ? 0 : now + n, std::memory_order_relaxed);
}

std::uint64_t failing_allocator::attempts() const noexcept {
  return attempts_.load(std::memory_order_relaxed);  // Relaxed: a statistic.
}
std::uint64_t failing_allocator::failures() const noexcept {
  return failures_.load(std::memory_order_relaxed);  // Relaxed: a statistic.
}
std::int64_t failing_allocator::live_allocations() const noexcept {
  return live_allocations_.load(std::memory_order_relaxed);  // Relaxed: read after joins.
}
std::int64_t failing_allocator::live_bytes() const noexcept {
  return live_bytes_.load(std::memory_order_relaxed);  // Relaxed: read after joins.
}

void* failing_allocator::allocate(std::size_t bytes, std::size_t alignment,
                                  void* context) noexcept {
  auto* self = static_cast<failing_allocator*>(context);
  // Relaxed (all counters here): each is an independent tally; nothing is published.
  const std::uint64_t attempt = self->attempts_.fetch_add(1, std::memory_order_relaxed) + 1;
  bool fail = self->fail_all_.load(std::memory_order_relaxed);
  if (!fail && attempt == self->fail_at_.load(std::memory_order_relaxed)) {
    std::uint64_t expected = attempt;
    fail = self->fail_at_.compare_exchange_strong(expected, 0, std::memory_order_relaxed);
  }
  if (fail) {
    self->failures_.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  void* memory = nullptr;
  if (alignment <= alignof(std::max_align_t)) {
    memory = std::malloc(bytes);
  } else if (::posix_memalign(&memory, alignment, bytes) != 0) {
    memory = nullptr;
  }
  if (memory == nullptr) return nullptr;
  self->live_allocations_.fetch_add(1, std::memory_order_relaxed);
  self->live_bytes_.fetch_add(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
  return memory;
}

void failing_allocator::deallocate(void* memory, std::size_t bytes, void* context) noexcept {
  auto* self = static_cast<failing_allocator*>(context);
  if (memory == nullptr) return;
  // Relaxed: tallies, read by the test after the domain is destroyed.
  self->live_allocations_.fetch_sub(1, std::memory_order_relaxed);
  self->live_bytes_.fetch_sub(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
  std::free(memory);
}

// ---------------------------------------------------------------------------------------------

instance_tracker::instance_tracker(std::size_t ids)
    : ids_(ids), per_id_(new std::atomic<std::uint32_t>[ids]()) {}

// Relaxed (all tallies in this class): every reader of them first synchronizes with the
// destroying threads through the API under test (barrier(), a join, or an acquire of its
// own); that ordering is exactly what the tests check.
std::uint64_t instance_tracker::constructed() const noexcept {
  return constructed_.load(std::memory_order_relaxed);
}
std::uint64_t instance_tracker::destroyed() const noexcept {
  return destroyed_.load(std::memory_order_relaxed);
}
std::int64_t instance_tracker::live() const noexcept {
  return static_cast<std::int64_t>(constructed()) - static_cast<std::int64_t>(destroyed());
}
std::uint64_t instance_tracker::corrupt_destructions() const noexcept {
  return corrupt_.load(std::memory_order_relaxed);
}
std::uint32_t instance_tracker::destroyed_count(std::size_t id) const noexcept {
  return id < ids_ ? per_id_[id].load(std::memory_order_relaxed) : 0;
}

::testing::AssertionResult instance_tracker::each_destroyed_once(std::size_t first,
                                                                 std::size_t last) const {
  std::size_t wrong = 0;
  std::size_t first_wrong = 0;
  std::uint32_t first_wrong_count = 0;
  for (std::size_t id = first; id < last && id < ids_; ++id) {
    const std::uint32_t count = destroyed_count(id);
    if (count != 1) {
      if (wrong++ == 0) {
        first_wrong = id;
        first_wrong_count = count;
      }
    }
  }
  if (last > ids_) {
    return ::testing::AssertionFailure() << "ids [" << first << ", " << last
                                         << ") exceed the tracker's " << ids_ << " ids";
  }
  if (wrong == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << wrong << " of ids [" << first << ", " << last
         << ") were not destroyed exactly once; the first is id " << first_wrong
         << ", destroyed " << first_wrong_count << " times";
}

::testing::AssertionResult instance_tracker::none_destroyed(std::size_t first,
                                                            std::size_t last) const {
  for (std::size_t id = first; id < last && id < ids_; ++id) {
    if (const std::uint32_t count = destroyed_count(id); count != 0) {
      return ::testing::AssertionFailure()
             << "id " << id << " was already destroyed (" << count << " times)";
    }
  }
  return ::testing::AssertionSuccess();
}

void instance_tracker::on_construct() noexcept {
  constructed_.fetch_add(1, std::memory_order_relaxed);
}

void instance_tracker::on_destroy(std::size_t id, bool canary_intact) noexcept {
  if (!canary_intact) corrupt_.fetch_add(1, std::memory_order_relaxed);
  if (id < ids_) per_id_[id].fetch_add(1, std::memory_order_relaxed);
  destroyed_.fetch_add(1, std::memory_order_relaxed);
}

tracked::tracked(instance_tracker& tracker, std::size_t id) noexcept
    : tracker_(&tracker), id_(id) {
  tracker_->on_construct();
}

tracked::~tracked() {
  const bool was_intact = intact();
  // Relaxed: poison for readers that (wrongly) still hold the object; see intact().
  canary_.store(kPoison, std::memory_order_relaxed);
  tracker_->on_destroy(id_, was_intact);
}

// ---------------------------------------------------------------------------------------------

namespace {
struct statm_pages {
  std::size_t size = 0;
  std::size_t resident = 0;
};
statm_pages read_statm() {
  std::ifstream statm("/proc/self/statm");
  statm_pages pages;
  if (!(statm >> pages.size >> pages.resident)) return {};
  return pages;
}
}  // namespace

std::size_t current_rss_bytes() {
  return read_statm().resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

std::size_t current_address_space_bytes() {
  return read_statm().size * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

pid_t this_thread_id() noexcept { return ::gettid(); }

int thread_nice(pid_t tid) {
  std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return INT_MIN;
  // "tid (name) state ...": the name may hold spaces and parentheses, so fields are counted
  // from the last ')'. The nice value is field 19; the state, field 3, follows the ')'.
  const std::size_t name_end = line.rfind(')');
  if (name_end == std::string::npos) return INT_MIN;
  std::istringstream fields(line.substr(name_end + 1));
  std::string field;
  for (int number = 3; number < 19; ++number) {
    if (!(fields >> field)) return INT_MIN;
  }
  int nice = INT_MIN;
  fields >> nice;
  return nice;
}

std::map<pid_t, int> threads_named(std::string_view name) {
  std::map<pid_t, int> found;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string thread_name;
    if (!std::getline(comm, thread_name) || thread_name != name) continue;
    const auto tid = static_cast<pid_t>(std::stol(task.path().filename().string()));
    found.emplace(tid, thread_nice(tid));
  }
  return found;
}

std::map<pid_t, int> threads_named_since(std::string_view name,
                                         const std::map<pid_t, int>& before) {
  std::map<pid_t, int> started = threads_named(name);
  std::erase_if(started, [&](const auto& thread) { return before.contains(thread.first); });
  return started;
}

int wait_for_child(pid_t pid) noexcept {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return status;
}

::testing::AssertionResult exited_cleanly(int status) {
  if (status == -1) return ::testing::AssertionFailure() << "fork() or waitpid() failed";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return ::testing::AssertionSuccess();
  if (WIFEXITED(status)) {
    return ::testing::AssertionFailure()
           << "the child exited with code " << WEXITSTATUS(status) << " (see its stderr)";
  }
  if (WIFSIGNALED(status)) {
    return ::testing::AssertionFailure()
           << "the child was killed by signal " << WTERMSIG(status)
           << (WTERMSIG(status) == SIGALRM ? " (SIGALRM: it hung)" : "");
  }
  return ::testing::AssertionFailure() << "unexpected wait status " << status;
}

int child_failure(int code, const char* what, std::uint64_t detail) {
  std::fprintf(stderr, "child: %s (%llu)\n", what, static_cast<unsigned long long>(detail));
  return code;
}

bool pin_to_cpu(int cpu) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  return ::pthread_setaffinity_np(::pthread_self(), sizeof(one), &one) == 0;
}

saved_affinity::saved_affinity() {
  CPU_ZERO(&allowed_);
  saved_ = ::pthread_getaffinity_np(::pthread_self(), sizeof(allowed_), &allowed_) == 0;
}

saved_affinity::~saved_affinity() {
  if (saved_) ::pthread_setaffinity_np(::pthread_self(), sizeof(allowed_), &allowed_);
}

cpu_disturber::cpu_disturber() {
  struct sigaction wake {};
  wake.sa_handler = [](int) {};
  installed_ = ::sigaction(SIGURG, &wake, &previous_) == 0;
  EXPECT_TRUE(installed_) << "sigaction(SIGURG)";
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  EXPECT_EQ(::sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &allowed)) cpus_.push_back(cpu);
  }
  if (cpus_.empty()) cpus_.push_back(0);
}

cpu_disturber::~cpu_disturber() {
  if (installed_) ::sigaction(SIGURG, &previous_, nullptr);
}

void cpu_disturber::disturb(std::vector<std::thread>& threads) {
  for (std::size_t t = 0; t < threads.size(); ++t) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus_[(round_ + t) % cpus_.size()], &one);
    EXPECT_EQ(::pthread_setaffinity_np(threads[t].native_handle(), sizeof(one), &one), 0);
    EXPECT_EQ(::pthread_kill(threads[t].native_handle(), SIGURG), 0);
    ++disturbances_;
  }
  ++round_;
}

std::array<int, 2> two_cpus_with_their_own_shards() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return {-1, -1};
  const int shards = static_cast<int>(grace::detail::cpu_shard_count());
  int first = -1;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (first < 0) {
      first = cpu;
    } else if (cpu % shards != first % shards) {
      return {first, cpu};
    }
  }
  return {-1, -1};
}

namespace {
void* map_pages(std::size_t bytes, std::size_t alignment, void*) noexcept {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t size = (bytes + page - 1) / page * page;
  const std::size_t slack = alignment > page ? alignment : 0;
  void* raw = ::mmap(nullptr, size + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned =
      slack == 0 ? start : (start + alignment - 1) & ~(std::uintptr_t{alignment} - 1);
  if (aligned != start) ::munmap(raw, aligned - start);
  const std::uintptr_t end = start + size + slack;
  if (end != aligned + size) {
    ::munmap(reinterpret_cast<void*>(aligned + size), end - aligned - size);
  }
  return reinterpret_cast<void*>(aligned);
}

void unmap_pages(void* memory, std::size_t bytes, void*) noexcept {
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  ::munmap(memory, (bytes + page - 1) / page * page);
}

}  // namespace

const grace::system_allocator mapping_allocator{&map_pages, &unmap_pages, nullptr};

}  // namespace grace::testing
