// Shared by the grace::hash_map fuzz targets (test-only): reading the input and its header,
// the maps under test (a hash with selectable collision patterns, options that make the
// table resize all the time), keys and values that carry their own identity, a read section
// held across operations, the calls and checks both targets make the same way (inserts with
// a moved key, the whole-map erase_if, a for_each that stops, the table's bounds), and
// failing loudly.
//
// Both targets start with the same two header bytes:
//   byte 0: bits 0-2 the hash (hash_mode), bit 3 std::string keys and values instead of
//           std::uint64_t, bits 4-7 target-specific;
//   byte 1: the map's options (decode_options()).
// A value carries a 64-bit code (value_code()): the key's index, the writing thread and a
// serial number, so a value seen under the wrong key (a reused element) or one nobody
// wrote is recognised.
#pragma once

#include <absl/hash/hash.h>

#include <bit>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "grace/map/hash_map.h"

namespace grace::fuzzing {

// Prints what went wrong and aborts: libFuzzer saves the input as a crash.
[[noreturn]] [[gnu::format(printf, 1, 2)]] inline void fail(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  std::fputs("\n*** grace fuzz check failed: ", stderr);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::fflush(stderr);
  std::abort();
}

#define GRACE_FUZZ_CHECK(cond, format, ...)                                              \
  do {                                                                                   \
    if (!(cond)) [[unlikely]] {                                                          \
      ::grace::fuzzing::fail("line %d: `%s`: " format, __LINE__, #cond __VA_OPT__(, ) \
                                 __VA_ARGS__);                                           \
    }                                                                                    \
  } while (0)

// Reads the input front to back; past its end every byte reads as 0.
class byte_reader {
 public:
  byte_reader(const std::uint8_t* data, std::size_t size) noexcept : data_(data), size_(size) {}
  bool done() const noexcept { return pos_ >= size_; }
  std::size_t left() const noexcept { return done() ? 0 : size_ - pos_; }
  std::uint8_t next() noexcept { return pos_ < size_ ? data_[pos_++] : 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// How a key's index becomes its hash. The patterns stress the split-ordered list: long
// runs of equal hashes (ties in so_key order), so_keys that share all but their top bits,
// small consecutive hashes (std::hash's identity, spread only by the so_key's multiply),
// distinct so_keys that all fall in bucket 0 at every size, and so_keys right next to the
// dummies. The last two undo the map's multiply (detail::kSoKeyMultiplier) to choose the
// so_key itself.
enum class hash_mode : std::uint8_t {
  mixed,      // absl::Hash
  identity,   // the index
  mod5,       // five hashes for all keys: long chains of equal so_keys
  high_bits,  // index << 57: so_keys differ only in their top 7 bits; pairs of equal hashes
  constant,   // one hash for every key
  halves,     // index / 2: pairs of equal hashes
  one_bucket,    // so_key 2 x index + 1: distinct, all in bucket 0 up to 2^56 buckets
  bucket_edges,  // so_keys just after (even index) and just before (odd) a dummy of 4096
};
inline const char* name_of(hash_mode mode) noexcept {
  constexpr const char* kNames[] = {"mixed",    "identity", "mod5",       "high_bits",
                                    "constant", "halves",   "one_bucket", "bucket_edges"};
  return kNames[static_cast<unsigned>(mode)];
}
inline hash_mode decode_hash_mode(std::uint8_t bits) noexcept {
  return static_cast<hash_mode>(bits & 7);
}

// The hash whose so_key (split_list.h, element_so_key()) is `so_key`, for a Hash that does
// not avalanche: so_key times the multiplier's inverse modulo 2^64 (Newton's iteration, each
// step doubling the bits that are right; an odd number is its own inverse to 3 bits).
inline std::uint64_t hash_of_so_key(std::uint64_t so_key) noexcept {
  constexpr std::uint64_t kInverse = [] {
    const std::uint64_t a = grace::detail::kSoKeyMultiplier;
    std::uint64_t x = a;
    for (int i = 0; i < 5; ++i) x *= 2 - a * x;
    return x;
  }();
  static_assert(kInverse * grace::detail::kSoKeyMultiplier == 1);
  return so_key * kInverse;
}

// Keys are made from an index below 256: std::uint64_t keys are the index itself,
// std::string keys are 32 bytes (past the small-string buffer) ending in the index.
template <class Key>
struct key_codec;
template <>
struct key_codec<std::uint64_t> {
  static std::uint64_t make(std::size_t index) noexcept { return index; }
  // The index, or nullopt if `key` is not one that make() builds.
  static std::optional<std::size_t> index_of(std::uint64_t key) noexcept {
    if (key >= 256) return std::nullopt;
    return static_cast<std::size_t>(key);
  }
};
template <>
struct key_codec<std::string> {
  static std::string make(std::size_t index) {
    std::string key(31, 'k');
    key.push_back(static_cast<char>(index));
    return key;
  }
  static std::optional<std::size_t> index_of(const std::string& key) noexcept {
    if (key.size() != 32 || std::string_view(key).substr(0, 31).find_first_not_of('k') !=
                                std::string_view::npos) {
      return std::nullopt;
    }
    return static_cast<unsigned char>(key.back());
  }
};

// The Hash of every map under test; stateful, so one instantiation covers every mode.
struct index_hash {
  hash_mode mode = hash_mode::mixed;

  template <class Key>
  std::size_t operator()(const Key& key) const noexcept {
    if (mode == hash_mode::mixed) return absl::Hash<Key>{}(key);
    const std::optional<std::size_t> index = key_codec<Key>::index_of(key);
    GRACE_FUZZ_CHECK(index.has_value(), "the map hashed a key the fuzzer never made");
    const std::uint64_t i = *index;
    switch (mode) {
      case hash_mode::identity:
        return i;
      case hash_mode::mod5:
        return i % 5;
      case hash_mode::high_bits:
        return static_cast<std::size_t>(i << 57);
      case hash_mode::constant:
        return 0x5eed;
      case hash_mode::halves:
        return i / 2;
      case hash_mode::one_bucket:
        return static_cast<std::size_t>(hash_of_so_key(2 * i + 1));
      case hash_mode::bucket_edges: {
        const std::uint64_t dummy = (i / 2) << 52;  // of prefix i / 2 at 4096 buckets
        return static_cast<std::size_t>(
            hash_of_so_key(i % 2 == 0 ? dummy | 1 : dummy + (std::uint64_t{1} << 52) - 1));
      }
      case hash_mode::mixed:
        break;
    }
    return 0;
  }
};

// A value's code: the key's index (8 bits), the writing thread (8 bits), a serial (48 bits).
inline std::uint64_t value_code(std::size_t index, unsigned thread, std::uint64_t serial) noexcept {
  return (std::uint64_t{index} << 56) | (std::uint64_t{thread} << 48) |
         (serial & ((std::uint64_t{1} << 48) - 1));
}
inline std::size_t index_of_code(std::uint64_t code) noexcept { return code >> 56; }
inline unsigned thread_of_code(std::uint64_t code) noexcept { return (code >> 48) & 0xff; }
inline std::uint64_t serial_of_code(std::uint64_t code) noexcept {
  return code & ((std::uint64_t{1} << 48) - 1);
}

// Values carry a code: std::uint64_t values are the code, std::string values are 40 bytes
// (heap-allocated) holding the code and a fixed filler that read() checks.
template <class Value>
struct value_codec;
template <>
struct value_codec<std::uint64_t> {
  static std::uint64_t make(std::uint64_t code) noexcept { return code; }
  static std::optional<std::uint64_t> read(std::uint64_t value) noexcept { return value; }
};
template <>
struct value_codec<std::string> {
  static constexpr std::size_t kSize = 40;
  static std::string make(std::uint64_t code) {
    std::string value(kSize, 'v');
    std::memcpy(value.data(), &code, sizeof code);
    return value;
  }
  // The code, or nullopt if `value` is not one that make() builds (torn or overwritten).
  static std::optional<std::uint64_t> read(const std::string& value) noexcept {
    if (value.size() != kSize || value.find_first_not_of('v', sizeof(std::uint64_t)) !=
                                     std::string::npos) {
      return std::nullopt;
    }
    std::uint64_t code;
    std::memcpy(&code, value.data(), sizeof code);
    return code;
  }
};

// Options from one byte, chosen so that the table resizes all the time:
//   bits 0-1: grow_load_factor 1, 0.5, 2 or 4; shrink_load_factor is always an eighth of it
//   bits 2-3: max_buckets 256, 4, 32 or 4096
//   bit 4:    initial_buckets 1 or 16 (clamped to [min, max])
//   bit 5:    a tight element pool: tiny per-CPU caches, and the updating thread runs a
//             grace period itself after a few frees, so elements are reused within an input
//   bit 6:    min_buckets 4 instead of 1
//   bit 7:    element_destruction::by_updaters (for std::string keys and values: the pool
//             destroys erased elements after their grace period)
inline hash_map_options decode_options(std::uint8_t bits) {
  constexpr double kGrow[] = {1.0, 0.5, 2.0, 4.0};
  constexpr std::size_t kMaxBuckets[] = {256, 4, 32, 4096};
  hash_map_options options;
  options.grow_load_factor = kGrow[bits & 3];
  options.shrink_load_factor = options.grow_load_factor / 8;
  options.max_buckets = kMaxBuckets[(bits >> 2) & 3];
  options.min_buckets = (bits & 0x40) != 0 ? 4 : 1;
  options.initial_buckets = (bits & 0x10) != 0 ? 16 : 1;
  if ((bits & 0x80) != 0) options.destruction = element_destruction::by_updaters;
  if ((bits & 0x20) != 0) {
    options.pool.low_watermark = 1;
    options.pool.high_watermark = 4;
    options.pool.batch = 2;
    options.pool.magazine_capacity = 2;
    options.pool.gp_request_threshold = 2;
    options.pool.caller_gp_threshold = 8;
  }
  return options;
}

// The two header bytes every input starts with.
struct input_header {
  hash_mode hash;
  hash_map_options options;
  bool strings;              // byte 0 bit 3: std::string keys and values
  std::uint8_t target_bits;  // byte 0 bits 4-7, the target's own (as bits 0-3 here)
};
inline input_header read_header(byte_reader& in) {
  const std::uint8_t variant = in.next();
  input_header header;
  header.options = decode_options(in.next());
  header.hash = decode_hash_mode(variant);
  header.strings = (variant & 8) != 0;
  header.target_bits = variant >> 4;
  return header;
}

// insert(), try_emplace() and insert_or_assign(), with the key as an lvalue or an rvalue.
enum class insert_member : std::uint8_t { insert, try_emplace, insert_or_assign };
inline const char* name_of(insert_member member) noexcept {
  constexpr const char* kNames[] = {"insert", "try_emplace", "insert_or_assign"};
  return kNames[static_cast<unsigned>(member)];
}
struct insert_result {
  bool inserted;
  bool key_lost;  // an rvalue key that was not inserted did not come back unchanged
};
// Calls `member` with `key`, or, if `moved`, with a copy of it moved in. hash_map.h gives an
// rvalue key that insert() or try_emplace() did not insert back unchanged (the key was
// present, or a racing insert won); insert_or_assign() moves it into the element whether it
// inserts or replaces, so only its result says anything.
template <class Map>
insert_result insert_into(Map& map, insert_member member, bool moved,
                          const typename Map::key_type& key, typename Map::mapped_type value) {
  if (!moved) {
    switch (member) {
      case insert_member::insert:
        return {map.insert(key, std::move(value)), false};
      case insert_member::try_emplace:
        return {map.try_emplace(key, std::move(value)), false};
      case insert_member::insert_or_assign:
        return {map.insert_or_assign(key, std::move(value)), false};
    }
  }
  typename Map::key_type rvalue = key;
  bool inserted = false;
  switch (member) {
    case insert_member::insert:
      inserted = map.insert(std::move(rvalue), std::move(value));
      break;
    case insert_member::try_emplace:
      inserted = map.try_emplace(std::move(rvalue), std::move(value));
      break;
    case insert_member::insert_or_assign:
      return {map.insert_or_assign(std::move(rvalue), std::move(value)), false};
  }
  // Read after the move on purpose: a key not inserted is the caller's again.
  return {inserted, !inserted && rvalue != key};
}

struct insert_or_update_result {
  bool inserted;
  int calls;  // of f: 1 per attempt on a present key (more after lost races)
};
// insert_or_update(key, the value of inserted_code, f), f passing the old value to
// observe(old) and returning the value of updated_code.
template <class Map, class Observe>
insert_or_update_result insert_or_update_counted(Map& map, const typename Map::key_type& key,
                                                 std::uint64_t inserted_code,
                                                 std::uint64_t updated_code, Observe observe) {
  using values = value_codec<typename Map::mapped_type>;
  int calls = 0;
  const bool inserted = map.insert_or_update(
      key, values::make(inserted_code), [&](const typename Map::mapped_type& old) {
        ++calls;
        observe(old);
        return values::make(updated_code);
      });
  return {inserted, calls};
}

// contains(key), or, if `count`, count(key) (std::unordered_map's spelling: 0 or 1, which the
// caller checks).
template <class Map>
std::size_t lookup_count(const Map& map, const typename Map::key_type& key, bool count) {
  if (count) return map.count(key);
  return map.contains(key) ? 1 : 0;
}

// The erase_if operation's argument from kWholeMapArg up (the top of its range, so that it
// stays rare: it walks every element) runs erase_if(pred) over the whole map instead of on
// the operation's key. pred picks the keys whose index equals the operation's key's (the
// anchor) modulo arg - kWholeMapArg + 2: in both targets' ranges 2, 3 or 4, so about half, a
// third or a quarter of them.
inline constexpr unsigned kWholeMapArg = 10;
inline bool whole_map_erases(std::size_t index, std::size_t anchor, unsigned arg) noexcept {
  const std::size_t modulus = arg - kWholeMapArg + 2;
  return index % modulus == anchor % modulus;
}

// for_each() with an f that passes each element to `see` and returns false at its
// `stop_at`-th call (stop_at >= 1). Returns how many times for_each called f: more than
// stop_at if it went on after the false.
template <class Map, class See>
std::size_t for_each_until(const Map& map, std::size_t stop_at, See see) {
  std::size_t calls = 0;
  map.for_each([&](const typename Map::key_type& key, const typename Map::mapped_type& value) {
    see(key, value);
    return ++calls < stop_at;
  });
  return calls;
}

// bucket_count() is a power of two between min_buckets and max_buckets, which the map rounds
// up to powers of two; at any time, even while other threads resize the table.
inline bool buckets_in_bounds(std::size_t buckets, const hash_map_options& options) noexcept {
  return std::has_single_bit(buckets) && buckets >= std::bit_ceil(options.min_buckets) &&
         buckets <= std::bit_ceil(options.max_buckets);
}
// With no update in flight, load_factor() is the size over bucket_count().
template <class Map>
bool load_factor_is(const Map& map, std::size_t size) {
  return map.load_factor() ==
         static_cast<float>(size) / static_cast<float>(map.bucket_count());
}

// A read section held across later operations (the targets' pin operation), and the element
// it read. Whatever happens to the element meanwhile (erased, replaced, the table resized,
// the map cleared), the pinned pointer still reads the value it read (reclamation waits):
// unchanged() checks that.
template <class Map>
struct held_pin {
  using value_type = typename Map::mapped_type;

  // Pins `map` during operation `op` and finds `key`; `code_of(element)` checks a present
  // element and returns its value code. The pin lasts this operation and `arg` + 1 more.
  template <class Key, class CodeOf>
  held_pin(const Map& map, const Key& key, std::size_t op, unsigned arg, CodeOf code_of)
      // pinned_view can be neither copied nor moved: build it in place from the prvalue.
      : view(new typename Map::pinned_view(map.pin())),
        element(view->find(key)),
        code(element != nullptr ? code_of(*element) : 0),
        pinned_at(op),
        ops_left(arg + 2) {}

  // True if the element (if the key was present) still reads `code`.
  bool unchanged() const {
    if (element == nullptr) return true;
    const std::optional<std::uint64_t> now = value_codec<value_type>::read(*element);
    return now.has_value() && *now == code;
  }

  std::unique_ptr<typename Map::pinned_view> view;
  const value_type* element;  // nullptr: the key was absent
  std::uint64_t code;         // the element's value code; 0 if absent
  std::size_t pinned_at;      // the operation that pinned
  std::size_t ops_left;       // operations until the pin is released, this one included
};

}  // namespace grace::fuzzing
