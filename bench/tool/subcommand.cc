#include "tool/subcommand.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace grace::bench {
namespace {

std::vector<subcommand>& registry() {
  static std::vector<subcommand> commands;
  return commands;
}

}  // namespace

bool register_subcommand(const subcommand& command) {
  for (const subcommand& existing : registry()) {
    if (std::string_view(existing.name) == command.name) {
      std::fprintf(stderr, "grace-bench: subcommand %s registered twice\n", command.name);
      std::abort();
    }
  }
  registry().push_back(command);
  return true;
}

std::vector<subcommand> subcommands() {
  std::vector<subcommand> sorted = registry();
  std::sort(sorted.begin(), sorted.end(), [](const subcommand& a, const subcommand& b) {
    return std::string_view(a.name) < std::string_view(b.name);
  });
  return sorted;
}

}  // namespace grace::bench
