// Resident set size of this process, read from /proc/self/statm by a background thread every
// 10 ms, with the peak since the last reset_peak().
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

namespace grace::bench {

inline constexpr std::chrono::milliseconds kRssSamplePeriod{10};
inline constexpr double kBytesPerMib = 1024.0 * 1024.0;

// The current RSS in bytes (one read of /proc/self/statm); 0 if it cannot be read.
std::uint64_t current_rss_bytes() noexcept;
// Resident anonymous memory: statm's resident minus its shared (file-backed) pages. The
// kernel may page out cold library text meanwhile (DAMON runs on the machines grace is
// measured on), which total RSS would count as memory given back.
std::uint64_t anon_rss_bytes() noexcept;

class rss_sampler {
 public:
  rss_sampler();
  ~rss_sampler();
  rss_sampler(const rss_sampler&) = delete;
  rss_sampler& operator=(const rss_sampler&) = delete;

  // Starts a new measurement: the peak becomes the current RSS.
  void reset_peak() noexcept;
  // The highest RSS seen since reset_peak(), including one fresh read now.
  std::uint64_t peak_bytes() noexcept;

 private:
  void run() noexcept;
  void sample() noexcept;

  // A sample is read and folded into the peak under the mutex, so a read taken before
  // reset_peak() can never land after it.
  std::mutex mutex_;
  std::uint64_t peak_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace grace::bench
