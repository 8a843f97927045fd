// Internal. Do not include directly.
//
// The process's fork generation: how many fork()s lie between this process and the one that
// first used grace. grace's pthread_atfork child handler (reclaim/src/fork.cc) bumps it
// first, before it restarts grace's threads or runs any deleter, so those and every thread
// created later read the new value. (A thread that another library's child handler, run
// before grace's, started in the child may read the old one: such a thread must not use a
// pool or a map until fork() has returned.) A layer above uses it to recognise state that a
// thread of the parent held at the copy (alloc/'s chunk lock, the pool's trim flags, the
// map's resize turn). Meaningful once
// a domain exists (it installs the handler).
#pragma once

#include <cstdint>

namespace grace::detail {

std::uint32_t process_fork_generation() noexcept;

// A layer above whose threads hold per-CPU state for a few instructions at a time (alloc/'s
// pool caches) lets fork() hold all of it across the copy: grace's prepare handler calls
// `hold` last, once grace periods, the reclaim workers and the retire shards are held
// still, so `hold` waits only for threads inside those short holds (which wait for nothing a
// fork holds); the parent's and the child's handlers call their `release` first, before any
// thread of grace restarts (another library's child handler registered before grace's
// runs earlier, and meets the layer's state still held). A layer sets its static hooks once,
// while the program starts (alloc/ does so from a namespace-scope initializer, before any
// pool can exist); a fork whose prepare handler began before that calls none of them.
struct fork_hooks {
  void (*hold)() noexcept;
  void (*release_in_parent)() noexcept;
  void (*release_in_child)() noexcept;
};
void set_fork_hooks(const fork_hooks* hooks) noexcept;

}  // namespace grace::detail
