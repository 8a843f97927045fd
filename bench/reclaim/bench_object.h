// The object every reclaim benchmark allocates and retires: 40 bytes, like the rcuperf kfree
// test's small kmalloc objects. It embeds a liburcu rcu_head so the call_rcu() reference can
// use the same object (what cds_lfht users do); grace's retire() leaves it unused, so every
// mode allocates the same size.
#pragma once

#include <urcu/urcu-memb.h>

#include <cstddef>
#include <cstdint>

namespace grace::bench {

struct bench_object {
  rcu_head head;             // used by the call_rcu() modes only
  std::uint64_t payload[3];  // written on allocation, as a real node would be
};

static_assert(sizeof(bench_object) == 40);
static_assert(offsetof(bench_object, head) == 0);

inline bench_object* make_bench_object(std::uint64_t seed) {
  auto* object = new bench_object;
  object->payload[0] = seed;
  object->payload[1] = seed ^ 0x9e3779b97f4a7c15ULL;
  object->payload[2] = ~seed;
  return object;
}

// The call_rcu() callback: deletes the object around `head`.
inline void delete_bench_object(rcu_head* head) {
  delete reinterpret_cast<bench_object*>(head);  // head is the first member (asserted above)
}

}  // namespace grace::bench
