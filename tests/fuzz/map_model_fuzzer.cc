// libFuzzer target: one thread's operations on a grace::hash_map, each checked against a
// std::unordered_map. Every return value, every value seen, size() after every operation,
// the load factor after every insert or erase (small tables), and the whole content with
// for_each() every 32 operations and at the end.
//
// Input: the two header bytes of map_fuzzing.h (byte 0 bits 4-7 unused), then one operation
// per two bytes, [op][key]:
//   op  % kOpCount: the operation; op / kOpCount: its argument (0-13)
//   key % kKeys:    the key's index (a small key space: most operations hit a present key)
// A pin holds a read section across the next arg + 1 operations and checks at the end that
// the element it read is unchanged, however the map changed meanwhile. reserve, clear and
// the range operations force the table through large resizes in a few bytes. The other
// operations that read their argument:
//   insert, try_emplace, insert_or_assign: bit 0 passes the key as an rvalue (a key not
//            inserted must come back unchanged, map_fuzzing.h's insert_into());
//   contains: bit 0 asks count() instead;
//   erase_if: bit 0 is what pred answers; from gf::kWholeMapArg up, erase_if(pred) over the
//            whole map instead (map_fuzzing.h's whole_map_erases());
//   for_each: 0 checks the whole content; n stops the walk with false at its n-th element.
//
// Replay a crash: build/fuzz/tests/fuzz/map_model_fuzzer crash-<sha1>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "grace/map/hash_map.h"
#include "grace/reclaim/read_guard.h"
#include "tests/fuzz/map_fuzzing.h"

namespace {

namespace gf = grace::fuzzing;

constexpr std::size_t kKeys = 128;
constexpr std::size_t kContentCheckEvery = 32;

enum class op : std::uint8_t {
  find,
  contains,
  visit,
  pin,
  insert,
  try_emplace,
  insert_or_assign,
  assign,
  update,
  insert_or_update,
  erase,
  extract,
  erase_if,
  for_each,
  reserve,
  clear,
  size,
  insert_range,
  erase_range,
  kCount
};
constexpr unsigned kOpCount = static_cast<unsigned>(op::kCount);
static_assert(static_cast<unsigned>(op::erase_if) + kOpCount * gf::kWholeMapArg <= 255,
              "an op byte must be able to ask for the whole-map erase_if");

template <class Key, class Value>
class model_run {
  using map_type = grace::hash_map<Key, Value, gf::index_hash>;
  using keys = gf::key_codec<Key>;
  using values = gf::value_codec<Value>;

 public:
  model_run(gf::hash_mode hash, const grace::hash_map_options& options)
      : options_(options), map_(options, gf::index_hash{hash}) {}

  void run(gf::byte_reader& in) {
    for (std::size_t n = 0; in.left() >= 2; ++n) {
      op_ = n;
      const std::uint8_t op_byte = in.next();
      const std::size_t index = in.next() % kKeys;
      buckets_before_ = map_.stats().buckets;
      apply(static_cast<op>(op_byte % kOpCount), op_byte / kOpCount, index);
      GRACE_FUZZ_CHECK(map_.size() == model_.size(), "op %zu: size() %zu, model %zu", op_,
                       map_.size(), model_.size());
      if (held_ && --held_->ops_left == 0) release_pin();
      if (n % kContentCheckEvery == kContentCheckEvery - 1) check_content();
    }
    if (held_) release_pin();
    check_content();
  }

 private:
  std::uint64_t fresh_code(std::size_t index) { return gf::value_code(index, 0, ++serial_); }

  // The value must be exactly the model's.
  void check_value(const char* what, std::size_t index, const Value& value) const {
    const std::optional<std::uint64_t> code = values::read(value);
    GRACE_FUZZ_CHECK(code.has_value(), "op %zu: %s(%zu) saw a malformed value", op_, what,
                     index);
    const auto it = model_.find(index);
    GRACE_FUZZ_CHECK(it != model_.end(), "op %zu: %s(%zu) saw a value of an absent key", op_,
                     what, index);
    GRACE_FUZZ_CHECK(*code == it->second, "op %zu: %s(%zu) saw %#llx, model %#llx", op_, what,
                     index, static_cast<unsigned long long>(*code),
                     static_cast<unsigned long long>(it->second));
  }
  void check_present(const char* what, std::size_t index, bool map_says) const {
    const bool present = model_.count(index) != 0;
    GRACE_FUZZ_CHECK(map_says == present, "op %zu: %s(%zu) returned %d, model says %d", op_,
                     what, index, map_says, present);
  }

  void apply(op o, unsigned arg, std::size_t index) {
    const Key key = keys::make(index);
    switch (o) {
      case op::find: {
        const std::optional<Value> found = map_.find(key);
        check_present("find", index, found.has_value());
        if (found) check_value("find", index, *found);
        break;
      }
      case op::contains: {
        const bool count = (arg & 1) != 0;
        const std::size_t found = gf::lookup_count(map_, key, count);
        GRACE_FUZZ_CHECK(found <= 1, "op %zu: count(%zu) returned %zu", op_, index, found);
        check_present(count ? "count" : "contains", index, found == 1);
        break;
      }
      case op::visit: {
        int calls = 0;
        const bool visited = map_.visit(key, [&](const Value& v) {
          ++calls;
          check_value("visit", index, v);
        });
        check_present("visit", index, visited);
        GRACE_FUZZ_CHECK(calls == (visited ? 1 : 0), "op %zu: visit called f %d times", op_,
                         calls);
        break;
      }
      case op::pin:
        pin(key, index, arg);
        break;
      case op::insert:
        insert(gf::insert_member::insert, key, index, arg);
        break;
      case op::try_emplace:
        insert(gf::insert_member::try_emplace, key, index, arg);
        break;
      case op::insert_or_assign:
        insert(gf::insert_member::insert_or_assign, key, index, arg);
        break;
      case op::assign: {
        const std::uint64_t code = fresh_code(index);
        const bool assigned = map_.assign(key, values::make(code));
        check_present("assign", index, assigned);
        if (assigned) model_[index] = code;
        break;
      }
      case op::update: {
        const std::uint64_t code = fresh_code(index);
        int calls = 0;
        const bool updated = map_.update(key, [&](const Value& old) {
          ++calls;
          check_value("update", index, old);
          return values::make(code);
        });
        check_present("update", index, updated);
        GRACE_FUZZ_CHECK(calls == (updated ? 1 : 0), "op %zu: update called f %d times", op_,
                         calls);
        if (updated) model_[index] = code;
        break;
      }
      case op::insert_or_update: {
        const std::uint64_t inserted_code = fresh_code(index);
        const std::uint64_t updated_code = fresh_code(index);
        const auto [inserted, calls] = gf::insert_or_update_counted(
            map_, key, inserted_code, updated_code,
            [&](const Value& old) { check_value("insert_or_update", index, old); });
        check_present("!insert_or_update", index, !inserted);
        GRACE_FUZZ_CHECK(calls == (inserted ? 0 : 1),
                         "op %zu: insert_or_update called f %d times", op_, calls);
        model_[index] = inserted ? inserted_code : updated_code;
        after_update(inserted, false);
        break;
      }
      case op::erase: {
        const bool erased = map_.erase(key);
        check_present("erase", index, erased);
        model_.erase(index);
        after_update(false, erased);
        break;
      }
      case op::extract: {
        const std::optional<Value> taken = map_.extract(key);
        check_present("extract", index, taken.has_value());
        if (taken) check_value("extract", index, *taken);
        model_.erase(index);
        after_update(false, taken.has_value());
        break;
      }
      case op::erase_if: {
        if (arg >= gf::kWholeMapArg) {
          erase_matching(index, arg);
          break;
        }
        const bool want = (arg & 1) != 0;
        int calls = 0;
        const bool erased = map_.erase_if(key, [&](const Value& v) {
          ++calls;
          check_value("erase_if", index, v);
          return want;
        });
        const bool present = model_.count(index) != 0;
        GRACE_FUZZ_CHECK(erased == (present && want), "op %zu: erase_if(%zu) returned %d", op_,
                         index, erased);
        GRACE_FUZZ_CHECK(calls == (present ? 1 : 0), "op %zu: erase_if called pred %d times",
                         op_, calls);
        if (erased) model_.erase(index);
        after_update(false, erased);
        break;
      }
      case op::for_each:
        if (arg == 0) {
          check_content();
        } else {
          check_stopped_walk(arg);
        }
        break;
      case op::reserve:
        // Up to 2040 elements: up to 4096 buckets at the smallest load factor.
        map_.reserve(index * 16 + arg);
        reserved_ = true;
        break;
      case op::clear: {
        const bool erased = !model_.empty();  // clear() counts its erases at once, if any
        map_.clear();
        model_.clear();
        reserved_ = false;
        GRACE_FUZZ_CHECK(map_.empty(), "op %zu: not empty after clear()", op_);
        after_update(false, erased);
        break;
      }
      case op::size: {
        GRACE_FUZZ_CHECK(map_.empty() == model_.empty(), "op %zu: empty()", op_);
        const std::size_t buckets = map_.bucket_count();
        GRACE_FUZZ_CHECK(gf::buckets_in_bounds(buckets, options_), "op %zu: bucket_count() %zu",
                         op_, buckets);
        GRACE_FUZZ_CHECK(gf::load_factor_is(map_, model_.size()),
                         "op %zu: load_factor() %g, with %zu elements in %zu buckets", op_,
                         static_cast<double>(map_.load_factor()), model_.size(), buckets);
        break;
      }
      case op::insert_range:
        for (std::size_t i = 0; i < 4 * (arg + 1); ++i) {
          const std::size_t k = (index + i) % kKeys;
          const std::uint64_t code = fresh_code(k);
          const bool inserted = map_.insert(keys::make(k), values::make(code));
          check_present("!insert_range", k, !inserted);
          if (inserted) model_.emplace(k, code);
          after_update(inserted, false);
          buckets_before_ = map_.stats().buckets;
        }
        break;
      case op::erase_range:
        for (std::size_t i = 0; i < 4 * (arg + 1); ++i) {
          const std::size_t k = (index + i) % kKeys;
          const bool erased = map_.erase(keys::make(k));
          check_present("erase_range", k, erased);
          model_.erase(k);
          after_update(false, erased);
          buckets_before_ = map_.stats().buckets;
        }
        break;
      case op::kCount:
        break;
    }
  }

  // insert, try_emplace or insert_or_assign; arg bit 0 moves the key in.
  void insert(gf::insert_member member, const Key& key, std::size_t index, unsigned arg) {
    const std::uint64_t code = fresh_code(index);
    const bool moved = (arg & 1) != 0;
    const gf::insert_result r = gf::insert_into(map_, member, moved, key, values::make(code));
    GRACE_FUZZ_CHECK(!r.key_lost, "op %zu: %s(std::move(key %zu)) did not insert it and did "
                     "not give it back", op_, gf::name_of(member), index);
    const bool present = model_.count(index) != 0;
    GRACE_FUZZ_CHECK(r.inserted != present, "op %zu: %s(%zu%s) returned %d, model: present %d",
                     op_, gf::name_of(member), index, moved ? ", moved" : "", r.inserted,
                     present);
    if (member == gf::insert_member::insert_or_assign) {
      model_[index] = code;
    } else if (r.inserted) {
      model_.emplace(index, code);
    }
    after_update(r.inserted, false);
  }

  // erase_if(pred) over the whole map: pred sees every element once, with the model's value,
  // and the count is what std::erase_if removes from the model. Its erases run inside the
  // walk's read section, where the table cannot shrink; it looks at the load factor after
  // the walk, so the table is in bounds afterwards like after any erase.
  void erase_matching(std::size_t anchor, unsigned arg) {
    std::vector<bool> passed(kKeys, false);
    std::size_t calls = 0;
    const std::size_t erased = map_.erase_if([&](const Key& key, const Value& value) {
      ++calls;
      return gf::whole_map_erases(check_walked("erase_if(pred)", passed, key, value), anchor,
                                  arg);
    });
    GRACE_FUZZ_CHECK(calls == model_.size(), "op %zu: erase_if(pred) called pred %zu times, "
                     "model has %zu", op_, calls, model_.size());
    const std::size_t expected = std::erase_if(
        model_, [&](const auto& entry) { return gf::whole_map_erases(entry.first, anchor, arg); });
    GRACE_FUZZ_CHECK(erased == expected, "op %zu: erase_if(pred) erased %zu, model %zu", op_,
                     erased, expected);
    after_update(false, erased != 0);
  }

  // A for_each whose f returns false at its stop_at-th element: it stops there (or visits
  // every element if there are fewer), each with the model's value.
  void check_stopped_walk(std::size_t stop_at) {
    std::vector<bool> passed(kKeys, false);
    const std::size_t calls = gf::for_each_until(map_, stop_at, [&](const Key& key,
                                                                    const Value& value) {
      check_walked("for_each", passed, key, value);
    });
    GRACE_FUZZ_CHECK(calls <= stop_at, "op %zu: for_each called f again after it returned false",
                     op_);
    GRACE_FUZZ_CHECK(calls == std::min(stop_at, model_.size()),
                     "op %zu: for_each stopping at %zu of %zu called f %zu times", op_, stop_at,
                     model_.size(), calls);
  }

  void pin(const Key& key, std::size_t index, unsigned arg) {
    if (held_) {  // already pinned: read through a nested view
      auto view = map_.pin();
      const Value* v = view.find(key);
      check_present("pin().find", index, v != nullptr);
      if (v != nullptr) check_value("pin().find", index, *v);
      check_present("pin().contains", index, view.contains(key));
      return;
    }
    held_.emplace(map_, key, op_, arg, [&](const Value& v) {
      check_value("pin().find", index, v);
      return *values::read(v);
    });
    check_present("pin().find", index, held_->element != nullptr);
  }

  void release_pin() {
    GRACE_FUZZ_CHECK(held_->unchanged(),
                     "op %zu: an element pinned since op %zu changed under its read section",
                     op_, held_->pinned_at);
    held_.reset();
  }

  // Single-threaded, a table of at most 256 buckets looks at its load factor after every
  // insert and erase (larger tables sample), so it is in bounds afterwards: not above the
  // grow load factor unless at max_buckets; not below the shrink load factor unless at
  // min_buckets, or a reserve() since the last clear() holds it up, or a read section was
  // open (shrinking waits for grace periods, so it never runs inside one).
  void after_update(bool inserted, bool erased) {
    if (!inserted && !erased) return;
    const grace::hash_map_stats s = map_.stats();
    const double size = static_cast<double>(s.size);
    const double buckets = static_cast<double>(s.buckets);
    GRACE_FUZZ_CHECK(gf::buckets_in_bounds(s.buckets, options_), "op %zu: %llu buckets", op_,
                     static_cast<unsigned long long>(s.buckets));
    if (buckets_before_ <= 256) {
      GRACE_FUZZ_CHECK(size <= buckets * options_.grow_load_factor ||
                           s.buckets == options_.max_buckets,
                       "op %zu: the table did not grow (%zu elements, %llu buckets)", op_,
                       model_.size(), static_cast<unsigned long long>(s.buckets));
      GRACE_FUZZ_CHECK(size >= buckets * options_.shrink_load_factor ||
                           s.buckets <= options_.min_buckets || reserved_ || held_ ||
                           grace::in_read_section(),
                       "op %zu: the table did not shrink (%zu elements, %llu buckets)", op_,
                       model_.size(), static_cast<unsigned long long>(s.buckets));
    }
  }

  // An element a walk (for_each, the whole-map erase_if) passed: a key the model holds, not
  // passed before in this walk, with the model's value. Returns its index.
  std::size_t check_walked(const char* what, std::vector<bool>& passed, const Key& key,
                           const Value& value) const {
    const std::optional<std::size_t> index = keys::index_of(key);
    GRACE_FUZZ_CHECK(index.has_value() && *index < kKeys,
                     "op %zu: %s passed a key never inserted", op_, what);
    GRACE_FUZZ_CHECK(!passed[*index], "op %zu: %s passed key %zu twice", op_, what, *index);
    passed[*index] = true;
    check_value(what, *index, value);
    return *index;
  }

  // for_each visits every element once, with the model's value, and nothing else: distinct
  // keys the model holds, as many as it holds.
  void check_content() {
    std::vector<bool> passed(kKeys, false);
    std::size_t visited = 0;
    map_.for_each([&](const Key& key, const Value& value) {
      ++visited;
      check_walked("for_each", passed, key, value);
    });
    GRACE_FUZZ_CHECK(visited == model_.size(), "op %zu: for_each visited %zu, model has %zu",
                     op_, visited, model_.size());
  }

  grace::hash_map_options options_;
  map_type map_;
  std::unordered_map<std::size_t, std::uint64_t> model_;  // key index -> value code
  std::optional<gf::held_pin<map_type>> held_;  // op::pin
  std::uint64_t serial_ = 0;
  std::size_t op_ = 0;
  std::uint64_t buckets_before_ = 0;  // the table's size before the current update
  bool reserved_ = false;           // reserve() since the last clear()
};

template <class Key, class Value>
void run(gf::hash_mode hash, const grace::hash_map_options& options, gf::byte_reader& in) {
  model_run<Key, Value> run(hash, options);
  run.run(in);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gf::byte_reader in(data, size);
  const gf::input_header header = gf::read_header(in);
  if (header.strings) {
    run<std::string, std::string>(header.hash, header.options, in);
  } else {
    run<std::uint64_t, std::uint64_t>(header.hash, header.options, in);
  }
  return 0;
}
