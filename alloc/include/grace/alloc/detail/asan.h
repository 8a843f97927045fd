// Internal. Do not include directly.
//
// AddressSanitizer poisoning of pooled objects: an object waiting in a ready magazine is
// poisoned, so a reader that kept a stale pointer past its grace period is caught. Objects
// waiting for their grace period are never poisoned: readers may still use them legally.
#pragma once

#include <cstddef>

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

inline void asan_poison(void* object, std::size_t bytes) noexcept {
#ifdef GRACE_ASAN
  ASAN_POISON_MEMORY_REGION(object, bytes);
#else
  (void)object;
  (void)bytes;
#endif
}

inline void asan_unpoison(void* object, std::size_t bytes) noexcept {
#ifdef GRACE_ASAN
  ASAN_UNPOISON_MEMORY_REGION(object, bytes);
#else
  (void)object;
  (void)bytes;
#endif
}

}  // namespace grace::detail
