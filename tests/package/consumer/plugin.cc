// A shared library that uses grace (a plugin, a language binding): grace's static libraries
// must be position-independent for it to link. main.cc calls it when built with it.
#include <grace/map/hash_map.h>

int grace_consumer_plugin_sum() {
  grace::hash_map<int, int> squares;
  for (int i = 0; i < 100; ++i) squares.insert(i, i * i);
  int sum = 0;
  squares.for_each([&sum](int, int square) { sum += square; });
  return sum;
}
