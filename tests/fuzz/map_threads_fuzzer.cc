// libFuzzer target: 2 or 3 threads run operations from the input on one grace::hash_map at
// once; every value returned is checked to be one that some thread could have produced,
// and the final content against what the threads' models imply.
//
// Keys: each thread owns 16 keys that only it writes, and 16 keys are shared by all.
//   - Owned keys are checked exactly against the owner's model. Only clear() (any thread's)
//     can change them behind the owner's back: a clear that may have run since the owner
//     last looked turns "present with v" into "absent or v" until the owner looks again.
//   - Every value carries (key, writer, serial) (map_fuzzing.h), so a value read anywhere
//     must belong to its key, come from a thread that had already announced that serial,
//     be the reader's own latest write if the reader wrote it, and never be older than a
//     value of the same writer the reader saw before for that key (linearizability).
//   - for_each, and the whole-map erase_if(pred), pass each owned key of the iterating
//     thread at most once, with the model's value (exactly once if present and no clear ran
//     meanwhile, unless the for_each stopped early); the whole-map erase_if erases only
//     keys its pred approved (never another thread's owned keys), all of this thread's
//     unless a clear raced with it. A for_each whose f returns false is never called again.
//   - An rvalue key that insert or try_emplace did not insert comes back unchanged, also when
//     a racing insert of a shared key won.
//   - bucket_count() stays a power of two within the options' bounds.
//   - After the join: for_each visits every key once; an owned key holds what its model
//     says; a shared key holds the last value some thread wrote to it, or is absent only if
//     a thread erased it or a clear ran; size() matches, and load_factor() is size() over
//     bucket_count().
//
// Input: the two header bytes of map_fuzzing.h (byte 0 bit 4: three threads instead of
// two), then one operation per two bytes, [op][key], dealt to the threads in turn:
//   op  % kOpCount: the operation; op / kOpCount: its argument (0-13)
//   key & 31:       slots 0-15 the thread's own keys, 16-31 the shared keys
//   key >> 5:       spin 4^n iterations first (n = 7: yield), to shift the interleaving
// The argument, where an operation reads it: as in map_model_fuzzer.cc (insert, try_emplace
// and insert_or_assign: bit 0 moves the key in; contains: bit 0 asks count(); erase_if:
// bit 0 is pred's answer, from gf::kWholeMapArg up the whole map instead; for_each: n > 0
// stops at the n-th element; pin: how long it holds), and reserve and the range operations
// size themselves with it.
//
// Replay a crash: build/fuzz/tests/fuzz/map_threads_fuzzer crash-<sha1> (runs are not
// deterministic: a replay may need -runs=1000).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "grace/map/hash_map.h"
#include "tests/fuzz/map_fuzzing.h"

namespace {

namespace gf = grace::fuzzing;

constexpr unsigned kMaxThreads = 3;
constexpr std::size_t kOwned = 16;  // keys per thread
constexpr std::size_t kShared = 16;
constexpr std::size_t kSharedBase = kMaxThreads * kOwned;
constexpr std::size_t kKeys = kSharedBase + kShared;

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
  bucket_count,
  insert_range,
  erase_range,
  kCount
};
constexpr unsigned kOpCount = static_cast<unsigned>(op::kCount);
static_assert(static_cast<unsigned>(op::erase_if) + kOpCount * gf::kWholeMapArg <= 255,
              "an op byte must be able to ask for the whole-map erase_if");

struct record {
  op o;
  unsigned arg;
  unsigned slot;   // 0-15 own keys, 16-31 shared keys
  unsigned delay;  // spin 4^delay iterations first; 7: yield
};

// What the threads share besides the map.
struct shared_state {
  unsigned threads = 0;
  grace::hash_map_options options;  // the map's
  // The highest serial each thread may have written so far.
  std::atomic<std::uint64_t> announced[kMaxThreads]{};
  // clear() calls begun and ended (see worker::begin_op()).
  std::atomic<std::uint64_t> clears_started{0};
  std::atomic<std::uint64_t> clears_finished{0};
  std::atomic<unsigned> arrived{0};  // start barrier
};

// The owner's model of one owned key: `value` (nullopt: absent), or, if maybe_gone, either
// that or absent (a clear may have erased it).
struct owned_state {
  std::optional<std::uint64_t> value;
  bool maybe_gone = false;
};

template <class Key, class Value>
class worker {
 public:
  using map_type = grace::hash_map<Key, Value, gf::index_hash>;
  using keys = gf::key_codec<Key>;
  using values = gf::value_codec<Value>;

  worker(map_type& map, shared_state& shared, unsigned id)
      : map_(map), shared_(shared), id_(id) {}

  void add(const record& r) { records_.push_back(r); }

  void run() {
    // Relaxed: the start barrier only lines the threads up in time; starting a thread
    // already orders the map's construction before everything it does.
    shared_.arrived.fetch_add(1, std::memory_order_relaxed);
    while (shared_.arrived.load(std::memory_order_relaxed) < shared_.threads) {
      std::this_thread::yield();
    }
    for (op_ = 0; op_ < records_.size(); ++op_) {
      const record& r = records_[op_];
      spin(r.delay);
      apply(r);
      if (held_ && --held_->ops_left == 0) release_pin();
    }
    if (held_) release_pin();
  }

  // After the join: takes in the clears that ran after this thread's last look.
  void settle() { begin_op(); }
  const owned_state& owned(std::size_t j) const { return owned_[j]; }
  const std::optional<std::uint64_t>& last_shared_write(std::size_t j) const {
    return last_shared_write_[j];
  }
  bool erased_shared(std::size_t j) const { return erased_shared_[j]; }

 private:
  static void spin(unsigned delay) {
    if (delay == 0) return;
    if (delay == 7) {
      std::this_thread::yield();
      return;
    }
    volatile unsigned sink = 0;
    for (unsigned i = 0; i < (1u << (2 * delay)); ++i) sink = sink + 1;
  }

  std::size_t own_index(std::size_t j) const { return id_ * kOwned + j; }

  std::uint64_t fresh_code(std::size_t index) {
    ++serial_;
    // Relaxed: a reader that sees the value this serial goes into got it through the map's
    // Release CAS (M1) and Acquire load (M2), which order this store before its check.
    shared_.announced[id_].store(serial_, std::memory_order_relaxed);
    return gf::value_code(index, id_, serial_);
  }

  // A clear() may change this thread's owned keys. Before an operation: if a clear began
  // since the last look, any owned key may have been erased. After it: the operation was
  // "loose" (a clear may have run during it) unless every clear begun by then had ended
  // before it started.
  std::uint64_t begin_op() {
    // Acquire: every clear counted here has ended, erases included; pairs with the Release
    // increment in clear_all().
    const std::uint64_t finished = shared_.clears_finished.load(std::memory_order_acquire);
    // Relaxed: at least `finished` (each clear begins before it ends, and the Acquire load
    // above orders that before this one).
    const std::uint64_t started = shared_.clears_started.load(std::memory_order_relaxed);
    if (started != seen_started_) {
      for (owned_state& s : owned_) s.maybe_gone = s.value.has_value();
      seen_started_ = started;
    }
    return finished;
  }
  bool end_op(std::uint64_t finished_before) const {
    // Relaxed: a clear whose erase this operation saw incremented this before that erase's
    // Release CAS (M1), which the operation's Acquire loads (M2) observed.
    return shared_.clears_started.load(std::memory_order_relaxed) != finished_before;
  }

  // Checks a value read for key `index` (see the file comment) and returns its code.
  std::uint64_t observe(const char* what, std::size_t index, const Value& value) {
    const std::optional<std::uint64_t> code = values::read(value);
    GRACE_FUZZ_CHECK(code.has_value(), "thread %u op %zu: %s(%zu) read a malformed value", id_,
                     op_, what, index);
    const unsigned writer = gf::thread_of_code(*code);
    const std::uint64_t serial = gf::serial_of_code(*code);
    GRACE_FUZZ_CHECK(gf::index_of_code(*code) == index && writer < shared_.threads,
                     "thread %u op %zu: %s(%zu) read %#llx, a value of key %zu by thread %u",
                     id_, op_, what, index, static_cast<unsigned long long>(*code),
                     gf::index_of_code(*code), writer);
    // Relaxed: see fresh_code().
    const std::uint64_t announced = shared_.announced[writer].load(std::memory_order_relaxed);
    GRACE_FUZZ_CHECK(serial >= 1 && serial <= announced,
                     "thread %u op %zu: %s(%zu) read serial %llu of thread %u, which announced "
                     "only %llu",
                     id_, op_, what, index, static_cast<unsigned long long>(serial), writer,
                     static_cast<unsigned long long>(announced));
    if (index < kSharedBase) {
      GRACE_FUZZ_CHECK(writer == index / kOwned,
                       "thread %u op %zu: %s(%zu) read a value by thread %u, not the owner",
                       id_, op_, what, index, writer);
    } else if (writer == id_) {
      const std::optional<std::uint64_t>& mine = last_shared_write_[index - kSharedBase];
      GRACE_FUZZ_CHECK(mine && *mine == *code,
                       "thread %u op %zu: %s(%zu) read its own serial %llu, not its latest "
                       "write",
                       id_, op_, what, index, static_cast<unsigned long long>(serial));
    }
    std::uint64_t& seen = seen_[index][writer];
    GRACE_FUZZ_CHECK(serial >= seen,
                     "thread %u op %zu: %s(%zu) read serial %llu of thread %u after %llu",
                     id_, op_, what, index, static_cast<unsigned long long>(serial), writer,
                     static_cast<unsigned long long>(seen));
    seen = serial;
    return *code;
  }

  // --- owned keys: the model's expectations ---------------------------------------------------

  // The key held `code` (nullopt: it was absent) at the operation's linearization point.
  void expect_owned(const char* what, std::size_t j, bool loose,
                    std::optional<std::uint64_t> code) const {
    const owned_state& s = owned_[j];
    if (code) {
      GRACE_FUZZ_CHECK(s.value && *s.value == *code,
                       "thread %u op %zu: %s(%zu) read %#llx, model %#llx", id_, op_, what,
                       own_index(j), static_cast<unsigned long long>(*code),
                       static_cast<unsigned long long>(s.value.value_or(0)));
    } else {
      GRACE_FUZZ_CHECK(!s.value || s.maybe_gone || loose,
                       "thread %u op %zu: %s(%zu) found it absent, model %#llx", id_, op_, what,
                       own_index(j), static_cast<unsigned long long>(*s.value));
    }
  }
  void expect_present(const char* what, std::size_t j, bool loose, bool present) const {
    const owned_state& s = owned_[j];
    if (present) {
      GRACE_FUZZ_CHECK(s.value.has_value(), "thread %u op %zu: %s(%zu) found it, model: absent",
                       id_, op_, what, own_index(j));
    } else {
      expect_owned(what, j, loose, std::nullopt);
    }
  }
  // After an operation that saw the key present: a clear during it may have erased it since.
  void now_present(std::size_t j, std::uint64_t code, bool loose) {
    owned_[j] = owned_state{code, loose};
  }
  // Absent stays absent: only this thread inserts its keys.
  void now_absent(std::size_t j) { owned_[j] = owned_state{}; }

  void apply(const record& r) {
    if (r.o == op::reserve) {
      map_.reserve(r.slot * 64 + r.arg * 4);
      return;
    }
    if (r.o == op::clear) {
      clear_all();
      return;
    }
    if (r.o == op::for_each) {
      iterate(r.arg);
      return;
    }
    if (r.o == op::erase_if && r.arg >= gf::kWholeMapArg) {
      erase_matching(r.slot < kOwned ? own_index(r.slot) : kSharedBase + r.slot - kOwned, r.arg);
      return;
    }
    if (r.o == op::bucket_count) {
      const std::size_t buckets = map_.bucket_count();
      GRACE_FUZZ_CHECK(gf::buckets_in_bounds(buckets, shared_.options),
                       "thread %u op %zu: bucket_count() %zu", id_, op_, buckets);
      return;
    }
    if (r.o == op::insert_range || r.o == op::erase_range) {
      const std::size_t count = 4 * (r.arg % 4 + 1);
      for (std::size_t i = 0; i < count; ++i) {
        apply_owned(r.o == op::insert_range ? op::insert : op::erase, 0, (r.slot + i) % kOwned);
      }
      return;
    }
    if (r.slot < kOwned) {
      apply_owned(r.o, r.arg, r.slot);
    } else {
      apply_shared(r.o, r.arg, r.slot - kOwned);
    }
  }

  void apply_owned(op o, unsigned arg, std::size_t j) {
    const std::size_t index = own_index(j);
    const Key key = keys::make(index);
    const std::uint64_t finished = begin_op();
    switch (o) {
      case op::find: {
        const std::optional<Value> found = map_.find(key);
        std::optional<std::uint64_t> code;
        if (found) code = observe("find", index, *found);
        const bool loose = end_op(finished);
        expect_owned("find", j, loose, code);
        if (code) {
          now_present(j, *code, loose);
        } else {
          now_absent(j);
        }
        break;
      }
      case op::contains: {
        const bool present = contains(key, index, arg);
        const bool loose = end_op(finished);
        expect_present("contains", j, loose, present);
        if (present) {
          now_present(j, *owned_[j].value, loose);
        } else {
          now_absent(j);
        }
        break;
      }
      case op::visit: {
        int calls = 0;
        std::uint64_t code = 0;
        const bool visited = map_.visit(key, [&](const Value& v) {
          ++calls;
          code = observe("visit", index, v);
        });
        const bool loose = end_op(finished);
        GRACE_FUZZ_CHECK(calls == (visited ? 1 : 0), "thread %u op %zu: visit called f %d times",
                         id_, op_, calls);
        expect_owned("visit", j, loose,
                     visited ? std::optional<std::uint64_t>(code) : std::nullopt);
        if (visited) {
          now_present(j, code, loose);
        } else {
          now_absent(j);
        }
        break;
      }
      case op::pin:
        pin(key, index, arg);
        if (held_ && held_->pinned_at == op_) {  // a new pin: what it read is the model's
          const bool loose = end_op(finished);
          if (held_->element != nullptr) {
            expect_owned("pin().find", j, loose, held_->code);
            now_present(j, held_->code, loose);
          } else {
            expect_owned("pin().find", j, loose, std::nullopt);
            now_absent(j);
          }
        }
        break;
      case op::insert:
      case op::try_emplace: {
        const std::uint64_t code = fresh_code(index);
        const bool inserted = insert(o, arg, key, index, code);
        const bool loose = end_op(finished);
        expect_present("!insert", j, loose, !inserted);
        if (inserted) {
          now_present(j, code, loose);
        } else {
          owned_[j].maybe_gone = loose;
        }
        break;
      }
      case op::insert_or_assign: {
        const std::uint64_t code = fresh_code(index);
        const bool inserted = insert(o, arg, key, index, code);
        const bool loose = end_op(finished);
        expect_present("!insert_or_assign", j, loose, !inserted);
        now_present(j, code, loose);
        break;
      }
      case op::assign: {
        const std::uint64_t code = fresh_code(index);
        const bool assigned = map_.assign(key, values::make(code));
        const bool loose = end_op(finished);
        expect_present("assign", j, loose, assigned);
        if (assigned) {
          now_present(j, code, loose);
        } else {
          now_absent(j);
        }
        break;
      }
      case op::update: {
        const std::uint64_t code = fresh_code(index);
        int calls = 0;
        const bool updated = map_.update(key, [&](const Value& old) {
          ++calls;
          expect_owned("update", j, true, observe("update", index, old));
          return values::make(code);
        });
        const bool loose = end_op(finished);
        // f runs again when its replacement loses a race, also to an insert next to the key.
        expect_present("update", j, loose, updated);
        GRACE_FUZZ_CHECK(updated || calls == 0 || loose,
                         "thread %u op %zu: update(%zu) called f, then found the key gone", id_,
                         op_, index);
        if (updated) {
          now_present(j, code, loose);
        } else {
          now_absent(j);
        }
        break;
      }
      case op::insert_or_update: {
        const std::uint64_t inserted_code = fresh_code(index);
        const std::uint64_t updated_code = fresh_code(index);
        const auto [inserted, calls] = gf::insert_or_update_counted(
            map_, key, inserted_code, updated_code, [&](const Value& old) {
              expect_owned("insert_or_update", j, true, observe("insert_or_update", index, old));
            });
        const bool loose = end_op(finished);
        expect_present("!insert_or_update", j, loose, !inserted);
        // Present: f ran (again after each lost race). Absent: f ran only if a clear erased
        // the key between f and its replacement.
        GRACE_FUZZ_CHECK(inserted ? calls == 0 || loose : calls >= 1,
                         "thread %u op %zu: insert_or_update(%zu) returned %d after %d calls "
                         "of f",
                         id_, op_, index, inserted, calls);
        now_present(j, inserted ? inserted_code : updated_code, loose);
        break;
      }
      case op::erase: {
        const bool erased = map_.erase(key);
        const bool loose = end_op(finished);
        expect_present("erase", j, loose, erased);
        now_absent(j);
        break;
      }
      case op::extract: {
        const std::optional<Value> taken = map_.extract(key);
        std::optional<std::uint64_t> code;
        if (taken) code = observe("extract", index, *taken);
        const bool loose = end_op(finished);
        expect_owned("extract", j, loose, code);
        now_absent(j);
        break;
      }
      case op::erase_if: {
        const bool want = (arg & 1) != 0;
        int calls = 0;
        const bool erased = map_.erase_if(key, [&](const Value& v) {
          ++calls;
          expect_owned("erase_if", j, true, observe("erase_if", index, v));
          return want;
        });
        const bool loose = end_op(finished);
        GRACE_FUZZ_CHECK(!erased || want, "thread %u op %zu: erase_if(%zu) erased against pred",
                         id_, op_, index);
        GRACE_FUZZ_CHECK(calls <= 1 || loose, "thread %u op %zu: erase_if called pred %d times",
                         id_, op_, calls);
        if (erased) {
          expect_present("erase_if", j, loose, true);
          now_absent(j);
        } else if (want || calls == 0) {
          GRACE_FUZZ_CHECK(calls == 0 || loose,
                           "thread %u op %zu: erase_if(%zu) approved, then found the key gone",
                           id_, op_, index);
          expect_present("erase_if", j, loose, false);
          now_absent(j);
        } else {  // pred said no to the present value
          owned_[j].maybe_gone = loose;
        }
        break;
      }
      default:
        break;
    }
  }

  void apply_shared(op o, unsigned arg, std::size_t j) {
    const std::size_t index = kSharedBase + j;
    const Key key = keys::make(index);
    auto wrote = [&](std::uint64_t code) {
      last_shared_write_[j] = code;
      seen_[index][id_] = gf::serial_of_code(code);
    };
    switch (o) {
      case op::find:
        if (const std::optional<Value> found = map_.find(key)) observe("find", index, *found);
        break;
      case op::contains:
        contains(key, index, arg);
        break;
      case op::visit: {
        int calls = 0;
        const bool visited = map_.visit(key, [&](const Value& v) {
          ++calls;
          observe("visit", index, v);
        });
        GRACE_FUZZ_CHECK(calls == (visited ? 1 : 0), "thread %u op %zu: visit called f %d times",
                         id_, op_, calls);
        break;
      }
      case op::pin:
        pin(key, index, arg);
        break;
      case op::insert:
      case op::try_emplace: {
        const std::uint64_t code = fresh_code(index);
        if (insert(o, arg, key, index, code)) wrote(code);
        break;
      }
      case op::insert_or_assign: {
        const std::uint64_t code = fresh_code(index);
        insert(o, arg, key, index, code);
        wrote(code);
        break;
      }
      case op::assign: {
        const std::uint64_t code = fresh_code(index);
        if (map_.assign(key, values::make(code))) wrote(code);
        break;
      }
      case op::update: {
        const std::uint64_t code = fresh_code(index);
        if (map_.update(key, [&](const Value& old) {
              observe("update", index, old);
              return values::make(code);
            })) {
          wrote(code);
        }
        break;
      }
      case op::insert_or_update: {
        const std::uint64_t inserted_code = fresh_code(index);
        const std::uint64_t updated_code = fresh_code(index);
        const bool inserted =
            map_.insert_or_update(key, values::make(inserted_code), [&](const Value& old) {
              observe("insert_or_update", index, old);
              return values::make(updated_code);
            });
        wrote(inserted ? inserted_code : updated_code);
        break;
      }
      case op::erase:
        if (map_.erase(key)) erased_shared_[j] = true;
        break;
      case op::extract:
        if (const std::optional<Value> taken = map_.extract(key)) {
          observe("extract", index, *taken);
          erased_shared_[j] = true;
        }
        break;
      case op::erase_if: {
        const bool want = (arg & 1) != 0;
        const bool erased = map_.erase_if(key, [&](const Value& v) {
          observe("erase_if", index, v);
          return want;
        });
        GRACE_FUZZ_CHECK(!erased || want, "thread %u op %zu: erase_if erased against pred", id_,
                         op_);
        if (erased) erased_shared_[j] = true;
        break;
      }
      default:
        break;
    }
  }

  // contains(), or count() if arg bit 0 is set.
  bool contains(const Key& key, std::size_t index, unsigned arg) {
    const std::size_t found = gf::lookup_count(map_, key, (arg & 1) != 0);
    GRACE_FUZZ_CHECK(found <= 1, "thread %u op %zu: count(%zu) returned %zu", id_, op_, index,
                     found);
    return found == 1;
  }

  // insert, try_emplace or insert_or_assign (o); arg bit 0 moves the key in.
  bool insert(op o, unsigned arg, const Key& key, std::size_t index, std::uint64_t code) {
    const gf::insert_member member = o == op::insert        ? gf::insert_member::insert
                                     : o == op::try_emplace ? gf::insert_member::try_emplace
                                                            : gf::insert_member::insert_or_assign;
    const gf::insert_result r =
        gf::insert_into(map_, member, (arg & 1) != 0, key, values::make(code));
    GRACE_FUZZ_CHECK(!r.key_lost,
                     "thread %u op %zu: %s(std::move(key %zu)) did not insert it and did not "
                     "give it back",
                     id_, op_, gf::name_of(member), index);
    return r.inserted;
  }

  // Holds a read section across the next arg + 1 operations (nested pins only read).
  void pin(const Key& key, std::size_t index, unsigned arg) {
    if (held_) {
      auto view = map_.pin();
      if (const Value* v = view.find(key)) observe("pin().find", index, *v);
      view.contains(key);
      return;
    }
    held_.emplace(map_, key, op_, arg,
                  [&](const Value& v) { return observe("pin().find", index, v); });
  }
  void release_pin() {
    GRACE_FUZZ_CHECK(held_->unchanged(),
                     "thread %u op %zu: an element pinned since op %zu changed under its read "
                     "section",
                     id_, op_, held_->pinned_at);
    held_.reset();
  }

  void clear_all() {
    // Relaxed: published to the threads that see one of this clear's erases by the map's
    // Release CAS (M1), and to those that see it end by the Release increment below.
    const std::uint64_t before = shared_.clears_started.fetch_add(1, std::memory_order_relaxed);
    map_.clear();
    // Release: this clear's erases happen before a begin_op() that counts it; pairs with
    // the Acquire load there.
    shared_.clears_finished.fetch_add(1, std::memory_order_release);
    // Other clears only erase, and nothing else writes this thread's keys: all absent now.
    for (owned_state& s : owned_) s = owned_state{};
    seen_started_ = before + 1;
  }

  // What a walk over the map (for_each, the whole-map erase_if) passed of this thread's keys.
  struct own_walk {
    int visits[kOwned] = {};
    std::uint64_t codes[kOwned] = {};
    bool erased[kOwned] = {};  // the whole-map erase_if's pred approved it
  };
  bool owns(std::size_t index) const { return index < kSharedBase && index / kOwned == id_; }

  // Checks an element a walk passed and notes it if it is this thread's; returns its index.
  std::size_t walked(const char* what, own_walk& walk, const Key& key, const Value& value) {
    const std::optional<std::size_t> index = keys::index_of(key);
    GRACE_FUZZ_CHECK(index && *index < kKeys, "thread %u op %zu: %s passed a key never inserted",
                     id_, op_, what);
    const std::uint64_t code = observe(what, *index, value);
    if (owns(*index)) {
      ++walk.visits[*index % kOwned];
      walk.codes[*index % kOwned] = code;
    }
    return *index;
  }

  // After a walk: this thread's keys it passed held the model's values (and are gone now if
  // erased); those a walk to the end did not pass were absent at some point of it, so are
  // absent now. A walk that stopped early says nothing of the keys it did not reach.
  void end_walk(const char* what, const own_walk& walk, bool to_the_end, bool loose) {
    for (std::size_t j = 0; j < kOwned; ++j) {
      GRACE_FUZZ_CHECK(walk.visits[j] <= 1, "thread %u op %zu: %s passed its key %zu %d times",
                       id_, op_, what, own_index(j), walk.visits[j]);
      if (walk.visits[j] == 1) {
        expect_owned(what, j, loose, walk.codes[j]);
        if (walk.erased[j]) {
          now_absent(j);
        } else {
          now_present(j, walk.codes[j], loose);
        }
      } else if (to_the_end) {
        expect_owned(what, j, loose, std::nullopt);
        now_absent(j);
      }
    }
  }

  // for_each: this thread's present keys once each, with the model's values; with stop_at
  // (> 0), an f that returns false at that element, and is never called again.
  void iterate(std::size_t stop_at) {
    const std::uint64_t finished = begin_op();
    own_walk walk;
    auto see = [&](const Key& key, const Value& value) { walked("for_each", walk, key, value); };
    bool to_the_end = true;
    if (stop_at == 0) {
      map_.for_each(see);
    } else {
      const std::size_t calls = gf::for_each_until(map_, stop_at, see);
      GRACE_FUZZ_CHECK(calls <= stop_at,
                       "thread %u op %zu: for_each called f again after it returned false", id_,
                       op_);
      to_the_end = calls < stop_at;
    }
    end_walk("for_each", walk, to_the_end, end_op(finished));
  }

  // erase_if(pred) over the whole map. pred approves this thread's keys and the shared keys
  // that gf::whole_map_erases() picks, never another thread's. Every erase needs an approval
  // (a shared key's pred runs again if the key is replaced meanwhile), and each approved key
  // of this thread is erased unless a clear got there first.
  void erase_matching(std::size_t anchor, unsigned arg) {
    const std::uint64_t finished = begin_op();
    own_walk walk;
    std::size_t approved = 0;
    std::size_t approved_own = 0;
    const std::size_t erased = map_.erase_if([&](const Key& key, const Value& value) {
      const std::size_t index = walked("erase_if(pred)", walk, key, value);
      const bool mine = owns(index);
      if ((!mine && index < kSharedBase) || !gf::whole_map_erases(index, anchor, arg)) {
        return false;
      }
      ++approved;
      if (mine) {
        ++approved_own;
        walk.erased[index % kOwned] = true;
      } else {
        erased_shared_[index - kSharedBase] = true;  // may have been erased: absent allowed
      }
      return true;
    });
    const bool loose = end_op(finished);
    GRACE_FUZZ_CHECK(erased <= approved && (erased >= approved_own || loose),
                     "thread %u op %zu: erase_if(pred) erased %zu after %zu approvals, %zu of "
                     "them of its own keys",
                     id_, op_, erased, approved, approved_own);
    end_walk("erase_if(pred)", walk, true, loose);
  }

  map_type& map_;
  shared_state& shared_;
  const unsigned id_;
  std::vector<record> records_;
  std::size_t op_ = 0;
  std::uint64_t serial_ = 0;
  std::uint64_t seen_started_ = 0;
  owned_state owned_[kOwned];
  std::optional<std::uint64_t> last_shared_write_[kShared];
  bool erased_shared_[kShared] = {};
  std::uint64_t seen_[kKeys][kMaxThreads] = {};  // highest serial read per (key, writer)
  std::optional<gf::held_pin<map_type>> held_;  // op::pin
};

template <class Key, class Value>
void run(gf::hash_mode hash, const grace::hash_map_options& options, unsigned threads,
         gf::byte_reader& in) {
  using worker_type = worker<Key, Value>;
  using map_type = typename worker_type::map_type;
  shared_state shared;
  shared.threads = threads;
  shared.options = options;
  map_type map(options, gf::index_hash{hash});
  std::vector<std::unique_ptr<worker_type>> workers;
  for (unsigned t = 0; t < threads; ++t) {
    workers.push_back(std::make_unique<worker_type>(map, shared, t));
  }
  for (std::size_t n = 0; in.left() >= 2; ++n) {
    const std::uint8_t op_byte = in.next();
    const std::uint8_t key_byte = in.next();
    workers[n % threads]->add(record{static_cast<op>(op_byte % kOpCount), op_byte / kOpCount,
                                     key_byte & 31u, static_cast<unsigned>(key_byte) >> 5});
  }
  {
    std::vector<std::jthread> others;
    for (unsigned t = 1; t < threads; ++t) others.emplace_back([&, t] { workers[t]->run(); });
    workers[0]->run();
  }
  for (const auto& w : workers) w->settle();

  // Quiescent: the content is exact.
  int visits[kKeys] = {};
  std::uint64_t codes[kKeys] = {};
  std::size_t visited = 0;
  map.for_each([&](const Key& key, const Value& value) {
    ++visited;
    const std::optional<std::size_t> index = gf::key_codec<Key>::index_of(key);
    const std::optional<std::uint64_t> code = gf::value_codec<Value>::read(value);
    GRACE_FUZZ_CHECK(index && *index < kKeys && code && gf::index_of_code(*code) == *index,
                     "final for_each visited a key never inserted or a malformed value");
    ++visits[*index];
    codes[*index] = *code;
  });
  GRACE_FUZZ_CHECK(map.size() == visited, "final size() %zu, for_each visited %zu", map.size(),
                   visited);
  GRACE_FUZZ_CHECK(gf::buckets_in_bounds(map.bucket_count(), options),
                   "final bucket_count() %zu", map.bucket_count());
  GRACE_FUZZ_CHECK(gf::load_factor_is(map, visited),
                   "final load_factor() %g, with %zu elements in %zu buckets",
                   static_cast<double>(map.load_factor()), visited, map.bucket_count());
  // Relaxed: the threads were joined.
  const bool cleared = shared.clears_started.load(std::memory_order_relaxed) != 0;
  for (std::size_t i = 0; i < kKeys; ++i) {
    GRACE_FUZZ_CHECK(visits[i] <= 1, "final for_each visited key %zu %d times", i, visits[i]);
    if (i < kSharedBase) {
      if (i / kOwned >= threads) {
        GRACE_FUZZ_CHECK(visits[i] == 0, "final: key %zu has no thread, yet is present", i);
        continue;
      }
      const owned_state& s = workers[i / kOwned]->owned(i % kOwned);
      if (visits[i] == 1) {
        GRACE_FUZZ_CHECK(s.value && *s.value == codes[i],
                         "final: owned key %zu holds %#llx, its thread's model %#llx", i,
                         static_cast<unsigned long long>(codes[i]),
                         static_cast<unsigned long long>(s.value.value_or(0)));
      } else {
        GRACE_FUZZ_CHECK(!s.value || s.maybe_gone,
                         "final: owned key %zu is absent, its thread's model %#llx", i,
                         static_cast<unsigned long long>(*s.value));
      }
      continue;
    }
    const std::size_t j = i - kSharedBase;
    if (visits[i] == 1) {
      const unsigned writer = gf::thread_of_code(codes[i]);
      GRACE_FUZZ_CHECK(writer < threads && workers[writer]->last_shared_write(j) == codes[i],
                       "final: shared key %zu holds %#llx, not its writer's last write", i,
                       static_cast<unsigned long long>(codes[i]));
    } else {
      bool erased = cleared;
      bool written = false;
      for (const auto& w : workers) {
        erased = erased || w->erased_shared(j);
        written = written || w->last_shared_write(j).has_value();
      }
      GRACE_FUZZ_CHECK(erased || !written,
                       "final: shared key %zu is absent, but was written and never erased", i);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  gf::byte_reader in(data, size);
  const gf::input_header header = gf::read_header(in);
  const unsigned threads = (header.target_bits & 1) != 0 ? 3 : 2;  // byte 0 bit 4
  if (header.strings) {
    run<std::string, std::string>(header.hash, header.options, threads, in);
  } else {
    run<std::uint64_t, std::uint64_t>(header.hash, header.options, threads, in);
  }
  return 0;
}
