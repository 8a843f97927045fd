// Internal. Do not include directly.
//
// The process's fork generation: how many fork()s lie between this process and the one that
// first used grace. grace's pthread_atfork child handler (reclaim/src/fork.cc) bumps it
// before the child has any other thread, so every thread of the child reads the new value.
// A layer above uses it to recognise state that a thread of the parent held at the copy
// (alloc/'s chunk lock). Meaningful once a domain exists (it installs the handler).
#pragma once

#include <cstdint>

namespace grace::detail {

std::uint32_t fork_generation() noexcept;

}  // namespace grace::detail
