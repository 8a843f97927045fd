// Linearizability of grace::hash_map (CTest label `stress`; issue #5): threads run thousands
// of short random histories of map operations on a few shared keys while one of them drives
// the table through grows and shrinks. Every history is recorded (invocation and response
// times, arguments, results) and checked against a sequential map.
//
// How a history is checked:
//   - Wing & Gong's search (JPDC 1993) with Lowe's memoisation ("Testing for
//     linearizability", CCPE 2017): depth first over the orders in which the pending
//     operations may take effect, never revisiting a (set of linearized operations, state)
//     configuration.
//   - Per key (P-compositionality, Horn & Kroening 2015; Lowe section 5): a map is a product
//     of independent registers, one per key, and linearizability is local (Herlihy & Wing
//     1990), so the history is split by key and every key's sub-history is checked against a
//     one-register model: absent, or one value. for_each() and clear() are not atomic across
//     keys (hash_map.h) and their contract is per key, so each splits into a part per key,
//     made of atomic steps inside the call: for_each() reads the key (visited with value v:
//     it held v at that instant; not visited: it was absent), clear() erases it, and may
//     leave it only if a successful update of it overlaps the call ("concurrent updates may
//     leave elements inserted meanwhile"). With equal hashes a walk can meet two elements of
//     one key, so a part may have several steps (see key_op).
//   - Every value written is unique (writer thread and sequence number), so a read names the
//     write it saw; update() and erase_if() record the value their function last saw, which
//     checks the read half of a read-modify-write too.
//   - Between histories the last thread to arrive at a barrier reads every key once, with no
//     operation in flight: those reads end one history and give the next its initial state.
//     size() and empty(), exact only with no update in flight, are checked there too.
//
// How histories are recorded: one map per test, with tiny tables (1 bucket at least, growing
// past half a key per bucket); each history has 2-4 threads doing random operations on 1-4
// shared keys, and one thread (a different one each time) inserting and then erasing a dozen
// more keys among its own operations, so the table grows and shrinks while the others run;
// some histories add a reserve() or a clear(). Threads are pinned to CPUs round robin, start
// each history together (a spin gate after the barrier) and pause at random between
// operations. The tests require that the table grew and shrank in some histories and that
// some operations overlapped another thread's, and print how many.
// A last test runs the same recording on a map whose insert_or_assign() is an erase() then
// an insert(), and requires the checker to reject one of its histories.
//
// Why the recorded times are sound: each operation takes a stamp from one global counter
// (fetch_add, acq_rel) just before it calls the map and another just after it returns. The
// counter's read-modify-writes are totally ordered and each reads the previous one, so they
// form one release sequence: if A's response stamp is smaller than B's invocation stamp,
// A's response stamp synchronizes-with B's invocation stamp and A happens-before B. The
// checker orders A before B only in that case; operations whose intervals overlap may take
// effect in either order. Every precedence it imposes is thus a real happens-before edge,
// so a rejected history is a real violation (a linearizable map must respect happens-before);
// the edges it does not see only make the check weaker. Acq_rel is enough: the argument uses
// the release sequence of this one counter and no other atomic; seq_cst would add nothing.
//
// A rejected history is printed per thread, with every operation's two stamps, arguments and
// result, the key whose sub-history has no linearization, and the longest linearizable
// prefix of that sub-history.
#include <gtest/gtest.h>
#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "grace/map/hash_map.h"
#include "tests/testing/testing.h"

namespace {

namespace gt = grace::testing;
using namespace std::chrono_literals;

constexpr auto kNoDeadlock = 150s;  // watchdog budget for one test's threads

// =============================================================================================
// Histories.

// A key's state in the model: kAbsent, or the value it maps to. Values written are never 0.
constexpr std::uint64_t kAbsent = 0;

// Values written by the recorded threads: (writer + 1) << kWriterShift | sequence number.
// Hand-built histories use small numbers (writer field 0).
constexpr unsigned kWriterShift = 40;
constexpr std::uint64_t kSequenceMask = (std::uint64_t{1} << kWriterShift) - 1;

std::uint64_t value_of(unsigned writer, std::uint64_t sequence) {
  return (std::uint64_t{writer} + 1) << kWriterShift | sequence;
}

// Every hash_map member with a result, plus the whole-map calls. pinned_* go through
// hash_map::pin().
enum class op_kind : std::uint8_t {
  insert,
  try_emplace,
  insert_or_assign,
  assign,
  update,
  erase,
  erase_if,
  find,
  contains,
  visit,
  pinned_find,
  pinned_contains,
  for_each,
  clear,
  reserve,
};

struct op {
  op_kind kind = op_kind::find;
  std::uint64_t key = 0;
  std::uint64_t arg = 0;  // the value written; reserve(): its element count
  std::uint64_t invoked = 0;
  std::uint64_t returned = 0;
  bool ok = false;               // the bool result; find(), pinned_find(): found
  std::uint64_t seen = kAbsent;  // reads: the value read; update(): the value f last saw;
                                 // erase_if(): the value pred last saw
  bool pred_said_yes = false;    // erase_if(): pred's last answer
  std::vector<std::pair<std::uint64_t, std::uint64_t>> visited;  // for_each(): (key, value)
  unsigned pause = 0;  // recording only: busy-wait steps before the call, to vary interleavings
};

struct thread_log {
  std::string name;
  std::vector<op> ops;  // in program order
};

struct history {
  std::vector<std::uint64_t> keys;                           // every key it may touch
  std::unordered_map<std::uint64_t, std::uint64_t> initial;  // missing: absent
  std::vector<thread_log> threads;

  std::uint64_t initial_value(std::uint64_t key) const {
    const auto it = initial.find(key);
    return it == initial.end() ? kAbsent : it->second;
  }
};

// Whether the operation, with its recorded result, changed its key.
bool changed_key(const op& o) {
  switch (o.kind) {
    case op_kind::insert:
    case op_kind::try_emplace:
    case op_kind::assign:
    case op_kind::update:
    case op_kind::erase:
    case op_kind::erase_if:
      return o.ok;
    case op_kind::insert_or_assign:
      return true;
    default:
      return false;
  }
}

// ---------------------------------------------------------------------------------------------
// Printing.

std::string key_text(std::uint64_t key) { return "k" + std::to_string(key); }

std::string value_text(std::uint64_t value) {
  if (value == kAbsent) return "absent";
  const std::uint64_t writer = value >> kWriterShift;
  if (writer == 0) return "v" + std::to_string(value);
  return "v" + std::to_string(writer - 1) + "." + std::to_string(value & kSequenceMask);
}

const char* bool_text(bool b) { return b ? "true" : "false"; }

std::string op_text(const op& o) {
  const std::string k = key_text(o.key);
  const std::string v = value_text(o.arg);
  switch (o.kind) {
    case op_kind::insert:
      return "insert(" + k + ", " + v + ") -> " + bool_text(o.ok);
    case op_kind::try_emplace:
      return "try_emplace(" + k + ", " + v + ") -> " + bool_text(o.ok);
    case op_kind::insert_or_assign:
      return "insert_or_assign(" + k + ", " + v + ") -> " + bool_text(o.ok) +
             (o.ok ? " (inserted)" : " (replaced)");
    case op_kind::assign:
      return "assign(" + k + ", " + v + ") -> " + bool_text(o.ok);
    case op_kind::update:
      return "update(" + k + ", old -> " + v + ") -> " + bool_text(o.ok) +
             (o.seen != kAbsent ? ", f last saw " + value_text(o.seen) : ", f not called");
    case op_kind::erase:
      return "erase(" + k + ") -> " + bool_text(o.ok);
    case op_kind::erase_if:
      return "erase_if(" + k + ", pred) -> " + bool_text(o.ok) +
             (o.seen != kAbsent ? ", pred last saw " + value_text(o.seen) + " and said " +
                                      (o.pred_said_yes ? "yes" : "no")
                                : ", pred not called");
    case op_kind::find:
      return "find(" + k + ") -> " + (o.ok ? value_text(o.seen) : "nullopt");
    case op_kind::contains:
      return "contains(" + k + ") -> " + bool_text(o.ok);
    case op_kind::visit:
      return "visit(" + k + ", f) -> " + bool_text(o.ok) +
             (o.seen != kAbsent ? ", f saw " + value_text(o.seen) : "");
    case op_kind::pinned_find:
      return "pin().find(" + k + ") -> " + (o.ok ? "&" + value_text(o.seen) : "nullptr");
    case op_kind::pinned_contains:
      return "pin().contains(" + k + ") -> " + bool_text(o.ok);
    case op_kind::for_each: {
      std::string text = "for_each(f) visited {";
      for (std::size_t i = 0; i < o.visited.size(); ++i) {
        text += (i == 0 ? "" : ", ") + key_text(o.visited[i].first) + ": " +
                value_text(o.visited[i].second);
      }
      return text + "}";
    }
    case op_kind::clear:
      return "clear()";
    case op_kind::reserve:
      return "reserve(" + std::to_string(o.arg) + ")";
  }
  return "?";
}

std::string stamped_text(const op& o) {
  char times[64];
  std::snprintf(times, sizeof times, "[%8llu, %8llu] ", static_cast<unsigned long long>(o.invoked),
                static_cast<unsigned long long>(o.returned));
  return times + op_text(o);
}

// =============================================================================================
// The checker.

// One operation of one key's sub-history: a single-key operation, or one piece of a
// whole-map operation's part for this key.
//
// A whole-map operation walks the list, and with equal hashes a key erased behind the walk
// and inserted again can land ahead of it (new elements go at the end of their run of equal
// split-order keys). So for_each() may visit a key once per element (hash_map.h: elements
// inserted meanwhile may or may not be visited), and clear() may erase it more than once.
// Such an operation becomes one piece per step, each an atomic step at its own instant inside
// the call, taken in order:
//   - for_each(): one read per distinct value visited, in visiting order; or one read of
//     "absent" if the key was not visited. The same value twice is the same element twice.
//   - clear(): 1 + w erasures, w = the successful updates of the key that overlap it (every
//     erasure after the first removes one of their elements). If w > 0 each piece may also
//     leave the key ("concurrent updates may leave elements inserted meanwhile").
struct key_op {
  const op* source = nullptr;
  std::size_t thread = 0;  // index into history::threads
  std::uint64_t invoked = 0;
  std::uint64_t returned = 0;
  unsigned piece = 0;         // which step of a whole-map operation's part (0 for the others)
  unsigned pieces = 1;        // how many steps that part has
  std::size_t after = kNone;  // the index of the previous piece in the sorted sub-history
  // for_each(): the value this piece read (kAbsent: the key was not visited), and whether the
  // walk visited one element of the key twice.
  std::uint64_t observed = kAbsent;
  bool visited_twice = false;
  // clear(): a successful update of this key overlaps the call, so the piece may leave it.
  bool may_keep = false;

  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
};

struct key_history {
  std::uint64_t key = 0;
  std::uint64_t initial = kAbsent;
  std::vector<key_op> ops;  // sorted by invocation
};

// The sequential specification of one key: the states `o` may leave when it takes effect in
// `state` and returns what was recorded. Writes them to `next`; returns how many (0: `o`
// cannot take effect in `state`).
int next_states(const key_op& k, std::uint64_t state, std::array<std::uint64_t, 2>& next) {
  const op& o = *k.source;
  const bool present = state != kAbsent;
  auto only = [&next](std::uint64_t s) {
    next[0] = s;
    return 1;
  };
  switch (o.kind) {
    case op_kind::insert:
    case op_kind::try_emplace:
      if (o.ok) return present ? 0 : only(o.arg);
      return present ? only(state) : 0;
    case op_kind::insert_or_assign:  // true iff it inserted
      return o.ok == !present ? only(o.arg) : 0;
    case op_kind::assign:
      if (o.ok) return present ? only(o.arg) : 0;
      return present ? 0 : only(state);
    case op_kind::update:  // f ran last on the value it replaced
      if (o.ok) return present && o.seen == state ? only(o.arg) : 0;
      return present ? 0 : only(state);
    case op_kind::erase:
      if (o.ok) return present ? only(kAbsent) : 0;
      return present ? 0 : only(state);
    case op_kind::erase_if:  // pred ran last on the value the outcome depended on
      if (o.ok) return present && o.seen == state && o.pred_said_yes ? only(kAbsent) : 0;
      if (o.seen != kAbsent && !o.pred_said_yes) return o.seen == state ? only(state) : 0;
      return present ? 0 : only(state);
    case op_kind::find:
    case op_kind::visit:
    case op_kind::pinned_find:
      if (o.ok != (o.seen != kAbsent)) return 0;  // a result that contradicts itself
      return o.seen == state ? only(state) : 0;
    case op_kind::contains:
    case op_kind::pinned_contains:
      return o.ok == present ? only(state) : 0;
    case op_kind::for_each:
      return !k.visited_twice && k.observed == state ? only(state) : 0;
    case op_kind::clear:
      next[0] = kAbsent;
      if (k.may_keep && present) {
        next[1] = state;
        return 2;
      }
      return 1;
    case op_kind::reserve:  // touches no key; never part of a key's sub-history
      return only(state);
  }
  return 0;
}

// Splits a history into one sub-history per key: the key space, every key an operation names,
// and every key a for_each() visited (outside the key space such a key can only have been
// read, never written).
std::vector<key_history> split_by_key(const history& h) {
  std::vector<key_history> per_key;
  std::unordered_map<std::uint64_t, std::size_t> index;
  auto add_key = [&](std::uint64_t key) {
    if (index.try_emplace(key, per_key.size()).second) {
      per_key.push_back(key_history{key, h.initial_value(key), {}});
    }
  };
  for (std::uint64_t key : h.keys) add_key(key);
  for (const thread_log& t : h.threads) {
    for (const op& o : t.ops) {
      if (o.kind == op_kind::for_each) {
        for (const auto& visit : o.visited) add_key(visit.first);
      } else if (o.kind != op_kind::clear && o.kind != op_kind::reserve) {
        add_key(o.key);
      }
    }
  }
  // Single-key operations and for_each() first; clear() needs the updates that overlap it.
  for (std::size_t t = 0; t < h.threads.size(); ++t) {
    for (const op& o : h.threads[t].ops) {
      const key_op part{&o, t, o.invoked, o.returned};
      if (o.kind == op_kind::reserve || o.kind == op_kind::clear) continue;
      if (o.kind != op_kind::for_each) {
        per_key[index.at(o.key)].ops.push_back(part);
        continue;
      }
      for (key_history& kh : per_key) {
        std::vector<std::uint64_t> values;  // distinct, in visiting order
        bool twice = false;
        for (const auto& [key, value] : o.visited) {
          if (key != kh.key) continue;
          if (std::find(values.begin(), values.end(), value) != values.end()) {
            twice = true;
          } else {
            values.push_back(value);
          }
        }
        if (values.empty()) values.push_back(kAbsent);
        for (std::size_t i = 0; i < values.size(); ++i) {
          key_op read = part;
          read.piece = static_cast<unsigned>(i);
          read.pieces = static_cast<unsigned>(values.size());
          read.observed = values[i];
          read.visited_twice = twice;
          kh.ops.push_back(read);
        }
      }
    }
  }
  for (std::size_t t = 0; t < h.threads.size(); ++t) {
    for (const op& o : h.threads[t].ops) {
      if (o.kind != op_kind::clear) continue;
      for (key_history& kh : per_key) {
        const auto overlapping_updates = static_cast<unsigned>(
            std::count_if(kh.ops.begin(), kh.ops.end(), [&o](const key_op& other) {
              return changed_key(*other.source) && other.invoked < o.returned &&
                     other.returned > o.invoked;
            }));
        for (unsigned i = 0; i <= overlapping_updates; ++i) {
          key_op step{&o, t, o.invoked, o.returned, i, overlapping_updates + 1};
          step.may_keep = overlapping_updates > 0;
          kh.ops.push_back(step);
        }
      }
    }
  }
  for (key_history& kh : per_key) {
    std::stable_sort(kh.ops.begin(), kh.ops.end(),
                     [](const key_op& a, const key_op& b) { return a.invoked < b.invoked; });
    for (std::size_t i = 0; i < kh.ops.size(); ++i) {
      if (kh.ops[i].piece == 0) continue;
      for (std::size_t j = 0; j < i; ++j) {
        if (kh.ops[j].source == kh.ops[i].source && kh.ops[j].piece + 1 == kh.ops[i].piece) {
          kh.ops[i].after = j;
        }
      }
    }
  }
  return per_key;
}

// The most operations one key's sub-history may hold (the linearized set is two words).
constexpr std::size_t kMaxOpsPerKey = 128;

// Wing & Gong's depth-first search for a linearization of one key's sub-history, memoising
// the configurations already explored (Lowe).
class key_search {
 public:
  explicit key_search(const key_history& h) : h_(h) {}

  // True iff some order of the operations respects their stamps (an operation that returned
  // before another was invoked comes first) and the one-register model accepts every result.
  bool linearizable() { return search(h_.initial); }

  std::uint64_t configurations() const { return explored_.size(); }
  // The operations (indices into the sub-history) of the deepest configuration reached, in
  // the order they were linearized.
  const std::vector<std::size_t>& longest_prefix() const { return longest_; }

 private:
  struct configuration {
    std::array<std::uint64_t, 2> linearized;
    std::uint64_t state;
    bool operator==(const configuration&) const = default;
  };
  struct configuration_hash {
    std::size_t operator()(const configuration& c) const noexcept {
      std::uint64_t x = c.linearized[0] * 0x9e3779b97f4a7c15ULL;
      x ^= (c.linearized[1] + 0x632be59bd9b4e019ULL) * 0xbf58476d1ce4e5b9ULL;
      x ^= (c.state + (x << 6) + (x >> 2)) * 0x94d049bb133111ebULL;
      return static_cast<std::size_t>(x ^ (x >> 31));
    }
  };

  bool done(std::size_t i) const { return (linearized_[i / 64] >> (i % 64)) & 1; }
  void flip(std::size_t i) { linearized_[i / 64] ^= std::uint64_t{1} << (i % 64); }

  bool search(std::uint64_t state) {
    const std::vector<key_op>& ops = h_.ops;
    if (path_.size() == ops.size()) return true;
    if (!explored_.insert(configuration{linearized_, state}).second) return false;
    // An operation may take effect next only if it was invoked before every pending
    // operation's response.
    std::uint64_t first_return = std::numeric_limits<std::uint64_t>::max();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (!done(i)) first_return = std::min(first_return, ops[i].returned);
    }
    for (std::size_t i = 0; i < ops.size() && ops[i].invoked < first_return; ++i) {
      if (done(i)) continue;
      // The pieces of one whole-map operation take effect in order.
      if (ops[i].after != key_op::kNone && !done(ops[i].after)) continue;
      std::array<std::uint64_t, 2> next{};
      const int count = next_states(ops[i], state, next);
      for (int n = 0; n < count; ++n) {
        flip(i);
        path_.push_back(i);
        if (path_.size() > longest_.size()) longest_ = path_;
        if (search(next[n])) return true;
        path_.pop_back();
        flip(i);
      }
    }
    return false;
  }

  const key_history& h_;
  std::array<std::uint64_t, 2> linearized_{};
  std::vector<std::size_t> path_;
  std::vector<std::size_t> longest_;
  std::unordered_set<configuration, configuration_hash> explored_;
};

struct verdict {
  bool linearizable = true;
  std::string report;  // when not linearizable: what to print
  std::size_t ops = 0;
  std::size_t key_histories = 0;
  std::uint64_t configurations = 0;
};

std::string history_text(const history& h) {
  std::string text =
      "The whole history (times from one global counter: each operation took effect somewhere "
      "between its two times):\n  initially:";
  for (std::uint64_t key : h.keys) {
    text += " " + key_text(key) + "=" + value_text(h.initial_value(key));
  }
  text += "\n";
  for (const thread_log& t : h.threads) {
    text += "  " + t.name + ":\n";
    for (const op& o : t.ops) text += "    " + stamped_text(o) + "\n";
  }
  return text;
}

// One line of a key's sub-history: thread, times, the operation, and for a whole-map
// operation what its piece does to this key.
std::string key_op_text(const history& h, const key_history& kh, const key_op& k) {
  std::string text = h.threads[k.thread].name + "  " + stamped_text(*k.source);
  const std::string step = k.pieces > 1 ? " (step " + std::to_string(k.piece + 1) + " of " +
                                              std::to_string(k.pieces) + ")"
                                        : "";
  if (k.source->kind == op_kind::for_each) {
    text += "  [" + key_text(kh.key) + step + ": " +
            (k.visited_twice         ? std::string("one element visited twice")
             : k.observed == kAbsent ? std::string("not visited")
                                     : "saw " + value_text(k.observed)) +
            "]";
  } else if (k.source->kind == op_kind::clear) {
    text += "  [" + key_text(kh.key) + step + ": " +
            (k.may_keep ? "erases it, or keeps it (updates of it overlap)" : "erases it") + "]";
  }
  return text;
}

std::string rejection_text(const history& h, const key_history& kh, const key_search& search) {
  std::string text = "Not linearizable: key " + key_text(kh.key) + " (initially " +
                     value_text(kh.initial) + "). No order of its " +
                     std::to_string(kh.ops.size()) +
                     " operations that respects their times fits a sequential map (" +
                     std::to_string(search.configurations()) +
                     " configurations explored). The longest linearizable prefix is " +
                     std::to_string(search.longest_prefix().size()) + " of them:\n";
  for (std::size_t i : search.longest_prefix()) {
    text += "    " + key_op_text(h, kh, kh.ops[i]) + "\n";
  }
  text += "Key " + key_text(kh.key) + "'s operations, by invocation:\n";
  for (const key_op& k : kh.ops) text += "    " + key_op_text(h, kh, k) + "\n";
  return text + history_text(h);
}

verdict check(const history& h) {
  verdict v;
  for (const thread_log& t : h.threads) v.ops += t.ops.size();
  for (const key_history& kh : split_by_key(h)) {
    ++v.key_histories;
    if (kh.ops.size() > kMaxOpsPerKey) {
      v.linearizable = false;
      v.report = "key " + key_text(kh.key) + " has " + std::to_string(kh.ops.size()) +
                 " operations; the checker takes at most " + std::to_string(kMaxOpsPerKey) + "\n" +
                 history_text(h);
      return v;
    }
    key_search search(kh);
    const bool ok = search.linearizable();
    v.configurations += search.configurations();
    if (!ok) {
      v.linearizable = false;
      v.report = rejection_text(h, kh, search);
      return v;
    }
  }
  return v;
}

// =============================================================================================
// Recording histories from a live map.

struct run_config {
  unsigned threads = 4;
  std::size_t histories = 1000;
  unsigned ops_per_thread = 12;  // on the hot keys
  unsigned hot_keys = 4;         // keys 0 .. hot_keys - 1, shared by every thread
  // Keys 100 .. 100 + wave_keys - 1: one thread per history (a different one each time)
  // inserts all of them, then erases them, between its hot-key operations, so the table
  // grows and shrinks while the other threads run.
  unsigned wave_keys = 12;
  bool whole_map_ops = true;  // for_each(), clear(), reserve()
  std::uint64_t seed = 1;
};

struct run_summary {
  std::size_t histories = 0;  // checked
  std::size_t ops = 0;        // recorded, end-of-history reads included
  std::size_t key_histories = 0;
  std::uint64_t configurations = 0;
  std::size_t overlapping_ops = 0;  // recorded operations that overlap another thread's
  std::size_t histories_with_grow = 0;
  std::size_t histories_with_shrink = 0;
  std::uint64_t grows = 0;
  std::uint64_t shrinks = 0;
  std::string failure;  // the first rejected history's report; empty if none
  double seconds = 0;
};

constexpr std::uint64_t kFirstWaveKey = 100;

// How many operations overlap an operation of another thread: how concurrent the history
// really was.
std::size_t overlapping_ops(const history& h) {
  std::size_t count = 0;
  for (std::size_t t = 0; t < h.threads.size(); ++t) {
    for (const op& o : h.threads[t].ops) {
      bool overlaps = false;
      for (std::size_t u = 0; u < h.threads.size() && !overlaps; ++u) {
        if (u == t) continue;
        for (const op& p : h.threads[u].ops) {
          if (p.invoked < o.returned && o.invoked < p.returned) {
            overlaps = true;
            break;
          }
        }
      }
      count += overlaps;
    }
  }
  return count;
}

// The global clock of the recorded histories.
class stamp_clock {
 public:
  // AcqRel: this RMW synchronizes-with the previous one (one release sequence), so a
  // response stamp below an invocation stamp means happens-before; pairs with itself.
  std::uint64_t stamp() noexcept { return now_.fetch_add(1, std::memory_order_acq_rel); }

 private:
  std::atomic<std::uint64_t> now_{1};
};

// How long a thread at the start gate spins before it yields (on a busy machine a yield hands
// the core away for a whole time slice).
constexpr auto kSpinBeforeYield = 100us;
constexpr unsigned kMaxPause = 1024;  // busy-wait steps: up to a microsecond or so

void busy_wait(unsigned steps) {
  for (unsigned i = 0; i < steps; ++i) {
    // Compiler-only barrier: keeps the empty loop from being optimised away.
    asm volatile("" ::: "memory");
  }
}

// Puts the calling thread on the index-th CPU (round robin) of those it may run on. Woken by
// the barrier, an unpinned thread tends to be queued on the CPU of the thread that woke it,
// behind it, and the history then runs one thread at a time: on a loaded 2-core machine,
// under 1% of two unpinned threads' operations overlapped one of the other's, against 30-40%
// pinned. Best effort: Linux only, and a failure leaves the thread where it was.
void pin_to_cpu([[maybe_unused]] unsigned index) {
#ifdef __linux__
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  const int count = CPU_COUNT(&allowed);
  if (count <= 1) return;
  int wanted = static_cast<int>(index % static_cast<unsigned>(count));
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed) || wanted-- != 0) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    return;
  }
#endif
}

bool erase_if_rule(std::uint64_t value) { return value % 3 != 0; }

template <class Map>
void perform(Map& map, op& o) {
  switch (o.kind) {
    case op_kind::insert:
      o.ok = map.insert(o.key, o.arg);
      break;
    case op_kind::try_emplace:
      o.ok = map.try_emplace(o.key, o.arg);
      break;
    case op_kind::insert_or_assign:
      o.ok = map.insert_or_assign(o.key, o.arg);
      break;
    case op_kind::assign:
      o.ok = map.assign(o.key, o.arg);
      break;
    case op_kind::update:
      o.ok = map.update(o.key, [&o](const std::uint64_t& old) {
        o.seen = old;
        return o.arg;
      });
      break;
    case op_kind::erase:
      o.ok = map.erase(o.key);
      break;
    case op_kind::erase_if:
      o.ok = map.erase_if(o.key, [&o](const std::uint64_t& value) {
        o.seen = value;
        o.pred_said_yes = erase_if_rule(value);
        return o.pred_said_yes;
      });
      break;
    case op_kind::find: {
      const std::optional<std::uint64_t> found = map.find(o.key);
      o.ok = found.has_value();
      o.seen = found.value_or(kAbsent);
      break;
    }
    case op_kind::contains:
      o.ok = map.contains(o.key);
      break;
    case op_kind::visit:
      o.ok = map.visit(o.key, [&o](const std::uint64_t& value) { o.seen = value; });
      break;
    case op_kind::pinned_find: {
      const auto view = map.pin();
      const std::uint64_t* found = view.find(o.key);
      o.ok = found != nullptr;
      o.seen = found != nullptr ? *found : kAbsent;
      break;
    }
    case op_kind::pinned_contains: {
      const auto view = map.pin();
      o.ok = view.contains(o.key);
      break;
    }
    case op_kind::for_each:
      map.for_each([&o](const std::uint64_t& key, const std::uint64_t& value) {
        o.visited.emplace_back(key, value);
      });
      break;
    case op_kind::clear:
      map.clear();
      break;
    case op_kind::reserve:
      map.reserve(o.arg);
      break;
  }
}

// A random operation on a hot key. Writes take the writer's next unique value.
op random_hot_op(std::mt19937_64& rng, const run_config& config, unsigned writer,
                 std::uint64_t& sequence) {
  // Percent weights, in op_kind order up to pinned_contains; the rest is for_each() when
  // whole-map operations are on (a find() otherwise).
  static constexpr std::array<unsigned, 12> kWeights = {12, 8, 12, 9, 10, 11, 8, 9, 6, 5, 4, 3};
  op o;
  o.key = rng() % config.hot_keys;
  unsigned roll = static_cast<unsigned>(rng() % 100);
  o.kind = config.whole_map_ops ? op_kind::for_each : op_kind::find;
  for (std::size_t k = 0; k < kWeights.size(); ++k) {
    if (roll < kWeights[k]) {
      o.kind = static_cast<op_kind>(k);
      break;
    }
    roll -= kWeights[k];
  }
  if (o.kind <= op_kind::update) o.arg = value_of(writer, ++sequence);
  if (o.kind == op_kind::for_each) o.visited.reserve(64);
  return o;
}

// One thread's operations for one history.
std::vector<op> plan(const run_config& config, std::size_t index, unsigned t,
                     std::uint64_t& sequence) {
  std::mt19937_64 rng(config.seed * 0x9e3779b97f4a7c15ULL + index * 1000003 + t);
  std::vector<op> hot;
  for (unsigned i = 0; i < config.ops_per_thread; ++i) {
    hot.push_back(random_hot_op(rng, config, t, sequence));
  }
  if (config.whole_map_ops) {
    // One history in six has a clear(); one in four a reserve() of 8 to 47 elements (a grow
    // when the table is small) from the thread with the wave.
    if (index % 6 == 0 && t == (index / 6 + 1) % config.threads) {
      op o;
      o.kind = op_kind::clear;
      hot.insert(hot.begin() + static_cast<std::ptrdiff_t>(rng() % (hot.size() + 1)), o);
    }
    if (index % 4 == 1 && t == index % config.threads) {
      op o;
      o.kind = op_kind::reserve;
      o.arg = 8 + rng() % 40;
      hot.insert(hot.begin() + static_cast<std::ptrdiff_t>(rng() % (hot.size() + 1)), o);
    }
  }
  for (op& o : hot) o.pause = rng() % 2 == 0 ? 0 : static_cast<unsigned>(rng() % kMaxPause);
  if (t != index % config.threads || config.wave_keys == 0) return hot;

  // The wave: insert every wave key, then erase every one, in random orders, merged at random
  // into the hot-key operations.
  std::vector<op> wave;
  std::vector<std::uint64_t> keys;
  for (unsigned i = 0; i < config.wave_keys; ++i) keys.push_back(kFirstWaveKey + i);
  std::shuffle(keys.begin(), keys.end(), rng);
  for (std::uint64_t key : keys) {
    op o;
    o.kind =
        std::array{op_kind::insert, op_kind::try_emplace, op_kind::insert_or_assign}[rng() % 3];
    o.key = key;
    o.arg = value_of(t, ++sequence);
    wave.push_back(o);
  }
  std::shuffle(keys.begin(), keys.end(), rng);
  for (std::uint64_t key : keys) {
    op o;
    o.kind = rng() % 4 == 0 ? op_kind::erase_if : op_kind::erase;
    o.key = key;
    wave.push_back(o);
  }
  std::vector<op> merged;
  merged.reserve(hot.size() + wave.size());
  std::size_t h = 0;
  std::size_t w = 0;
  while (h < hot.size() || w < wave.size()) {
    const std::size_t left = (hot.size() - h) + (wave.size() - w);
    if (rng() % left < wave.size() - w) {
      merged.push_back(std::move(wave[w++]));
    } else {
      merged.push_back(std::move(hot[h++]));
    }
  }
  return merged;
}

// Runs config.histories histories on `map` (which must start empty), checking each as soon as
// every thread has finished it; stops at the first one that is not linearizable.
template <class Map>
run_summary record_and_check(Map& map, const run_config& config) {
  run_summary summary;
  const auto started = std::chrono::steady_clock::now();
  stamp_clock clock;

  history current;
  for (unsigned k = 0; k < config.hot_keys; ++k) current.keys.push_back(k);
  for (unsigned k = 0; k < config.wave_keys; ++k) current.keys.push_back(kFirstWaveKey + k);
  for (unsigned t = 0; t < config.threads; ++t) {
    current.threads.push_back(thread_log{"thread " + std::to_string(t), {}});
  }
  current.threads.push_back(thread_log{"end-of-history reads (no operation in flight)", {}});
  thread_log& probes = current.threads.back();

  // Written only by the barrier's completion, which happens-before every thread's return
  // from arrive_and_wait(): no atomics needed.
  std::size_t index = 0;
  bool stop = config.histories == 0;
  std::atomic<std::uint64_t> running{0};  // threads that started a history, summed over all
  const unsigned together =
      std::min(config.threads, std::max(2u, std::thread::hardware_concurrency()));
  grace::hash_map_stats before = map.stats();

  auto end_of_history = [&]() noexcept {
    for (std::uint64_t key : current.keys) {
      op o;
      o.kind = op_kind::find;
      o.key = key;
      o.invoked = clock.stamp();
      perform(map, o);
      o.returned = clock.stamp();
      probes.ops.push_back(o);
    }
    const verdict v = check(current);
    // size() and empty() are exact only with no update in flight (hash_map.h), as here.
    std::size_t present = 0;
    for (const op& o : probes.ops) present += o.ok;
    const std::size_t size = map.size();
    const bool empty = map.empty();
    ++summary.histories;
    summary.ops += v.ops;
    summary.key_histories += v.key_histories;
    summary.configurations += v.configurations;
    summary.overlapping_ops += overlapping_ops(current);
    const grace::hash_map_stats after = map.stats();
    summary.histories_with_grow += after.grows > before.grows;
    summary.histories_with_shrink += after.shrinks > before.shrinks;
    before = after;
    if (!v.linearizable) {
      summary.failure = "History " + std::to_string(index) + " of " +
                        std::to_string(config.histories) + ". " + v.report;
      stop = true;
    } else if (size != present || empty != (present == 0)) {
      summary.failure = "After history " + std::to_string(index) + ", with no update in flight, " +
                        "size() is " + std::to_string(size) + " and empty() " + bool_text(empty) +
                        " but the reads found " + std::to_string(present) + " keys.\n" +
                        history_text(current);
      stop = true;
    }
    current.initial.clear();
    for (const op& o : probes.ops) current.initial[o.key] = o.seen;
    for (thread_log& t : current.threads) t.ops.clear();
    if (++index == config.histories) stop = true;
  };

  {
    gt::watchdog dog(kNoDeadlock, "recording linearizability histories");
    std::barrier sync(static_cast<std::ptrdiff_t>(config.threads), end_of_history);
    gt::run_threads(config.threads, [&](unsigned t) {
      pin_to_cpu(t);
      std::uint64_t sequence = 0;
      std::vector<op>& log = current.threads[t].ops;
      while (!stop) {
        log = plan(config, index, t, sequence);
        // The barrier's waiters wake one by one, each through the scheduler, which takes longer
        // than a whole history: wait here until as many threads run as there are cores (more
        // cannot run at once), so that they overlap.
        // Relaxed: a timing gate only; the barrier orders everything the checker reads.
        running.fetch_add(1, std::memory_order_relaxed);
        const std::uint64_t quorum = std::uint64_t{config.threads} * index + together;
        const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeYield;
        // Relaxed: as above.
        for (unsigned spins = 1; running.load(std::memory_order_relaxed) < quorum; ++spins) {
          if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) {
            std::this_thread::yield();
          }
        }
        for (op& o : log) {
          busy_wait(o.pause);
          o.invoked = clock.stamp();
          perform(map, o);
          o.returned = clock.stamp();
        }
        sync.arrive_and_wait();
      }
    });
  }
  const grace::hash_map_stats end = map.stats();
  summary.grows = end.grows;
  summary.shrinks = end.shrinks;
  summary.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return summary;
}

// Tiny tables: a wave of a dozen keys grows the table to 32 buckets, and erasing them shrinks
// it again (to 1 bucket when every key is gone).
grace::hash_map_options tiny_table() {
  grace::hash_map_options options;
  options.initial_buckets = 1;
  options.min_buckets = 1;
  options.max_buckets = 1024;
  options.grow_load_factor = 0.5;
  options.shrink_load_factor = 0.24;
  return options;
}

void print_summary(const char* what, const run_summary& s) {
  std::printf(
      "[ histories ] %s: %zu histories, %zu operations (%zu overlapping another thread's), "
      "%zu per-key sub-histories, %llu configurations explored; "
      "grows in %zu histories, shrinks in %zu (%llu grows, %llu shrinks); %.2f s\n",
      what, s.histories, s.ops, s.overlapping_ops, s.key_histories,
      static_cast<unsigned long long>(s.configurations), s.histories_with_grow,
      s.histories_with_shrink, static_cast<unsigned long long>(s.grows),
      static_cast<unsigned long long>(s.shrinks), s.seconds);
  std::fflush(stdout);
}

void expect_linearizable_with_resizes(const run_config& config, const run_summary& s) {
  EXPECT_TRUE(s.failure.empty()) << s.failure;
  EXPECT_EQ(s.histories, config.histories);
  // The table really changed size while histories ran (only operations inside histories
  // resize it), so the run did not pass by missing the resize windows.
  EXPECT_GT(s.histories_with_grow, 0u);
  EXPECT_GT(s.histories_with_shrink, 0u);
  // Some operations really ran concurrently with another thread's.
  EXPECT_GT(s.overlapping_ops, 0u);
}

// =============================================================================================
// The checker on hand-built histories: it rejects what it must and accepts what it must.

op make_op(op_kind kind, std::uint64_t key, std::uint64_t arg, std::uint64_t invoked,
           std::uint64_t returned, bool ok, std::uint64_t seen = kAbsent) {
  op o;
  o.kind = kind;
  o.key = key;
  o.arg = arg;
  o.invoked = invoked;
  o.returned = returned;
  o.ok = ok;
  o.seen = seen;
  return o;
}
op read_op(std::uint64_t key, std::uint64_t invoked, std::uint64_t returned, std::uint64_t value) {
  return make_op(op_kind::find, key, 0, invoked, returned, value != kAbsent, value);
}

history hand_built(std::vector<std::vector<op>> threads,
                   std::unordered_map<std::uint64_t, std::uint64_t> initial = {}) {
  history h;
  h.initial = std::move(initial);
  for (std::size_t t = 0; t < threads.size(); ++t) {
    for (const op& o : threads[t]) {
      if (o.kind != op_kind::for_each && o.kind != op_kind::clear &&
          std::find(h.keys.begin(), h.keys.end(), o.key) == h.keys.end()) {
        h.keys.push_back(o.key);
      }
    }
    h.threads.push_back(thread_log{"thread " + std::to_string(t), std::move(threads[t])});
  }
  return h;
}

TEST(HashMapLinearizabilityChecker, RejectsAReadOfAValueNeverWritten) {
  const history h = hand_built({
      {make_op(op_kind::insert, 1, 10, 1, 2, true)},
      {read_op(1, 3, 4, 11)},
  });
  const verdict v = check(h);
  EXPECT_FALSE(v.linearizable);
  EXPECT_NE(v.report.find("key k1"), std::string::npos) << v.report;
}

TEST(HashMapLinearizabilityChecker, RejectsAStaleReadAfterACompletedOverwriteButNotADuringOne) {
  std::vector<op> writer = {make_op(op_kind::insert, 1, 10, 1, 2, true),
                            make_op(op_kind::insert_or_assign, 1, 11, 3, 6, false)};
  const verdict stale = check(hand_built({writer, {read_op(1, 7, 8, 10)}}));
  EXPECT_FALSE(stale.linearizable);
  // The same read overlapping the overwrite may take effect before it.
  const verdict overlapping = check(hand_built({writer, {read_op(1, 5, 8, 10)}}));
  EXPECT_TRUE(overlapping.linearizable) << overlapping.report;
}

TEST(HashMapLinearizabilityChecker, RejectsTwoSuccessfulInsertsOfOneKeyWithNoEraseBetween) {
  const verdict v = check(hand_built({
      {make_op(op_kind::insert, 1, 10, 1, 4, true)},
      {make_op(op_kind::try_emplace, 1, 11, 2, 3, true)},
  }));
  EXPECT_FALSE(v.linearizable);
}

TEST(HashMapLinearizabilityChecker, RejectsALostUpdateOfTwoUpdatesThatSawTheSameOldValue) {
  const std::unordered_map<std::uint64_t, std::uint64_t> initial = {{1, 10}};
  const verdict lost = check(hand_built({{make_op(op_kind::update, 1, 11, 1, 5, true, 10)},
                                         {make_op(op_kind::update, 1, 12, 2, 6, true, 10)}},
                                        initial));
  EXPECT_FALSE(lost.linearizable);
  const verdict chained = check(hand_built({{make_op(op_kind::update, 1, 11, 1, 5, true, 10)},
                                            {make_op(op_kind::update, 1, 12, 2, 6, true, 11)}},
                                           initial));
  EXPECT_TRUE(chained.linearizable) << chained.report;
}

TEST(HashMapLinearizabilityChecker, RejectsAnEraseIfWhosePredicateSawAValueTheKeyNeverHeldThen) {
  // pred saw v10 and said no, but v11 had replaced v10 before erase_if() was called.
  const verdict v = check(hand_built({
      {make_op(op_kind::insert, 1, 10, 1, 2, true), make_op(op_kind::assign, 1, 11, 3, 4, true)},
      {[] {
        op o = make_op(op_kind::erase_if, 1, 0, 5, 6, false, 10);
        o.pred_said_yes = false;
        return o;
      }()},
  }));
  EXPECT_FALSE(v.linearizable);
}

TEST(HashMapLinearizabilityChecker, RejectsAForEachThatVisitedOneElementTwiceOrMissedAStableKey) {
  const std::unordered_map<std::uint64_t, std::uint64_t> initial = {{1, 10}, {2, 20}};
  op twice = make_op(op_kind::for_each, 0, 0, 1, 2, false);
  twice.visited = {{1, 10}, {2, 20}, {1, 10}};
  EXPECT_FALSE(check(hand_built({{read_op(1, 3, 4, 10), twice}}, initial)).linearizable);
  op missed = make_op(op_kind::for_each, 0, 0, 1, 2, false);
  missed.visited = {{1, 10}};
  EXPECT_FALSE(check(hand_built({{read_op(1, 3, 4, 10), read_op(2, 5, 6, 20), missed}}, initial))
                   .linearizable);
  op exact = make_op(op_kind::for_each, 0, 0, 1, 2, false);
  exact.visited = {{2, 20}, {1, 10}};
  const verdict v =
      check(hand_built({{read_op(1, 3, 4, 10), read_op(2, 5, 6, 20), exact}}, initial));
  EXPECT_TRUE(v.linearizable) << v.report;
}

// A walk may see a key's old element, and then the element inserted after the key was erased
// behind it (equal hashes): two reads, in visiting order.
TEST(HashMapLinearizabilityChecker, AcceptsAForEachThatSawTwoElementsOfAKeyOnlyInWriteOrder) {
  const std::unordered_map<std::uint64_t, std::uint64_t> initial = {{1, 10}};
  const std::vector<op> writer = {make_op(op_kind::erase, 1, 0, 2, 3, true),
                                  make_op(op_kind::insert, 1, 11, 4, 5, true)};
  op in_order = make_op(op_kind::for_each, 0, 0, 1, 10, false);
  in_order.visited = {{1, 10}, {1, 11}};
  const verdict v = check(hand_built({{in_order}, writer}, initial));
  EXPECT_TRUE(v.linearizable) << v.report;
  op reversed = make_op(op_kind::for_each, 0, 0, 1, 10, false);
  reversed.visited = {{1, 11}, {1, 10}};
  EXPECT_FALSE(check(hand_built({{reversed}, writer}, initial)).linearizable);
}

TEST(HashMapLinearizabilityChecker, RejectsAClearThatKeptAKeyNoUpdateRacedWith) {
  const std::unordered_map<std::uint64_t, std::uint64_t> initial = {{1, 10}};
  const op clear = make_op(op_kind::clear, 0, 0, 1, 4, false);
  const verdict kept = check(hand_built({{clear}, {read_op(1, 5, 6, 10)}}, initial));
  EXPECT_FALSE(kept.linearizable);
  // An assign() that replaced v10 while clear() ran may leave its value behind.
  const verdict raced = check(hand_built(
      {{clear}, {make_op(op_kind::assign, 1, 11, 2, 3, true), read_op(1, 5, 6, 11)}}, initial));
  EXPECT_TRUE(raced.linearizable) << raced.report;
}

// clear() erased v10, an insert put v11 back while it ran, and clear() erased that too (equal
// hashes put the new element ahead of the walk). Two erasures need an update between them.
TEST(HashMapLinearizabilityChecker, AcceptsAClearThatErasedAKeyAgainOnlyAfterAnInsertOverlappedIt) {
  const std::unordered_map<std::uint64_t, std::uint64_t> initial = {{1, 10}};
  const op clear = make_op(op_kind::clear, 0, 0, 1, 10, false);
  const verdict twice =
      check(hand_built({{clear, read_op(1, 11, 12, kAbsent)},
                        {make_op(op_kind::insert, 1, 11, 3, 4, true), read_op(1, 5, 6, 11)}},
                       initial));
  EXPECT_TRUE(twice.linearizable) << twice.report;
  // Without the insert, v10 cannot come back after clear() erased it.
  const verdict back = check(hand_built(
      {{clear, read_op(1, 11, 12, kAbsent)}, {read_op(1, 2, 3, kAbsent), read_op(1, 5, 6, 10)}},
      initial));
  EXPECT_FALSE(back.linearizable);
}

// Every operation overlaps another, and the orders the invocations suggest fail: the
// insert must take effect after a read that was invoked later, the insert_or_assign after
// an assign invoked later, the update between two reads of another thread. Key k2's
// operations interleave with k1's and are checked on their own.
TEST(HashMapLinearizabilityChecker, AcceptsAnOverlappingHistoryThatOnlyBacktrackingLinearizes) {
  op update = make_op(op_kind::update, 1, 12, 6, 14, true, 11);
  op erase_if = make_op(op_kind::erase_if, 1, 0, 7, 16, true, 12);
  erase_if.pred_said_yes = true;
  op visit = make_op(op_kind::visit, 2, 0, 9, 10, true, 20);
  const history h = hand_built({
      {make_op(op_kind::insert, 1, 11, 1, 10, true), read_op(1, 11, 12, 11),
       read_op(1, 21, 22, 13)},
      {read_op(1, 2, 3, kAbsent), read_op(1, 4, 5, 11), erase_if},
      {make_op(op_kind::insert, 2, 20, 3, 8, true), update,
       make_op(op_kind::assign, 1, 14, 18, 19, false)},
      {visit, make_op(op_kind::contains, 1, 0, 13, 15, true),
       make_op(op_kind::insert_or_assign, 1, 13, 17, 20, true)},
  });
  const verdict v = check(h);
  EXPECT_TRUE(v.linearizable) << v.report;
  EXPECT_EQ(v.key_histories, 2u);
  EXPECT_EQ(v.ops, 12u);
}

TEST(HashMapLinearizabilityChecker, ReportShowsTheKeyAndEveryThreadsOperationsWithTimes) {
  const verdict v = check(hand_built({
      {make_op(op_kind::insert, 1, 10, 1, 2, true),
       make_op(op_kind::insert_or_assign, 1, 11, 3, 4, false)},
      {make_op(op_kind::insert, 2, 20, 1, 2, true), read_op(1, 5, 6, 10)},
  }));
  ASSERT_FALSE(v.linearizable);
  for (const char* expected :
       {"Not linearizable: key k1 (initially absent)", "longest linearizable prefix is 2",
        "thread 0:", "thread 1:", "[       3,        4] insert_or_assign(k1, v11) -> false",
        "[       5,        6] find(k1) -> v10", "insert(k2, v20) -> true"}) {
    EXPECT_NE(v.report.find(expected), std::string::npos) << "no \"" << expected << "\" in:\n"
                                                          << v.report;
  }
}

// =============================================================================================
// Recorded histories of the real map.

TEST(HashMapLinearizability, EveryRecordedHistoryOfTwoThreadsOnTwoKeysIsLinearizable) {
  run_config config;
  config.threads = 2;
  config.hot_keys = 2;
  config.ops_per_thread = 16;
  config.wave_keys = 10;
  config.histories = gt::iterations(3000, 2000);
  config.seed = 2;
  grace::hash_map<std::uint64_t, std::uint64_t> map(tiny_table());
  const run_summary s = record_and_check(map, config);
  print_summary("2 threads", s);
  expect_linearizable_with_resizes(config, s);
}

TEST(HashMapLinearizability, EveryRecordedHistoryOfFourThreadsIsLinearizable) {
  run_config config;
  config.threads = 4;
  config.hot_keys = 4;
  config.ops_per_thread = 12;
  config.wave_keys = 12;
  config.histories = gt::iterations(3000, 2000);
  config.seed = 4;
  grace::hash_map<std::uint64_t, std::uint64_t> map(tiny_table());
  const run_summary s = record_and_check(map, config);
  print_summary("4 threads", s);
  expect_linearizable_with_resizes(config, s);
}

// Two hash values for every key: long runs of equal split-order keys, told apart by
// KeyEqual only.
struct parity_hash {
  std::size_t operator()(std::uint64_t key) const noexcept { return key % 2; }
};

TEST(HashMapLinearizability, EveryRecordedHistoryOnKeysWithEqualHashesIsLinearizable) {
  run_config config;
  config.threads = 3;
  config.hot_keys = 3;
  config.ops_per_thread = 14;
  config.wave_keys = 10;
  config.histories = gt::iterations(2000, 1000);
  config.seed = 3;
  grace::hash_map<std::uint64_t, std::uint64_t, parity_hash> map(tiny_table());
  const run_summary s = record_and_check(map, config);
  print_summary("equal hashes", s);
  expect_linearizable_with_resizes(config, s);
}

// The recording and checking together catch a real atomicity bug: insert_or_assign() done as
// erase() then insert() leaves a window in which the key is absent, and lets a racing insert
// win so that its own write is lost.
class map_with_split_insert_or_assign : public grace::hash_map<std::uint64_t, std::uint64_t> {
 public:
  using grace::hash_map<std::uint64_t, std::uint64_t>::hash_map;

  bool insert_or_assign(const std::uint64_t& key, std::uint64_t value) {
    const bool replaced = erase(key);
    std::this_thread::sleep_for(50us);  // widens the window; the bug is there without it
    insert(key, value);
    return !replaced;
  }
};

TEST(HashMapLinearizability, RecordedHistoriesCatchAnInsertOrAssignSplitIntoEraseAndInsert) {
  run_config config;
  config.threads = 2;
  config.hot_keys = 1;
  config.ops_per_thread = 16;
  config.wave_keys = 0;
  config.whole_map_ops = false;
  config.histories = 500;  // stops at the first rejected history
  config.seed = 5;
  map_with_split_insert_or_assign map(tiny_table());
  const run_summary s = record_and_check(map, config);
  print_summary("split insert_or_assign", s);
  ASSERT_FALSE(s.failure.empty()) << "no history of the broken map was rejected";
  EXPECT_NE(s.failure.find("insert_or_assign"), std::string::npos) << s.failure;
  std::printf("The checker's report on the broken map:\n%s", s.failure.c_str());
}

}  // namespace
