// Internal. Do not include directly.
//
// AddressSanitizer poisoning of pooled objects: an object waiting in a ready magazine is
// poisoned, so a reader that kept a stale pointer past its grace period is caught. Objects
// waiting for their grace period are never poisoned: readers may still use them legally.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__SANITIZE_ADDRESS__)
#define GRACE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GRACE_ASAN 1
#endif
#endif

#ifdef GRACE_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace grace::detail {

#ifdef GRACE_ASAN
// ASan's shadow describes memory in 8-byte granules, and a granule shared by two objects
// (objects whose size is not a multiple of 8) cannot be poisoned for one and not the other:
// only the granules an object owns entirely are poisoned and unpoisoned, so a neighbour in
// use, perhaps on another thread, is never touched.
inline constexpr std::uintptr_t kAsanGranule = 8;

inline void asan_owned_granules(void* object, std::size_t bytes, char*& begin,
                                std::size_t& length) noexcept {
  const auto first = reinterpret_cast<std::uintptr_t>(object);
  const std::uintptr_t start = (first + kAsanGranule - 1) & ~(kAsanGranule - 1);
  const std::uintptr_t end = (first + bytes) & ~(kAsanGranule - 1);
  begin = reinterpret_cast<char*>(start);
  length = end > start ? end - start : 0;
}
#endif

inline void asan_poison(void* object, std::size_t bytes) noexcept {
#ifdef GRACE_ASAN
  char* begin;
  std::size_t length;
  asan_owned_granules(object, bytes, begin, length);
  if (length != 0) ASAN_POISON_MEMORY_REGION(begin, length);
#else
  (void)object;
  (void)bytes;
#endif
}

inline void asan_unpoison(void* object, std::size_t bytes) noexcept {
#ifdef GRACE_ASAN
  char* begin;
  std::size_t length;
  asan_owned_granules(object, bytes, begin, length);
  if (length != 0) ASAN_UNPOISON_MEMORY_REGION(begin, length);
#else
  (void)object;
  (void)bytes;
#endif
}

}  // namespace grace::detail
