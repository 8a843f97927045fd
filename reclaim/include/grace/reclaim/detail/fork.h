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

}  // namespace grace::detail
