#include "tool/latency.h"

#include <algorithm>
#include <cmath>

namespace grace::bench {

std::uint64_t percentile(const std::vector<std::uint64_t>& sorted, double fraction) {
  if (sorted.empty()) return 0;
  const auto rank =
      static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(sorted.size())));
  return sorted[std::clamp<std::size_t>(rank, 1, sorted.size()) - 1];
}

latency_summary summarize(std::vector<std::uint64_t>& samples_ns) {
  std::sort(samples_ns.begin(), samples_ns.end());
  latency_summary summary;
  summary.samples = samples_ns.size();
  if (samples_ns.empty()) return summary;
  constexpr double kNsPerUs = 1000.0;
  summary.p50_us = static_cast<double>(percentile(samples_ns, 0.50)) / kNsPerUs;
  summary.p99_us = static_cast<double>(percentile(samples_ns, 0.99)) / kNsPerUs;
  summary.max_us = static_cast<double>(samples_ns.back()) / kNsPerUs;
  return summary;
}

void add_latency(result& r, const std::string& prefix, const latency_summary& summary) {
  r.add(prefix + "samples", summary.samples);
  if (summary.samples == 0) {
    r.add_na(prefix + "p50_us").add_na(prefix + "p99_us").add_na(prefix + "max_us");
    return;
  }
  r.add(prefix + "p50_us", summary.p50_us, 2);
  r.add(prefix + "p99_us", summary.p99_us, 2);
  r.add(prefix + "max_us", summary.max_us, 2);
}

}  // namespace grace::bench
