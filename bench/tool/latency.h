// Latency samples and their percentiles.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "tool/report.h"

namespace grace::bench {

using bench_clock = std::chrono::steady_clock;

inline double seconds_between(bench_clock::time_point from, bench_clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

struct latency_summary {
  std::uint64_t samples = 0;
  double p50_us = 0;
  double p99_us = 0;
  double max_us = 0;
};

// The nearest-rank percentile (0 < fraction <= 1) of sorted samples; 0 for no samples.
std::uint64_t percentile(const std::vector<std::uint64_t>& sorted, double fraction);

// Sorts `samples_ns` in place and summarizes them.
latency_summary summarize(std::vector<std::uint64_t>& samples_ns);

// Adds <prefix>samples, <prefix>p50_us, <prefix>p99_us, <prefix>max_us (na without samples).
void add_latency(result& r, const std::string& prefix, const latency_summary& summary);

}  // namespace grace::bench
