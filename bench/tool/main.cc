// grace-bench: grace's benchmark driver. `grace-bench <subcommand> [options]`; see
// `grace-bench --help` and tool/subcommand.h for adding a subcommand.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "tool/options.h"
#include "tool/report.h"
#include "tool/subcommand.h"

namespace {

constexpr int kUsageExit = 2;

void print_usage(std::ostream& out) {
  out << "usage: grace-bench <subcommand> [options]\n\n"
         "Every result is one line of key=value pairs on stdout (--json: one JSON object per\n"
         "line); on a terminal, or with --table, an aligned table follows.\n\n"
         "subcommands:\n";
  std::size_t width = 0;
  for (const auto& command : grace::bench::subcommands()) {
    width = std::max(width, std::string_view(command.name).size());
  }
  for (const auto& command : grace::bench::subcommands()) {
    out << "  " << command.name
        << std::string(width - std::string_view(command.name).size() + 2, ' ') << command.summary
        << "\n";
  }
  out << "\n`grace-bench <subcommand> --help` lists a subcommand's options.\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(std::cerr);
    return kUsageExit;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    print_usage(std::cout);
    return 0;
  }
  const grace::bench::subcommand* command = nullptr;
  const auto commands = grace::bench::subcommands();
  for (const auto& candidate : commands) {
    if (name == candidate.name) command = &candidate;
  }
  if (command == nullptr) {
    std::cerr << "grace-bench: unknown subcommand '" << name << "'\n\n";
    print_usage(std::cerr);
    return kUsageExit;
  }

  grace::bench::options_spec spec(command->name, command->summary);
  command->describe(spec);
  spec.add_flag("json", "print results as JSON, one object per line");
  spec.add_flag("table", "print the aligned table even when stdout is not a terminal");
  try {
    const grace::bench::parsed_options options =
        spec.parse(std::vector<std::string>(argv + 2, argv + argc));
    if (spec.help_requested()) {
      spec.print_help(std::cout);
      return 0;
    }
    const bool table = options.flag("table") || isatty(STDOUT_FILENO) == 1;
    grace::bench::reporter out(std::cout, options.flag("json"), table);
    const int code = command->run(options, out);
    out.finish();
    return code;
  } catch (const grace::bench::usage_error& error) {
    std::cerr << "grace-bench " << command->name << ": " << error.what() << "\n"
              << "(see grace-bench " << command->name << " --help)\n";
    return kUsageExit;
  } catch (const std::exception& error) {
    std::cerr << "grace-bench " << command->name << ": error: " << error.what() << "\n";
    return 1;
  }
}
