// Futex wait/wake on a 32-bit atomic word (Linux). Internal to reclaim/src.
//
// The engine uses raw futexes rather than std::atomic::wait because a waker may touch a word
// that lives on a waiter's stack (a barrier_marker): FUTEX_WAKE only uses the address as a
// key and never dereferences it, so waking after the waiter has returned is harmless.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>

namespace grace::detail {

// Sleeps while *word == expected, at most `timeout` (negative: no limit). Spurious returns
// are allowed; callers re-check their condition.
inline void futex_wait(const std::atomic<std::uint32_t>& word, std::uint32_t expected,
                       std::chrono::nanoseconds timeout = std::chrono::nanoseconds(-1)) noexcept {
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout.count() >= 0) {
    ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
    tsp = &ts;
  }
  syscall(SYS_futex, reinterpret_cast<const std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected,
          tsp, nullptr, 0);
}

inline void futex_wake_all(const std::atomic<std::uint32_t>& word) noexcept {
  syscall(SYS_futex, reinterpret_cast<const std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX,
          nullptr, nullptr, 0);
}

static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t) &&
              std::atomic<std::uint32_t>::is_always_lock_free);

}  // namespace grace::detail
