// Command-line options of one grace-bench subcommand: declared with defaults and help text,
// parsed from `--name value` or `--name=value`, printed by --help.
//
//   options_spec spec("retire", "batched retire vs call_rcu");
//   spec.add_count("threads", 2, "retiring threads", 1, 64);
//   parsed_options opts = spec.parse(argc, argv);   // throws usage_error
//   std::uint64_t threads = opts.count("threads");
//
// Counts accept the decimal suffixes k, M and G (10M = 10,000,000).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

namespace grace::bench {

// A bad command line. The message names the argument; main() prints it and exits with 2.
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class parsed_options {
 public:
  std::uint64_t count(const std::string& name) const;
  double number(const std::string& name) const;
  const std::string& choice(const std::string& name) const;
  // The items of a list option (add_choice_list), in the order given.
  std::vector<std::string> choice_list(const std::string& name) const;
  bool flag(const std::string& name) const;
  // True if the option was given on the command line (not just defaulted).
  bool given(const std::string& name) const;

 private:
  friend class options_spec;
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
};

class options_spec {
 public:
  options_spec(std::string command, std::string summary);

  void add_count(std::string name, std::uint64_t default_value, std::string help,
                 std::uint64_t min = 0,
                 std::uint64_t max = std::numeric_limits<std::uint64_t>::max());
  void add_number(std::string name, double default_value, std::string help, double min, double max);
  void add_choice(std::string name, std::string default_value, std::vector<std::string> choices,
                  std::string help);
  // A comma-separated list of choices, such as --mode batch,call_rcu.
  void add_choice_list(std::string name, std::string default_value,
                       std::vector<std::string> choices, std::string help);
  void add_flag(std::string name, std::string help);
  // What --help shows as the default of `name`, instead of its value ("off", "from --loops").
  void set_default_text(const std::string& name, std::string text);
  // Free text printed after the option list by --help.
  void set_epilogue(std::string text) { epilogue_ = std::move(text); }

  // argv[0] is the first option (the subcommand name already removed). Throws usage_error.
  // Sets help_requested() instead of parsing if --help or -h is present.
  parsed_options parse(const std::vector<std::string>& args);
  bool help_requested() const { return help_requested_; }
  void print_help(std::ostream& out) const;
  const std::string& command() const { return command_; }

 private:
  enum class kind { count, number, choice, flag };
  struct option {
    std::string name;
    kind type = kind::flag;
    std::string default_value;
    std::string help;
    std::uint64_t min_count = 0;
    std::uint64_t max_count = 0;
    double min_number = 0;
    double max_number = 0;
    std::vector<std::string> choices;
    bool list = false;         // choice: a comma-separated list of choices
    std::string default_text;  // for --help; empty: default_value
  };

  const option* find(const std::string& name) const;
  std::string validate(const option& opt, const std::string& text) const;

  std::string command_;
  std::string summary_;
  std::string epilogue_;
  std::vector<option> options_;
  bool help_requested_ = false;
};

// Parses a count with an optional k/M/G suffix; throws usage_error naming `what`.
std::uint64_t parse_count(const std::string& what, const std::string& text);

}  // namespace grace::bench
