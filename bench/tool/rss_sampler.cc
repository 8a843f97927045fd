#include "tool/rss_sampler.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace grace::bench {

namespace {
// statm: size resident shared text lib data dt (pages). A raw read: no allocation, so the
// sampler itself does not move the number it measures. False if it cannot be read.
bool read_statm(std::uint64_t& resident_bytes, std::uint64_t& shared_bytes) noexcept {
  static const long kPageBytes = sysconf(_SC_PAGESIZE);
  const int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char text[128];
  const ssize_t length = read(fd, text, sizeof text - 1);
  close(fd);
  if (length <= 0) return false;
  text[length] = '\0';
  unsigned long long size_pages = 0;
  unsigned long long resident_pages = 0;
  unsigned long long shared_pages = 0;
  if (std::sscanf(text, "%llu %llu %llu", &size_pages, &resident_pages, &shared_pages) != 3) {
    return false;
  }
  resident_bytes = resident_pages * static_cast<std::uint64_t>(kPageBytes);
  shared_bytes = shared_pages * static_cast<std::uint64_t>(kPageBytes);
  return true;
}
}  // namespace

std::uint64_t current_rss_bytes() noexcept {
  std::uint64_t resident = 0;
  std::uint64_t shared = 0;
  return read_statm(resident, shared) ? resident : 0;
}

std::uint64_t anon_rss_bytes() noexcept {
  std::uint64_t resident = 0;
  std::uint64_t shared = 0;
  if (!read_statm(resident, shared)) return 0;
  return resident - std::min(shared, resident);
}

rss_sampler::rss_sampler() : thread_([this] { run(); }) {}

rss_sampler::~rss_sampler() {
  // Relaxed: a stop request; the join below is the synchronization.
  stop_.store(true, std::memory_order_relaxed);
  thread_.join();
}

void rss_sampler::sample() noexcept {
  std::lock_guard lock(mutex_);
  peak_ = std::max(peak_, current_rss_bytes());
}

void rss_sampler::reset_peak() noexcept {
  std::lock_guard lock(mutex_);
  peak_ = current_rss_bytes();
}

std::uint64_t rss_sampler::peak_bytes() noexcept {
  sample();
  std::lock_guard lock(mutex_);
  return peak_;
}

void rss_sampler::run() noexcept {
  // Relaxed: a stop request; the join in the destructor is the synchronization.
  while (!stop_.load(std::memory_order_relaxed)) {
    sample();
    std::this_thread::sleep_for(kRssSamplePeriod);
  }
}

}  // namespace grace::bench
