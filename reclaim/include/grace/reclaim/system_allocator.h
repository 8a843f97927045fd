// grace::system_allocator: where grace's own bookkeeping memory comes from.
//
// The domain's retire blocks (and, in alloc/, the pool's chunks) are taken from a
// system_allocator. The default uses std::malloc/std::free, and maps requests of 64 KiB or
// more in whole pages directly (mmap/munmap: no allocator header beside them, returned to
// the system whole). Tests inject one that fails on demand to prove that every path
// survives allocation failure: a failed allocation is reported by returning nullptr, never
// by throwing.
#pragma once

#include <cstddef>

namespace grace {

struct system_allocator {
  // Returns `bytes` of memory aligned to `alignment` (a power of two, at least
  // alignof(std::max_align_t)), or nullptr.
  void* (*allocate)(std::size_t bytes, std::size_t alignment, void* context) noexcept =
      &malloc_allocate;
  // Releases memory returned by allocate(); `bytes` is the size it was asked for.
  void (*deallocate)(void* memory, std::size_t bytes, void* context) noexcept = &malloc_deallocate;
  // Passed to both functions unchanged.
  void* context = nullptr;

  static void* malloc_allocate(std::size_t bytes, std::size_t alignment, void* context) noexcept;
  // Also takes back, in one call, adjacent mapped blocks (of 64 KiB or more each) given as one
  // block, their sizes summed: one munmap(), and so one TLB shootdown of the other CPUs, for
  // the run. The pool gives back runs of chunks so when its allocator is this one.
  static void malloc_deallocate(void* memory, std::size_t bytes, void* context) noexcept;
};

}  // namespace grace
