#include "tool/gp_counter.h"

#include <dlfcn.h>
#include <urcu/urcu-memb.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace grace::bench {
namespace {

std::atomic<std::uint64_t> g_grace_periods{0};
constinit thread_local bool tls_excluded = false;

using synchronize_fn = void (*)();

synchronize_fn real_synchronize() noexcept {
  static const synchronize_fn real = [] {
    void* symbol = dlsym(RTLD_NEXT, "urcu_memb_synchronize_rcu");
    if (symbol == nullptr) {
      std::fprintf(stderr, "grace-bench: cannot find liburcu's urcu_memb_synchronize_rcu: %s\n",
                   dlerror());
      std::abort();
    }
    return reinterpret_cast<synchronize_fn>(symbol);
  }();
  return real;
}

}  // namespace

std::uint64_t urcu_grace_periods() noexcept {
  // Relaxed: a counter read after the threads that bump it were joined or drained.
  return g_grace_periods.load(std::memory_order_relaxed);
}

scoped_gp_count_exclusion::scoped_gp_count_exclusion() noexcept { tls_excluded = true; }
scoped_gp_count_exclusion::~scoped_gp_count_exclusion() { tls_excluded = false; }

}  // namespace grace::bench

// The interposer (see gp_counter.h). Exported from the executable by the link option
// --export-dynamic-symbol in bench/CMakeLists.txt, so liburcu's PLT binds to it.
extern "C" void urcu_memb_synchronize_rcu(void) {
  // Relaxed: a statistic.
  if (!grace::bench::tls_excluded)
    grace::bench::g_grace_periods.fetch_add(1, std::memory_order_relaxed);
  grace::bench::real_synchronize()();
}
