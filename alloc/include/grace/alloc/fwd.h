// Forward declarations of grace's allocation types.
#pragma once

namespace grace {

class object_pool;
template <class T>
class typed_pool;
struct pool_options;
struct pool_stats;

}  // namespace grace
