#include "tool/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <sstream>

namespace grace::bench {
namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

bool looks_numeric(const std::string& text) {
  if (text.empty()) return false;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  return *end == '\0' && std::isfinite(value);
}

}  // namespace

result& result::add(std::string key, std::string value) {
  fields_.push_back(field{std::move(key), std::move(value), kind::text});
  return *this;
}

result& result::add(std::string key, std::uint64_t value) {
  fields_.push_back(field{std::move(key), std::to_string(value), kind::number});
  return *this;
}

result& result::add(std::string key, double value, int decimals) {
  if (!std::isfinite(value)) return add_na(std::move(key));
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", decimals, value);
  fields_.push_back(field{std::move(key), text, kind::number});
  return *this;
}

result& result::add_na(std::string key) {
  fields_.push_back(field{std::move(key), "na", kind::na});
  return *this;
}

std::string result::line() const {
  std::string out;
  for (const field& f : fields_) {
    if (!out.empty()) out += ' ';
    out += f.key + '=' + f.value;
  }
  return out;
}

std::string result::json() const {
  std::string out = "{";
  for (const field& f : fields_) {
    if (out.size() > 1) out += ", ";
    out += json_string(f.key) + ": ";
    switch (f.type) {
      case kind::text:
        out += json_string(f.value);
        break;
      case kind::number:
        out += f.value;
        break;
      case kind::na:
        out += "null";
        break;
    }
  }
  return out + "}";
}

bool result::parse_line(const std::string& text, result& out) {
  out.fields_.clear();
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const std::size_t eq = word.find('=');
    if (eq == 0 || eq == std::string::npos) return false;
    std::string key = word.substr(0, eq);
    std::string value = word.substr(eq + 1);
    const kind type = value == "na" ? kind::na : looks_numeric(value) ? kind::number : kind::text;
    out.fields_.push_back(field{std::move(key), std::move(value), type});
  }
  return !out.fields_.empty();
}

reporter::reporter(std::ostream& out, bool json, bool table)
    : out_(out), json_(json), table_(table) {}

void reporter::emit(const result& r) {
  out_ << (json_ ? r.json() : r.line()) << std::endl;
  results_.push_back(r);
}

void reporter::finish() {
  if (table_ && !results_.empty()) {
    out_ << "\n";
    print_tables(out_, results_);
  }
  out_.flush();
}

void print_tables(std::ostream& out, const std::vector<result>& results) {
  auto same_keys = [](const result& a, const result& b) {
    return std::equal(
        a.fields().begin(), a.fields().end(), b.fields().begin(), b.fields().end(),
        [](const result::field& x, const result::field& y) { return x.key == y.key; });
  };
  std::size_t begin = 0;
  while (begin < results.size()) {
    std::size_t end = begin + 1;
    while (end < results.size() && same_keys(results[begin], results[end])) ++end;

    const std::vector<result::field>& header = results[begin].fields();
    std::vector<std::size_t> width(header.size());
    for (std::size_t c = 0; c < header.size(); ++c) {
      width[c] = header[c].key.size();
      for (std::size_t r = begin; r < end; ++r) {
        width[c] = std::max(width[c], results[r].fields()[c].value.size());
      }
    }
    auto print_row = [&](auto cell, auto right_aligned) {
      std::string row;
      for (std::size_t c = 0; c < header.size(); ++c) {
        const std::string text = cell(c);
        const std::string pad(width[c] - text.size(), ' ');
        if (c != 0) row += "  ";
        row += right_aligned(c) ? pad + text : text + pad;
      }
      while (!row.empty() && row.back() == ' ') row.pop_back();
      out << row << "\n";
    };
    print_row([&](std::size_t c) { return header[c].key; },
              [&](std::size_t c) { return results[begin].fields()[c].type != result::kind::text; });
    for (std::size_t r = begin; r < end; ++r) {
      print_row([&](std::size_t c) { return results[r].fields()[c].value; },
                [&](std::size_t c) { return results[r].fields()[c].type != result::kind::text; });
    }
    out << "\n";
    begin = end;
  }
}

}  // namespace grace::bench
