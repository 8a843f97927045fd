// grace-bench subcommands register themselves from their own .cc file:
//
//   namespace {
//   void describe(grace::bench::options_spec& spec) { spec.add_count("threads", 2, "..."); }
//   int run(const grace::bench::parsed_options& options, grace::bench::reporter& out) {...}
//   [[maybe_unused]] const bool kRegistered = grace::bench::register_subcommand(
//       {"retire", "retire throughput, grace periods and memory vs call_rcu", describe, run});
//   }  // namespace
//
// and are added to grace-bench's source list in bench/CMakeLists.txt (GRACE_BENCH_MODES).
// Every subcommand also gets --json, --table and --help.
#pragma once

#include <vector>

#include "tool/options.h"
#include "tool/report.h"

namespace grace::bench {

struct subcommand {
  const char* name;
  const char* summary;  // one line, for `grace-bench --help`
  void (*describe)(options_spec& spec);
  // Returns the process exit code. May throw usage_error for option combinations.
  int (*run)(const parsed_options& options, reporter& out);
};

bool register_subcommand(const subcommand& command);
// Sorted by name.
std::vector<subcommand> subcommands();

}  // namespace grace::bench
