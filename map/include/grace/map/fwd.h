// Forward declarations of grace's map types.
#pragma once

#include <absl/hash/hash.h>

#include <functional>

namespace grace {

enum class element_destruction : int;
struct hash_map_options;
struct hash_map_stats;
template <class Key, class Value, class Hash = absl::Hash<Key>,
          class KeyEqual = std::equal_to<Key>>
class hash_map;

}  // namespace grace
