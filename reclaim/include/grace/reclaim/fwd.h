// Forward declarations of grace's reclamation types.
#pragma once

namespace grace {

class domain;
class read_guard;
struct domain_options;
struct domain_stats;
struct system_allocator;

}  // namespace grace
