// `grace-bench table`: reads key=value result lines (from any grace-bench subcommand, or a
// script) on stdin and prints them as aligned tables. Other lines are ignored. scripts/bench
// uses it to print one summary of a whole run.
#include <iostream>
#include <string>
#include <vector>

#include "tool/subcommand.h"

namespace grace::bench {
namespace {

void describe(options_spec& spec) {
  spec.set_epilogue("Reads result lines on stdin; groups consecutive results with the same keys.");
}

int run(const parsed_options&, reporter&) {
  std::vector<result> results;
  std::string line;
  while (std::getline(std::cin, line)) {
    result parsed;
    if (result::parse_line(line, parsed)) results.push_back(std::move(parsed));
  }
  print_tables(std::cout, results);
  return 0;
}

[[maybe_unused]] const bool kRegistered = register_subcommand(
    {"table", "print key=value result lines from stdin as aligned tables", describe, run});

}  // namespace
}  // namespace grace::bench
