// Internal. Do not include directly.
//
// The object pool's fast paths as restartable sequences (rseq): a pop from, or a push onto, a
// magazine of the cache of the CPU the thread runs on, with no atomic instruction; and a
// per-CPU add (rseq_add) for the layers above. The kernel diverts a sequence preempted,
// migrated or signalled before its commit (its last store) to its abort label, which here
// returns "not done": the pool's caller then takes the cache's flag as it does without
// rseq. Invariants (P8), (P9) and ordering (A8) are in magazine.h.
//
// A sequence is described to the kernel by a struct rseq_cs (start, length, abort address)
// that the sequence stores into the thread's rseq area (glibc's, at __rseq_offset from the
// thread pointer) before its first instruction. The descriptor and the abort stub live in
// sections of their own, put with "?" into the section group of the function they are
// emitted in, so that the linker discards them with a discarded copy of an inline function.
// The abort stub is preceded by the signature glibc registered (RSEQ_SIG), as the kernel
// requires, inside the operand of an undefined instruction (ud1) as the rseq ABI suggests.
#pragma once

#include <cstddef>
#include <cstdint>

#include "grace/alloc/detail/magazine.h"
#include "grace/reclaim/detail/cpu.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define GRACE_POOL_TSAN 1
#endif
#endif
#if defined(__x86_64__) && defined(__linux__) && !defined(__SANITIZE_THREAD__) && \
    !defined(GRACE_POOL_TSAN)
#define GRACE_POOL_RSEQ 1
#else
#define GRACE_POOL_RSEQ 0
#endif
#undef GRACE_POOL_TSAN

namespace grace::detail {

// Whether pools may use their restartable sequences in this process: the build and the CPU
// allow them (GRACE_POOL_RSEQ), glibc registered rseq areas, and membarrier's RSEQ fence is
// registered (A8). Asked once per process.
bool restartable_sequences_available() noexcept;

// Whether rseq_add() can commit in this process: it needs no fence, only the build's and
// glibc's rseq. A thread whose own registration failed reads a CPU number past every slot,
// and its adds report a restart.
inline bool per_cpu_adds_available() noexcept { return GRACE_POOL_RSEQ && __rseq_size != 0; }

#if GRACE_POOL_RSEQ

static_assert(offsetof(struct rseq, cpu_id) == 4 && offsetof(struct rseq, rseq_cs) == 8,
              "the rseq ABI's layout");
static_assert(offsetof(pool_cache, held) == 0 && sizeof(std::atomic<bool>) == 1,
              "the sequences test the flag's byte");
static_assert(offsetof(magazine, pushed) == offsetof(magazine, count) + 4,
              "a push commits count and pushed as one little-endian word");
static_assert((sizeof(pool_cache) & (sizeof(pool_cache) - 1)) == 0,
              "the sequences index caches by a shift");

inline constexpr int kCacheShift = __builtin_ctzll(sizeof(pool_cache));

// Descriptor (3:), its store into the rseq area, the start (1:), the CPU's number in %rax:
// the sequence leaves through 4: if the CPU has no slot of its own (%[cpu_slots] of them).
// The body follows; the epilogue marks the end (2:) and the abort stub (4:). Both ways out
// clear the area's rseq_cs again (the kernel also does on an abort): the kernel reads the
// descriptor a non-null rseq_cs points to at every preemption, and one left behind in a
// library that is then unloaded (dlclose) would fault there and kill the thread.
#define GRACE_RSEQ_BEGIN                                                 \
  ".pushsection __rseq_cs, \"aw?\"\n\t"                                  \
  ".balign 32\n\t"                                                       \
  "3:\n\t"                                                               \
  ".long 0, 0\n\t"                                                       \
  ".quad 1f, 2f - 1f, 4f\n\t"                                            \
  ".popsection\n\t"                                                      \
  "leaq 3b(%%rip), %%rax\n\t"                                            \
  "movq %%rax, %%fs:8(%[rseq_area])\n\t"                                 \
  "1:\n\t"                                                               \
  "movl %%fs:4(%[rseq_area]), %%eax\n\t"                                 \
  "cmpl %k[cpu_slots], %%eax\n\t"                                        \
  "jae 4f\n\t"

// The pool's sequences: GRACE_RSEQ_BEGIN, then the CPU's cache in %rax, leaving through 4:
// if the cache is held.
#define GRACE_RSEQ_PROLOGUE                                              \
  GRACE_RSEQ_BEGIN                                                       \
  "shlq %[cache_shift], %%rax\n\t"                                       \
  "addq %[caches], %%rax\n\t"                                            \
  "cmpb $0, (%%rax)\n\t"                                                 \
  "jne 4f\n\t"

#define GRACE_RSEQ_EPILOGUE                                              \
  "2:\n\t"                                                               \
  "movq $0, %%fs:8(%[rseq_area])\n\t"                                    \
  ".pushsection __rseq_failure, \"ax?\"\n\t"                             \
  ".byte 0x0f, 0xb9, 0x3d\n\t"                                           \
  ".long %c[signature]\n\t"                                              \
  "4:\n\t"                                                               \
  "movq $0, %%fs:8(%[rseq_area])\n\t"                                    \
  "jmp %l[fallback]\n\t"                                                 \
  ".popsection\n\t"

#define GRACE_RSEQ_SEQUENCE_INPUTS [rseq_area] "r"(__rseq_offset), [signature] "i"(RSEQ_SIG)
#define GRACE_RSEQ_COMMON_INPUTS                                                         \
  GRACE_RSEQ_SEQUENCE_INPUTS, [cpu_slots] "r"(caches_count), [caches] "r"(caches), \
      [cache_shift] "i"(kCacheShift)

// Pops an object from the loaded magazine of the current CPU's cache; nullptr if it cannot
// (empty, held, no cache of its own, or restarted). caches_count: the caches at `caches`.
// The object comes back through memory, not an asm goto output operand: an output written
// before the last input is read needs an early-clobber constraint ("=&r") to keep its
// register apart from the inputs', and a first version without one, built by GCC 12 at
// -O3, returned garbage objects. A store to the caller's variable needs neither.
inline void* rseq_pop(pool_cache* caches, unsigned caches_count) noexcept {
  void* object;
  asm goto(GRACE_RSEQ_PROLOGUE
           "movq %c[loaded](%%rax), %%rcx\n\t"
           "testq %%rcx, %%rcx\n\t"
           "jz 4f\n\t"
           "movq %c[count](%%rcx), %%rdx\n\t"  // count | pushed << 32, read as a push writes it
           "movl %%edx, %%eax\n\t"
           "subl $1, %%eax\n\t"
           "jb 4f\n\t"
           "movq %c[objects](%%rcx,%%rax,8), %%rax\n\t"
           "movq %%rax, (%[object])\n\t"  // the caller's own; ignored if the sequence restarts
           "subq $1, %%rdx\n\t"
           "movq %%rdx, %c[count](%%rcx)\n\t"  // the commit: count - 1
           GRACE_RSEQ_EPILOGUE
           :
           : GRACE_RSEQ_COMMON_INPUTS, [object] "r"(&object),
             [loaded] "i"(offsetof(pool_cache, loaded)), [count] "i"(offsetof(magazine, count)),
             [objects] "i"(sizeof(magazine))
           : "rax", "rcx", "rdx", "memory", "cc"
           : fallback);
  return object;
fallback:
  return nullptr;
}

// Pushes `object` onto the magazine at byte offset `target` of the current CPU's cache
// (`freed`, or `loaded` without reuse_after_gp); false if it cannot (full, `pushed` at its
// limit, held, no cache of its own, or restarted).
inline bool rseq_push(pool_cache* caches, unsigned caches_count, std::size_t target,
                      void* object) noexcept {
  asm goto(GRACE_RSEQ_PROLOGUE
           "movq (%%rax,%[target]), %%rcx\n\t"
           "testq %%rcx, %%rcx\n\t"
           "jz 4f\n\t"
           "movq %c[count](%%rcx), %%rdx\n\t"  // count | pushed << 32
           "cmpl %c[capacity](%%rcx), %%edx\n\t"
           "jae 4f\n\t"
           "movq %%rdx, %%rax\n\t"
           "shrq $32, %%rax\n\t"
           "cmpl $-1, %%eax\n\t"
           "je 4f\n\t"
           "movl %%edx, %%eax\n\t"
           "movq %[object], %c[objects](%%rcx,%%rax,8)\n\t"  // past count: unseen until the commit
           "addq %[one_each], %%rdx\n\t"
           "movq %%rdx, %c[count](%%rcx)\n\t"  // the commit: count + 1, pushed + 1
           GRACE_RSEQ_EPILOGUE
           :
           : GRACE_RSEQ_COMMON_INPUTS, [target] "r"(target), [object] "r"(object),
             [one_each] "r"(std::uint64_t{0x100000001}),
             [count] "i"(offsetof(magazine, count)), [capacity] "i"(offsetof(magazine, capacity)),
             [objects] "i"(sizeof(magazine))
           : "rax", "rcx", "rdx", "memory", "cc"
           : fallback);
  return true;
fallback:
  return false;
}

// Adds `delta` to the 8-byte word at `first_word` + (current CPU << WordShift) bytes; false if
// it cannot (no word of its own for the CPU, or restarted): the caller then adds elsewhere,
// by an atomic instruction. One add instruction is the commit, so a preempted or migrated
// thread either added on the CPU it ran on, alone there, or not at all: per-CPU counts with
// no atomic instruction (the map's element count). The word must only ever be written by
// these sequences; readers load it Relaxed (an aligned 8-byte store is single-copy atomic).
template <int WordShift>
inline bool rseq_add(void* first_word, unsigned cpu_slots, std::int64_t delta) noexcept {
  asm goto(GRACE_RSEQ_BEGIN
           "shlq %[word_shift], %%rax\n\t"
           "addq %[delta], (%[words],%%rax)\n\t"  // the commit
           GRACE_RSEQ_EPILOGUE
           :
           : GRACE_RSEQ_SEQUENCE_INPUTS, [cpu_slots] "r"(cpu_slots), [words] "r"(first_word),
             [delta] "r"(delta), [word_shift] "i"(WordShift)
           : "rax", "memory", "cc"
           : fallback);
  return true;
fallback:
  return false;
}

#undef GRACE_RSEQ_COMMON_INPUTS
#undef GRACE_RSEQ_SEQUENCE_INPUTS
#undef GRACE_RSEQ_EPILOGUE
#undef GRACE_RSEQ_PROLOGUE
#undef GRACE_RSEQ_BEGIN

#else  // !GRACE_POOL_RSEQ: never called (restartable_sequences_available() and
       // per_cpu_adds_available() are false)

inline void* rseq_pop(pool_cache*, unsigned) noexcept { return nullptr; }
inline bool rseq_push(pool_cache*, unsigned, std::size_t, void*) noexcept { return false; }
template <int WordShift>
inline bool rseq_add(void*, unsigned, std::int64_t) noexcept { return false; }

#endif

}  // namespace grace::detail
