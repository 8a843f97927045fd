#include "tool/options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <sstream>

namespace grace::bench {
namespace {

// Flag values, kept as strings like every other option. Named strings rather than literals
// assigned in place: g++ 12 -O2 warns falsely (-Wrestrict, GCC bug 105329) on the latter.
const std::string kFlagOn = "1";
const std::string kFlagOff = "0";

std::string in_quotes(const std::string& text) { return "'" + text + "'"; }

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t comma = text.find(',', begin);
    items.push_back(text.substr(begin, comma == std::string::npos ? comma : comma - begin));
    if (comma == std::string::npos) return items;
    begin = comma + 1;
  }
}

std::string joined(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += separator;
    out += item;
  }
  return out;
}

// Word-wraps `text` to kHelpColumns, continuation lines indented by `indent`.
constexpr std::size_t kHelpColumns = 96;
std::string wrapped(const std::string& text, std::size_t indent) {
  std::string out;
  std::size_t column = indent;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    if (column > indent && column + 1 + word.size() > kHelpColumns) {
      out.push_back('\n');
      out.append(indent, ' ');
      column = indent;
    } else if (column > indent) {
      out.push_back(' ');
      ++column;
    }
    out.append(word);
    column += word.size();
  }
  return out;
}

}  // namespace

std::uint64_t parse_count(const std::string& what, const std::string& text) {
  std::uint64_t multiplier = 1;
  std::string digits = text;
  if (!digits.empty()) {
    switch (digits.back()) {
      case 'k':
      case 'K':
        multiplier = 1'000;
        break;
      case 'm':
      case 'M':
        multiplier = 1'000'000;
        break;
      case 'g':
      case 'G':
        multiplier = 1'000'000'000;
        break;
      default:
        break;
    }
    if (multiplier != 1) digits.pop_back();
  }
  const bool all_digits =
      !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
  if (!all_digits) {
    throw usage_error(what + ": expected a non-negative integer (suffixes k, M, G allowed), got " +
                      in_quotes(text));
  }
  errno = 0;
  const unsigned long long value = std::strtoull(digits.c_str(), nullptr, 10);
  if (errno == ERANGE || value > std::numeric_limits<std::uint64_t>::max() / multiplier) {
    throw usage_error(what + ": " + in_quotes(text) + " is too large");
  }
  return static_cast<std::uint64_t>(value) * multiplier;
}

std::uint64_t parsed_options::count(const std::string& name) const {
  return parse_count("--" + name, values_.at(name));
}

double parsed_options::number(const std::string& name) const {
  return std::strtod(values_.at(name).c_str(), nullptr);
}

const std::string& parsed_options::choice(const std::string& name) const {
  return values_.at(name);
}

std::vector<std::string> parsed_options::choice_list(const std::string& name) const {
  return split_list(values_.at(name));
}

bool parsed_options::flag(const std::string& name) const { return values_.at(name) == kFlagOn; }

bool parsed_options::given(const std::string& name) const { return given_.at(name); }

options_spec::options_spec(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void options_spec::add_count(std::string name, std::uint64_t default_value, std::string help,
                             std::uint64_t min, std::uint64_t max) {
  option opt;
  opt.name = std::move(name);
  opt.type = kind::count;
  opt.default_value = std::to_string(default_value);
  opt.help = std::move(help);
  opt.min_count = min;
  opt.max_count = max;
  options_.push_back(std::move(opt));
}

void options_spec::add_number(std::string name, double default_value, std::string help, double min,
                              double max) {
  std::ostringstream text;
  text << default_value;
  option opt;
  opt.name = std::move(name);
  opt.type = kind::number;
  opt.default_value = text.str();
  opt.help = std::move(help);
  opt.min_number = min;
  opt.max_number = max;
  options_.push_back(std::move(opt));
}

void options_spec::add_choice(std::string name, std::string default_value,
                              std::vector<std::string> choices, std::string help) {
  option opt;
  opt.name = std::move(name);
  opt.type = kind::choice;
  opt.default_value = std::move(default_value);
  opt.help = std::move(help);
  opt.choices = std::move(choices);
  options_.push_back(std::move(opt));
}

void options_spec::add_choice_list(std::string name, std::string default_value,
                                   std::vector<std::string> choices, std::string help) {
  add_choice(std::move(name), std::move(default_value), std::move(choices), std::move(help));
  options_.back().list = true;
}

void options_spec::add_flag(std::string name, std::string help) {
  option opt;
  opt.name = std::move(name);
  opt.type = kind::flag;
  opt.default_value = kFlagOff;
  opt.help = std::move(help);
  options_.push_back(std::move(opt));
}

void options_spec::set_default_text(const std::string& name, std::string text) {
  for (option& opt : options_) {
    if (opt.name == name) opt.default_text = std::move(text);
  }
}

const options_spec::option* options_spec::find(const std::string& name) const {
  for (const option& opt : options_) {
    if (opt.name == name) return &opt;
  }
  return nullptr;
}

std::string options_spec::validate(const option& opt, const std::string& text) const {
  const std::string what = "--" + opt.name;
  switch (opt.type) {
    case kind::count: {
      const std::uint64_t value = parse_count(what, text);
      if (value < opt.min_count || value > opt.max_count) {
        std::string range = "at least " + std::to_string(opt.min_count);
        if (opt.max_count != std::numeric_limits<std::uint64_t>::max()) {
          range =
              "between " + std::to_string(opt.min_count) + " and " + std::to_string(opt.max_count);
        }
        throw usage_error(what + ": must be " + range + ", got " + in_quotes(text));
      }
      return text;
    }
    case kind::number: {
      char* end = nullptr;
      errno = 0;
      const double value = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(value)) {
        throw usage_error(what + ": expected a number, got " + in_quotes(text));
      }
      if (value < opt.min_number || value > opt.max_number) {
        std::ostringstream message;
        message << what << ": must be between " << opt.min_number << " and " << opt.max_number
                << ", got " << in_quotes(text);
        throw usage_error(message.str());
      }
      return text;
    }
    case kind::choice: {
      const std::vector<std::string> items = opt.list ? split_list(text) : std::vector{text};
      for (const std::string& item : items) {
        if (std::find(opt.choices.begin(), opt.choices.end(), item) == opt.choices.end()) {
          throw usage_error(what + ": expected " + (opt.list ? "a comma-separated list of " : "") +
                            "one of " + joined(opt.choices, "|") + ", got " + in_quotes(text));
        }
      }
      return text;
    }
    case kind::flag:
      break;
  }
  return text;
}

parsed_options options_spec::parse(const std::vector<std::string>& args) {
  parsed_options parsed;
  for (const option& opt : options_) {
    parsed.values_[opt.name] = opt.default_value;
    parsed.given_[opt.name] = false;
  }
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return parsed;
    }
  }
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      throw usage_error("unexpected argument " + in_quotes(arg) + " (options start with --)");
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_value = false;
    if (const std::size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
      has_value = true;
    }
    const option* opt = find(name);
    if (opt == nullptr) throw usage_error("unknown option --" + name);
    if (opt->type == kind::flag) {
      if (has_value) throw usage_error("--" + name + " takes no value, got " + in_quotes(value));
      value = kFlagOn;
    } else if (!has_value) {
      if (i + 1 == args.size()) throw usage_error("--" + name + ": missing value");
      value = args[++i];
    }
    parsed.values_[name] = validate(*opt, value);
    parsed.given_[name] = true;
  }
  return parsed;
}

void options_spec::print_help(std::ostream& out) const {
  out << "usage: grace-bench " << command_ << " [options]\n\n" << summary_ << "\n\noptions:\n";
  std::size_t width = 0;
  auto left = [](const option& opt) {
    std::string text = "--" + opt.name;
    switch (opt.type) {
      case kind::count:
        text += " N";
        break;
      case kind::number:
        text += " X";
        break;
      case kind::choice:
        text.push_back(' ');
        text.append(joined(opt.choices, "|"));
        if (opt.list) text.append("[,...]");
        break;
      case kind::flag:
        break;
    }
    return text;
  };
  // Option names longer than this take a line of their own, with the help indented below,
  // so one long choice list does not squeeze every help text into a narrow column.
  constexpr std::size_t kNameColumn = 24;
  for (const option& opt : options_) {
    const std::size_t name_width = left(opt).size();
    if (name_width <= kNameColumn) width = std::max(width, name_width);
  }
  const auto print = [&](const std::string& name, const std::string& text) {
    if (name.size() > width) {
      out << "  " << name << "\n" << std::string(width + 4, ' ');
    } else {
      out << "  " << std::left << std::setw(static_cast<int>(width)) << name << "  ";
    }
    out << wrapped(text, width + 4) << "\n";
  };
  for (const option& opt : options_) {
    std::string text = opt.help;
    if (opt.type != kind::flag) {
      text +=
          " (default " + (opt.default_text.empty() ? opt.default_value : opt.default_text) + ")";
    }
    print(left(opt), text);
  }
  print("--help", "print this help");
  if (!epilogue_.empty()) out << "\n" << epilogue_ << "\n";
}

}  // namespace grace::bench
