// A service's use of grace, however its build found it (tests/package): a map of strings
// updated from two threads, read back, erased, and its memory released with the map; in the
// CMake builds, also a map inside a shared library. Exits non-zero with a message naming
// what differed.
#include <grace/map/hash_map.h>
#include <grace/reclaim/domain.h>

#include <cstdio>
#include <string>
#include <thread>

#if GRACE_CONSUMER_PLUGIN
int grace_consumer_plugin_sum();  // plugin.cc, a shared library
#endif

namespace {

constexpr int kKeysPerThread = 5000;

std::string value_of(int key) { return "value of " + std::to_string(key); }

int fail(const char* what, int key) {
  std::fprintf(stderr, "grace consumer: %s (key %d)\n", what, key);
  return 1;
}

}  // namespace

int main() {
  grace::hash_map<std::string, std::string> sessions;
  std::thread writers[2];
  for (int t = 0; t < 2; ++t) {
    writers[t] = std::thread([&sessions, t] {
      for (int i = t; i < 2 * kKeysPerThread; i += 2) {
        sessions.insert(std::to_string(i), value_of(i));
      }
    });
  }
  for (std::thread& writer : writers) writer.join();

  if (sessions.size() != 2 * kKeysPerThread) return fail("size() after the inserts", -1);
  for (int i = 0; i < 2 * kKeysPerThread; ++i) {
    const auto found = sessions.find(std::to_string(i));
    if (!found || *found != value_of(i)) return fail("find() missed or read a wrong value", i);
  }
  for (int i = 0; i < 2 * kKeysPerThread; i += 2) {
    if (!sessions.erase(std::to_string(i))) return fail("erase() missed a present key", i);
  }
  for (int i = 0; i < 2 * kKeysPerThread; ++i) {
    if (sessions.contains(std::to_string(i)) != (i % 2 == 1)) {
      return fail("contains() disagrees with the erases", i);
    }
  }
#if GRACE_CONSUMER_PLUGIN
  // The sum of the squares of 0..99, from the shared library's own map.
  if (grace_consumer_plugin_sum() != 328350) return fail("the shared library's map", -1);
#endif
  grace::domain::global().barrier();
  std::puts("grace consumer: ok");
  return 0;
}
