// Results of grace-bench: one result is one line of space-separated key=value pairs on
// stdout, in the order the keys were added:
//
//   bench=retire mode=batch threads=2 objects=1000000 seconds=0.052 ...
//
// With --json each result is instead one JSON object per line (JSON Lines; "na" becomes
// null). When stdout is a terminal (or with --table) an aligned table of the results follows
// the lines, one table per group of results with the same keys.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace grace::bench {

class result {
 public:
  enum class kind { text, number, na };
  struct field {
    std::string key;
    std::string value;  // as printed on the key=value line
    kind type;
  };

  result& add(std::string key, std::string value);
  result& add(std::string key, const char* value) {
    return add(std::move(key), std::string(value));
  }
  result& add(std::string key, std::uint64_t value);
  result& add(std::string key, double value, int decimals);
  // A value that could not be measured: printed as `na` (null in JSON).
  result& add_na(std::string key);

  const std::vector<field>& fields() const { return fields_; }
  // The line form, without a trailing newline.
  std::string line() const;
  std::string json() const;

  // Parses a key=value line (the inverse of line()); values that parse as numbers become
  // numbers. Returns false for a line that is not key=value pairs.
  static bool parse_line(const std::string& text, result& out);

 private:
  std::vector<field> fields_;
};

class reporter {
 public:
  // json: JSON Lines instead of key=value lines. table: print the table in finish().
  reporter(std::ostream& out, bool json, bool table);

  // Prints the result at once (and flushes), so scripts see progress.
  void emit(const result& r);
  // Prints the table if enabled.
  void finish();

 private:
  std::ostream& out_;
  bool json_;
  bool table_;
  std::vector<result> results_;
};

// Aligned tables of `results`, one per run of results that share their key list.
void print_tables(std::ostream& out, const std::vector<result>& results);

}  // namespace grace::bench
