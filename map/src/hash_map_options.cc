// Validation of grace::hash_map_options (shared by every instantiation).
#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>

#include "grace/map/hash_map.h"

namespace grace::detail {

hash_map_config validate_hash_map_options(const hash_map_options& options) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("grace::hash_map_options: " + what);
  };
  constexpr std::size_t kMaxBuckets = std::size_t{1} << (kMaxLevels - 1);
  if (options.min_buckets == 0) fail("min_buckets must be at least 1");
  if (options.max_buckets > kMaxBuckets) {
    fail("max_buckets must be at most 2^" + std::to_string(kMaxLevels - 1));
  }
  if (options.max_buckets < options.min_buckets) {
    fail("max_buckets (" + std::to_string(options.max_buckets) + ") must be >= min_buckets (" +
         std::to_string(options.min_buckets) + ")");
  }
  if (options.initial_buckets == 0) fail("initial_buckets must be at least 1");
  if (!(options.grow_load_factor > 0.0) || !std::isfinite(options.grow_load_factor) ||
      options.grow_load_factor > 1024.0) {
    fail("grow_load_factor must be in (0, 1024], got " + std::to_string(options.grow_load_factor));
  }
  if (!(options.shrink_load_factor >= 0.0) ||
      options.shrink_load_factor >= options.grow_load_factor / 2) {
    fail("shrink_load_factor must be in [0, grow_load_factor / 2) = [0, " +
         std::to_string(options.grow_load_factor / 2) + "), got " +
         std::to_string(options.shrink_load_factor));
  }
  // The map's safety rests on the pool's reuse only after a grace period: without it a
  // reader could find a recycled node holding another key, and a CAS could succeed on one
  // (ABA).
  if (!options.pool.reuse_after_gp) {
    fail("pool.reuse_after_gp must be true: a map's readers rely on elements never being "
         "reused before a grace period");
  }
  if (options.pool.destroy != nullptr) {
    fail("pool.destroy must be null: the map destroys its elements (see destruction)");
  }
  if (options.destruction != element_destruction::on_reclaim_worker &&
      options.destruction != element_destruction::by_updaters) {
    fail("destruction must be an element_destruction, got " +
         std::to_string(static_cast<int>(options.destruction)));
  }
  return hash_map_config{options.initial_buckets,    options.min_buckets,
                         options.max_buckets,        options.grow_load_factor,
                         options.shrink_load_factor, options.pool.restartable_sequences};
}

}  // namespace grace::detail
