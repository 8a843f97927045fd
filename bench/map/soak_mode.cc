// `grace-bench soak`: a long correctness run of grace::hash_map. Every public operation runs
// from more threads than there are cores for --minutes (or --seconds), and every value any
// operation reads is checked. It is a test, not a benchmark: its rates are only reported.
//
// Maps (the global domain; default options, except that initial_buckets changes each time
// the maps are rebuilt, and the text map's destruction alternates between its two modes):
//   pod   hash_map<uint64_t, pod_value>: 128-byte trivially destructible values (elements
//         go straight back to the pool); --keys key indices
//   text  hash_map<std::string, std::string>: heap-allocated keys and 32..256-byte binary
//         string values (non-trivial destruction: elements are retired through the domain,
//         or, in every other build, destroyed by the updaters through the pool); a quarter
//         as many key indices
// Every value carries its key index, its writer (a thread), the writer's sequence number, a
// payload, and a checksum over all of that. Every value read (find, visit, a pinned view's
// find, for_each, update's f, erase_if's predicate, the quiescent check) is verified: the
// checksum, that it is the value of the key it was found under, and that its writer may
// write that key.
//
// Ownership: every 4th key index is owned by one thread (index / 4 mod --threads). Only the
// owner writes it, so the owner knows whether it is present and its exact value, and checks
// the outcome of every operation it makes on it (insert's and erase's bools, update's old
// value, find's value, erase_if's result, what its own for_each saw). Other threads only read
// owned keys; every thread does everything on the other keys. clear(), which thread 0 runs
// every kClearPeriod (alternating maps), erases owned keys behind their owners' backs: an
// owner accepts a key's absence when a clear() started after it last looked (the
// clears_started / clears_finished counters of the map).
//
// Phases of --phase-seconds alternate fill (mostly inserts) and drain (mostly erases), so
// the tables grow and shrink every cycle. Between phases every worker parks and the main
// thread checks the quiescent maps exactly: for_each visits each key once, every lookup
// agrees with it, size() equals its count, and every owned key is as its owner believes.
// Every kRebuildEvery-th time both maps are then destroyed and built again.
//
// Per operation a worker picks the text map 1 time in 8, a key (half the time one of its
// own), and an operation by the phase's weights (kFillWeights, kDrainWeights): insert,
// try_emplace (in place), insert_or_assign, assign, update, erase, erase_if, find, contains,
// visit, or a pinned view (kPinLookups lookups, each value read twice). Besides: size() and
// empty() every kSizeCheckEvery operations (bounded by the key space), for_each 1 in
// max(kForEachOdds, keys / 2), reserve() of up to keys / kReserveDivisor 1 in kReserveOdds.
//
// Memory: the RSS sampler (tool/rss_sampler.h) reads the RSS every 10 ms; the main thread
// compares its peak with --max-rss-mib every kTick and stops the run above it. The default
// ceiling is the RSS at start + kCeilingBaseMib + kCeilingBytesPerKey per pod key index:
// 261 MiB at the default --keys, where Release and Debug runs peak at 38-45 MiB. The margin
// is for elements waiting for grace periods (the domain drains at once only past 64 MiB or
// 2^18 objects) and allocator caches; a leak of a small fraction of the updates, or
// reclamation that stops, crosses it within seconds to minutes. Under ASan the RSS also
// holds its quarantine (up to 256 MiB): give --max-rss-mib there.
//
// Output: `event=progress` every 10 s and one `event=summary` line:
//   ops            public map operations made
//   ops_per_s      in the last interval (progress) or over the run (summary)
//   verified       values checked (checksum, key, writer)
//   exact          outcomes of owned-key operations checked against the owner's knowledge
//   errors         failed checks (each printed to stderr, the first kMaxErrorMessages)
//   rss_mib, peak_rss_mib, max_rss_mib   RSS now, its peak since the start, the ceiling
//   grows, shrinks resizes of both maps, summed over every instance
//   grace_periods  the global domain's grace periods
//   clears, rebuilds, phases, quiescent_checks
// Exit status: 0 pass; 1 a check failed; 2 bad usage; 3 RSS above the ceiling; 4 no progress
// for kStallLimit (a hang; stderr shows what each thread had done).
//
// --inject-corruption is the soak's self-check: at the first quiescent point it flips one bit
// in a stored pod value (in place, with every worker parked), so the check that follows must
// report a checksum error and the run must exit with status 1.
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "grace/map/hash_map.h"
#include "map/map_value.h"
#include "tool/latency.h"
#include "tool/rss_sampler.h"
#include "tool/subcommand.h"

namespace grace::bench {
namespace {

constexpr double kDefaultMinutes = 1;
constexpr std::uint64_t kDefaultKeys = std::uint64_t{1} << 16;
constexpr std::uint64_t kMinKeys = 1024;
constexpr std::uint64_t kMaxKeys = std::uint64_t{1} << 30;  // fast_rng::below() and memory
constexpr double kDefaultPhaseSeconds = 5;
constexpr std::uint64_t kMaxThreads = 256;
constexpr std::uint64_t kOwnedStride = 4;     // every 4th key index is owned
constexpr std::uint64_t kTextKeyDivisor = 4;  // the text map's key space: keys / 4
constexpr unsigned kTextOneIn = 8;            // operations on the text map
constexpr unsigned kRebuildEvery = 4;         // quiescent points between rebuilds
constexpr auto kProgressPeriod = std::chrono::seconds(10);
constexpr auto kTick = std::chrono::milliseconds(20);
constexpr auto kClearPeriod = std::chrono::milliseconds(2500);
constexpr auto kStallLimit = std::chrono::seconds(60);
constexpr unsigned kPauseCheckEvery = 16;
constexpr unsigned kClockCheckEvery = 256;
constexpr std::uint64_t kSizeCheckEvery = 1024;
constexpr std::uint64_t kForEachOdds = 20'000;
constexpr std::uint64_t kReserveOdds = 50'000;
constexpr std::uint64_t kReserveDivisor = 8;  // reserve() asks for up to keys / 8
constexpr unsigned kPinLookups = 4;
constexpr unsigned kMaxErrorMessages = 20;
constexpr double kCeilingBaseMib = 192;
constexpr std::uint64_t kCeilingBytesPerKey = 1024;

constexpr int kExitFailed = 1;
constexpr int kExitMemory = 3;
constexpr int kExitHang = 4;

// --- errors ------------------------------------------------------------------------------

std::atomic<std::uint64_t> g_errors{0};

// who: a worker's index, or -1 for the main thread.
[[gnu::cold, gnu::noinline]] void report_error(const char* map, int who, const char* what,
                                               std::uint64_t key_index,
                                               const std::string& detail = {}) {
  // Relaxed: a counter; the main thread reads it to stop early and after the joins.
  const std::uint64_t n = g_errors.fetch_add(1, std::memory_order_relaxed);
  if (n >= kMaxErrorMessages) return;
  char thread[32];
  if (who < 0) {
    std::snprintf(thread, sizeof thread, "main");
  } else {
    std::snprintf(thread, sizeof thread, "thread %d", who);
  }
  std::fprintf(stderr, "grace-bench soak: ERROR map=%s %s: %s (key index %llu)%s%s\n", map, thread,
               what, static_cast<unsigned long long>(key_index), detail.empty() ? "" : ": ",
               detail.c_str());
  if (n + 1 == kMaxErrorMessages) {
    std::fprintf(stderr, "grace-bench soak: (further errors are counted, not printed)\n");
  }
}

std::uint64_t error_count() noexcept {
  // Relaxed: see report_error().
  return g_errors.load(std::memory_order_relaxed);
}

// --- values ------------------------------------------------------------------------------

// What a value says about itself.
struct stamp {
  std::uint64_t key_index = 0;
  std::uint64_t writer = 0;
  std::uint64_t seq = 0;
};

enum class fault { none, checksum, length };

const char* fault_name(fault f) {
  switch (f) {
    case fault::none:
      return "ok";
    case fault::checksum:
      return "checksum mismatch";
    case fault::length:
      return "value too short to hold a stamp";
  }
  return "?";
}

// FNV-1a's step over 64-bit words (or bytes): changing any one word changes the result.
constexpr std::uint64_t kChecksumSeed = 0xcbf29ce484222325ULL;
constexpr std::uint64_t kChecksumPrime = 0x100000001b3ULL;
inline std::uint64_t fold(std::uint64_t h, std::uint64_t word) noexcept {
  return (h ^ word) * kChecksumPrime;
}
inline std::uint64_t finish(std::uint64_t h) noexcept {
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ULL;
  return h ^ (h >> 32);
}

constexpr unsigned kPodPayloadWords = 12;

struct pod_value {
  std::uint64_t key_index = 0;
  std::uint64_t writer = 0;
  std::uint64_t seq = 0;
  std::uint64_t payload[kPodPayloadWords] = {};
  std::uint64_t checksum = 0;

  pod_value() = default;
  // try_emplace builds it in place from these.
  pod_value(std::uint64_t index, std::uint64_t writer_id, std::uint64_t sequence,
            std::uint64_t seed) noexcept
      : key_index(index), writer(writer_id), seq(sequence) {
    fast_rng rng(seed);
    for (std::uint64_t& word : payload) word = rng.next();
    checksum = checksum_of(*this);
  }

  static std::uint64_t checksum_of(const pod_value& v) noexcept {
    std::uint64_t h = fold(fold(fold(kChecksumSeed, v.key_index), v.writer), v.seq);
    for (const std::uint64_t word : v.payload) h = fold(h, word);
    return finish(h);
  }
};
static_assert(sizeof(pod_value) == 128);

struct pod_traits {
  using key_type = std::uint64_t;
  using value_type = pod_value;
  using map_type = grace::hash_map<key_type, value_type>;
  static constexpr const char* kName = "pod";

  static key_type key(std::uint64_t index) { return key_of(index); }
  static std::string describe(const key_type& k) { return "key " + std::to_string(k); }
  static value_type make(std::uint64_t index, std::uint64_t writer, std::uint64_t seq,
                         std::uint64_t seed) {
    return pod_value(index, writer, seq, seed);
  }
  static bool emplace(map_type& map, const key_type& k, std::uint64_t index, std::uint64_t writer,
                      std::uint64_t seq, std::uint64_t seed) {
    return map.try_emplace(k, index, writer, seq, seed);
  }
  static fault decode(const value_type& v, stamp& out) noexcept {
    if (pod_value::checksum_of(v) != v.checksum) return fault::checksum;
    out = stamp{v.key_index, v.writer, v.seq};
    return fault::none;
  }
  static void corrupt(value_type& v) noexcept { v.payload[5] ^= std::uint64_t{1} << 17; }
};

// Text values: [key index][writer][seq] (8 bytes each), 0..kTextMaxPayload payload bytes,
// then the checksum of everything before it (8 bytes). Always longer than the small-string
// buffer, so every value owns heap memory.
constexpr std::size_t kTextHeader = 24;
constexpr std::size_t kTextMaxPayload = 224;

std::uint64_t text_checksum(const char* bytes, std::size_t n) noexcept {
  std::uint64_t h = kChecksumSeed;
  for (std::size_t i = 0; i < n; ++i) h = fold(h, static_cast<unsigned char>(bytes[i]));
  return finish(h);
}

struct text_traits {
  using key_type = std::string;
  using value_type = std::string;
  using map_type = grace::hash_map<key_type, value_type>;
  static constexpr const char* kName = "text";

  // Longer than the small-string buffer: every key owns heap memory too.
  static key_type key(std::uint64_t index) { return "grace-soak-key/" + std::to_string(index); }
  static std::string describe(const key_type& k) { return "key \"" + k + "\""; }
  static value_type make(std::uint64_t index, std::uint64_t writer, std::uint64_t seq,
                         std::uint64_t seed) {
    value_type out;
    encode(out, index, writer, seq, seed);
    return out;
  }
  static bool emplace(map_type& map, const key_type& k, std::uint64_t index, std::uint64_t writer,
                      std::uint64_t seq, std::uint64_t seed) {
    thread_local std::string bytes;
    encode(bytes, index, writer, seq, seed);
    // Built in place: std::string(const char*, size_t).
    return map.try_emplace(k, bytes.data(), bytes.size());
  }
  static fault decode(const value_type& v, stamp& out) noexcept {
    if (v.size() < kTextHeader + sizeof(std::uint64_t)) return fault::length;
    const std::size_t body = v.size() - sizeof(std::uint64_t);
    std::uint64_t stored = 0;
    std::memcpy(&stored, v.data() + body, sizeof stored);
    if (text_checksum(v.data(), body) != stored) return fault::checksum;
    std::memcpy(&out.key_index, v.data(), 8);
    std::memcpy(&out.writer, v.data() + 8, 8);
    std::memcpy(&out.seq, v.data() + 16, 8);
    return fault::none;
  }

 private:
  static void encode(std::string& out, std::uint64_t index, std::uint64_t writer, std::uint64_t seq,
                     std::uint64_t seed) {
    fast_rng rng(seed);
    const std::size_t payload = fast_rng::below(rng.next(), kTextMaxPayload + 1);
    out.resize(kTextHeader + payload + sizeof(std::uint64_t));
    char* p = out.data();
    std::memcpy(p, &index, 8);
    std::memcpy(p + 8, &writer, 8);
    std::memcpy(p + 16, &seq, 8);
    for (std::size_t at = 0; at < payload; at += 8) {
      const std::uint64_t word = rng.next();
      std::memcpy(p + kTextHeader + at, &word, std::min<std::size_t>(8, payload - at));
    }
    const std::uint64_t sum = text_checksum(p, kTextHeader + payload);
    std::memcpy(p + kTextHeader + payload, &sum, sizeof sum);
  }
};

// --- keys and ownership --------------------------------------------------------------------

struct key_plan {
  std::uint64_t keys = 0;
  unsigned threads = 1;

  static bool owned(std::uint64_t index) noexcept { return index % kOwnedStride == 0; }
  unsigned owner(std::uint64_t index) const noexcept {
    return static_cast<unsigned>((index / kOwnedStride) % threads);
  }
  // The owner's slot for an owned index.
  std::uint64_t slot(std::uint64_t index) const noexcept { return index / kOwnedStride / threads; }
  std::uint64_t own_index(unsigned t, std::uint64_t slot) const noexcept {
    return kOwnedStride * (t + std::uint64_t{threads} * slot);
  }
  std::uint64_t own_count(unsigned t) const noexcept {
    const std::uint64_t owned_indices = (keys + kOwnedStride - 1) / kOwnedStride;
    return owned_indices > t ? (owned_indices - t - 1) / threads + 1 : 0;
  }
  // Who may have written a value of `index`: its owner, or any worker for a shared key.
  bool writer_allowed(std::uint64_t index, std::uint64_t writer) const noexcept {
    return owned(index) ? writer == owner(index) : writer < threads;
  }
};

// What an owner knows of one of its keys.
struct owned_key {
  std::uint64_t seq = 0;          // the value's sequence number, if present
  std::uint64_t clear_floor = 0;  // clears finished before the operation that last saw the key
  bool present = false;
};

// --- the shared maps -------------------------------------------------------------------------

template <class Traits>
struct map_state {
  using map_type = typename Traits::map_type;

  key_plan plan;
  std::unique_ptr<map_type> map;
  // clear() is bracketed by these (thread 0 clears; see clear_map()).
  std::atomic<std::uint64_t> clears_started{0};
  std::atomic<std::uint64_t> clears_finished{0};
  // Of the instances destroyed so far (main thread only).
  std::uint64_t past_grows = 0;
  std::uint64_t past_shrinks = 0;

  // Main thread, workers parked (or not started).
  void build(std::size_t initial_buckets, element_destruction destruction) {
    if (map) {
      const hash_map_stats s = map->stats();
      past_grows += s.grows;
      past_shrinks += s.shrinks;
      map.reset();
    }
    hash_map_options options;
    options.initial_buckets = initial_buckets;
    options.destruction = destruction;
    map = std::make_unique<map_type>(options);
  }
  std::uint64_t grows() const { return past_grows + map->stats().grows; }
  std::uint64_t shrinks() const { return past_shrinks + map->stats().shrinks; }
};

// --- per-thread counters -------------------------------------------------------------------

// Written by one worker, read by the main thread and the watchdog.
struct alignas(64) thread_counters {
  std::atomic<std::uint64_t> ops{0};
  std::atomic<std::uint64_t> verified{0};
  std::atomic<std::uint64_t> exact{0};

  static void bump(std::atomic<std::uint64_t>& counter, std::uint64_t n = 1) noexcept {
    // Relaxed: a statistic with a single writer.
    counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  static std::uint64_t read(const std::atomic<std::uint64_t>& counter) noexcept {
    // Relaxed: a statistic; approximate while the workers run, exact after a barrier.
    return counter.load(std::memory_order_relaxed);
  }
};

// --- one worker's operations on one map --------------------------------------------------

enum class op : unsigned {
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
  pin,
  count
};
constexpr unsigned kOps = static_cast<unsigned>(op::count);

const char* op_name(op o) {
  constexpr const char* kNames[kOps] = {
      "insert",   "try_emplace", "insert_or_assign", "assign", "update", "erase",
      "erase_if", "find",        "contains",         "visit",  "pin"};
  return kNames[static_cast<unsigned>(o)];
}

enum class phase_kind : int { fill, drain };

// Weights per op, in enum order. Fill: inserts win (the table grows to about 0.85 x keys);
// drain: erases win (it falls to about 1/16 of them, below the shrink load factor of 1/8).
constexpr unsigned kFillWeights[kOps] = {8, 8, 8, 3, 6, 3, 2, 10, 6, 10, 4};
constexpr unsigned kDrainWeights[kOps] = {1, 1, 0, 3, 6, 24, 12, 10, 6, 10, 4};

op pick_op(phase_kind kind, std::uint64_t draw) {
  const unsigned* weights = kind == phase_kind::fill ? kFillWeights : kDrainWeights;
  unsigned total = 0;
  for (unsigned o = 0; o < kOps; ++o) total += weights[o];
  std::uint64_t x = fast_rng::below(draw, total);
  for (unsigned o = 0; o < kOps; ++o) {
    if (x < weights[o]) return static_cast<op>(o);
    x -= weights[o];
  }
  return op::find;
}

template <class Traits>
class map_worker {
 public:
  using key_type = typename Traits::key_type;
  using value_type = typename Traits::value_type;
  using map_type = typename Traits::map_type;

  map_worker(map_state<Traits>& state, unsigned self, thread_counters& counters, std::uint64_t& seq)
      : state_(state),
        plan_(state.plan),
        self_(self),
        counters_(counters),
        seq_(seq),
        own_(plan_.own_count(self)),
        for_each_odds_(std::max(kForEachOdds, plan_.keys / 2)) {}

  // The owner's knowledge of its slot-th key (the main thread's quiescent check reads and
  // resets it while the worker is parked).
  owned_key& model(std::uint64_t slot) { return own_[slot]; }
  // After the map was rebuilt (empty): `floor` is the map's clears finished so far.
  void forget_all(std::uint64_t floor) {
    for (owned_key& k : own_) k = owned_key{0, floor, false};
  }

  // One random operation (and, by the odds, a size check, a for_each or a reserve).
  void step(fast_rng& rng, phase_kind kind) {
    map_type& map = *state_.map;
    const op o = pick_op(kind, rng.next());
    const std::uint64_t draw = rng.next();
    if (!own_.empty() && (draw >> 63) != 0) {
      own_op(map, o, fast_rng::below(draw, own_.size()), rng);
    } else {
      const std::uint64_t index = fast_rng::below(draw, plan_.keys);
      if (!key_plan::owned(index)) {
        shared_op(map, o, index, rng);
      } else if (plan_.owner(index) == self_) {
        own_op(map, o, plan_.slot(index), rng);
      } else {
        read_op(map, o, index);
      }
    }
    if (++steps_ % kSizeCheckEvery == 0) check_size(map);
    const std::uint64_t rare = rng.next();
    if (fast_rng::below(rare, for_each_odds_) == 0) walk(map);
    if (fast_rng::below(rare >> 32, kReserveOdds) == 0) {
      // At most an eighth of the keys: a reservation also holds shrinks back (until
      // clear()), and the drain must still take the table below it.
      map.reserve(fast_rng::below(rng.next(), plan_.keys / kReserveDivisor) + 1);
      count_op();
    }
  }

  // clear() (thread 0 only), bracketed by the counters owners consult (see own_op()).
  void clear_map() {
    // Relaxed: counted before the clear's first erasure, whose Release CAS orders it for
    // every thread that observes the erasure (through the map's Acquire loads).
    state_.clears_started.fetch_add(1, std::memory_order_relaxed);
    state_.map->clear();
    // Release: every erasure of this clear happens before an operation that begins after
    // reading this count; pairs with the Acquire load in clear_floor_now().
    state_.clears_finished.fetch_add(1, std::memory_order_release);
    count_op();
  }

 private:
  std::uint64_t next_seq() { return ++seq_; }
  value_type make(std::uint64_t index, fast_rng& rng) {
    return Traits::make(index, self_, next_seq(), rng.next());
  }
  void count_op() { thread_counters::bump(counters_.ops); }

  // Clears finished before the operation about to start: none of them can undo it.
  std::uint64_t clear_floor_now() const {
    // Acquire: a clear counted here has erased all it will; pairs with the Release increment
    // in clear_map().
    return state_.clears_finished.load(std::memory_order_acquire);
  }
  // True if a clear() may have erased the key since `k` was last observed: one started that
  // had not finished before that observation began.
  bool may_be_cleared(const owned_key& k) const {
    // Relaxed: if this thread saw an erasure of a clear (Acquire loads in the map), it reads
    // that clear's increment or a later one (see clear_map()).
    return state_.clears_started.load(std::memory_order_relaxed) > k.clear_floor;
  }

  // Verifies a value read under key `index`; false (after reporting) if it is not a value of
  // that key its writer could have written.
  bool verify(const value_type& v, std::uint64_t index, const char* what, stamp& s) {
    thread_counters::bump(counters_.verified);
    if (const fault f = Traits::decode(v, s); f != fault::none) {
      report_error(Traits::kName, static_cast<int>(self_), what, index, fault_name(f));
      return false;
    }
    if (s.key_index != index) {
      report_error(Traits::kName, static_cast<int>(self_), what, index,
                   "found the value of key index " + std::to_string(s.key_index));
      return false;
    }
    if (!plan_.writer_allowed(index, s.writer)) {
      report_error(Traits::kName, static_cast<int>(self_), what, index,
                   "written by thread " + std::to_string(s.writer) + ", which may not write it");
      return false;
    }
    return true;
  }
  void verify(const value_type& v, std::uint64_t index, const char* what) {
    stamp s;
    (void)verify(v, index, what, s);
  }

  // An operation on a key nobody owns: any thread may do anything, so only values are checked.
  void shared_op(map_type& map, op o, std::uint64_t index, fast_rng& rng) {
    const key_type k = Traits::key(index);
    switch (o) {
      case op::insert:
        (void)map.insert(k, make(index, rng));
        break;
      case op::try_emplace:
        (void)Traits::emplace(map, k, index, self_, next_seq(), rng.next());
        break;
      case op::insert_or_assign:
        (void)map.insert_or_assign(k, make(index, rng));
        break;
      case op::assign:
        (void)map.assign(k, make(index, rng));
        break;
      case op::update:
        (void)map.update(k, [&](const value_type& old) {
          verify(old, index, "update");
          return make(index, rng);
        });
        break;
      case op::erase:
        (void)map.erase(k);
        break;
      case op::erase_if:
        (void)map.erase_if(k, [&](const value_type& v) {
          stamp s;
          return verify(v, index, "erase_if", s) && s.seq % 4 != 0;
        });
        break;
      case op::find:
      case op::contains:
      case op::visit:
      case op::pin:
        read_op(map, o, index);
        return;
      case op::count:
        break;
    }
    count_op();
  }

  // A read of a key this thread does not own (the value is checked, including its writer).
  void read_op(map_type& map, op o, std::uint64_t index) {
    const key_type k = Traits::key(index);
    switch (o) {
      case op::insert:
      case op::try_emplace:
      case op::insert_or_assign:
      case op::find:
        if (const std::optional<value_type> v = map.find(k)) verify(*v, index, "find");
        break;
      case op::contains:
        (void)map.contains(k);
        break;
      case op::pin: {
        auto view = map.pin();
        if (const value_type* v = view.find(k)) {
          verify(*v, index, "pinned find");
          (void)view.contains(Traits::key(fast_rng::below(index * kValueStride, plan_.keys)));
          verify(*v, index, "pinned find, read again");  // still valid while the view lives
        }
        break;
      }
      default:
        (void)map.visit(k, [&](const value_type& v) { verify(v, index, "visit"); });
        break;
    }
    count_op();
  }

  // An operation on one of this thread's own keys: its outcome is checked exactly.
  void own_op(map_type& map, op o, std::uint64_t slot, fast_rng& rng) {
    if (o == op::pin) {
      pin_op(map, slot, rng);
      return;
    }
    const std::uint64_t index = plan_.own_index(self_, slot);
    owned_key& known = own_[slot];
    const key_type k = Traits::key(index);
    const std::uint64_t floor = clear_floor_now();
    const bool was = known.present;
    bool result = false;
    bool seen_present = false;  // the key's state the operation established
    std::uint64_t seen_seq = known.seq;
    const char* wrong = nullptr;
    // Checks a value of this key read during the operation: its owner wrote it last.
    auto check_read = [&](const value_type& v, const char* what) {
      stamp s;
      if (!verify(v, index, what, s)) return false;
      if (!was || s.seq != known.seq) {
        report_error(Traits::kName, static_cast<int>(self_), what, index,
                     was ? "stale or foreign value: seq " + std::to_string(s.seq) +
                               ", its owner last wrote " + std::to_string(known.seq)
                         : "present, but its owner never inserted it or erased it");
      }
      return true;
    };
    switch (o) {
      case op::insert:
      case op::try_emplace: {
        const std::uint64_t seq = next_seq();
        result = o == op::insert ? map.insert(k, Traits::make(index, self_, seq, rng.next()))
                                 : Traits::emplace(map, k, index, self_, seq, rng.next());
        seen_present = true;
        seen_seq = result ? seq : known.seq;
        if (!was && !result) wrong = "failed on an absent key";
        if (was && result && !may_be_cleared(known)) wrong = "inserted over a present key";
        break;
      }
      case op::insert_or_assign: {
        const std::uint64_t seq = next_seq();
        result = map.insert_or_assign(k, Traits::make(index, self_, seq, rng.next()));
        seen_present = true;
        seen_seq = seq;
        if (!was && !result) wrong = "replaced an absent key";
        if (was && result && !may_be_cleared(known)) wrong = "inserted over a present key";
        break;
      }
      case op::assign: {
        const std::uint64_t seq = next_seq();
        result = map.assign(k, Traits::make(index, self_, seq, rng.next()));
        seen_present = result;
        seen_seq = seq;
        if (!was && result) wrong = "replaced an absent key";
        if (was && !result && !may_be_cleared(known)) wrong = "found a present key absent";
        break;
      }
      case op::update: {
        std::uint64_t seq = 0;
        result = map.update(k, [&](const value_type& old) {
          check_read(old, "update's old value");
          seq = next_seq();
          return Traits::make(index, self_, seq, rng.next());
        });
        seen_present = result;
        seen_seq = seq;
        if (!was && result) wrong = "updated an absent key";
        if (was && !result && !may_be_cleared(known)) wrong = "found a present key absent";
        break;
      }
      case op::erase:
        result = map.erase(k);
        seen_present = false;
        if (!was && result) wrong = "erased an absent key";
        if (was && !result && !may_be_cleared(known)) wrong = "found a present key absent";
        break;
      case op::erase_if: {
        bool called = false;
        bool last = false;
        result = map.erase_if(k, [&](const value_type& v) {
          called = true;
          check_read(v, "erase_if's value");
          stamp s;
          last = Traits::decode(v, s) == fault::none && s.seq % 2 == 0;
          return last;
        });
        seen_present = !result && called && !last;
        if (!was && result) wrong = "erased an absent key";
        if (was && !may_be_cleared(known) && result != (known.seq % 2 == 0)) {
          wrong = result ? "erased although the predicate said no"
                         : "kept although the predicate said yes";
        }
        break;
      }
      case op::find:
      case op::contains:
      case op::visit: {
        if (o == op::find) {
          const std::optional<value_type> v = map.find(k);
          result = v.has_value();
          if (result) check_read(*v, "find");
        } else if (o == op::contains) {
          result = map.contains(k);
        } else {
          result = map.visit(k, [&](const value_type& v) { check_read(v, "visit"); });
        }
        seen_present = result;
        if (!was && result) wrong = "found a key its owner does not have";
        if (was && !result && !may_be_cleared(known)) wrong = "lost a present key";
        break;
      }
      case op::pin:
      case op::count:
        break;
    }
    count_op();
    thread_counters::bump(counters_.exact);
    if (wrong != nullptr) [[unlikely]] {
      report_error(Traits::kName, static_cast<int>(self_), op_name(o), index,
                   std::string("owned key: ") + wrong);
      resync(map, slot);
      return;
    }
    known = owned_key{seen_present ? seen_seq : 0, floor, seen_present};
  }

  // After a contradiction: believe what a lookup sees, so one bug is reported once.
  void resync(map_type& map, std::uint64_t slot) {
    const std::uint64_t floor = clear_floor_now();
    stamp s;
    const std::optional<value_type> v = map.find(Traits::key(plan_.own_index(self_, slot)));
    const bool present = v.has_value() && Traits::decode(*v, s) == fault::none;
    own_[slot] = owned_key{present ? s.seq : 0, floor, present};
  }

  // A pinned view: kPinLookups lookups (own keys and random ones) in one read section, every
  // value found read again before the view ends; own keys checked exactly.
  void pin_op(map_type& map, std::uint64_t first_slot, fast_rng& rng) {
    struct lookup {
      std::uint64_t index;
      std::uint64_t slot;  // own keys
      bool own;
      const value_type* value;
      bool present;
    };
    lookup lookups[kPinLookups];
    const std::uint64_t floor = clear_floor_now();
    {
      auto view = map.pin();
      for (unsigned n = 0; n < kPinLookups; ++n) {
        lookup& l = lookups[n];
        l.own = n % 2 == 0;
        if (l.own) {
          l.slot = n == 0 ? first_slot : fast_rng::below(rng.next(), own_.size());
          l.index = plan_.own_index(self_, l.slot);
        } else {
          l.index = fast_rng::below(rng.next(), plan_.keys);
          l.own = key_plan::owned(l.index) && plan_.owner(l.index) == self_;
          l.slot = plan_.slot(l.index);
        }
        const key_type k = Traits::key(l.index);
        if (n == kPinLookups - 1) {
          l.value = nullptr;
          l.present = view.contains(k);
        } else {
          l.value = view.find(k);
          l.present = l.value != nullptr;
        }
        if (l.value != nullptr) verify(*l.value, l.index, "pinned find");
      }
      // The values must not have changed under the view.
      for (const lookup& l : lookups) {
        if (l.value != nullptr) verify(*l.value, l.index, "pinned find, read again");
      }
      for (const lookup& l : lookups) {
        if (!l.own || l.value == nullptr) continue;
        stamp s;
        const owned_key& known = own_[l.slot];
        if (Traits::decode(*l.value, s) == fault::none && (!known.present || s.seq != known.seq)) {
          report_error(Traits::kName, static_cast<int>(self_), "pinned find", l.index,
                       "owned key: stale or foreign value");
        }
      }
    }
    count_op();
    for (const lookup& l : lookups) {
      if (!l.own) continue;
      owned_key& known = own_[l.slot];
      thread_counters::bump(counters_.exact);
      if ((!known.present && l.present) ||
          (known.present && !l.present && !may_be_cleared(known))) {
        report_error(Traits::kName, static_cast<int>(self_), "pinned view", l.index,
                     known.present ? "owned key: lost a present key"
                                   : "owned key: found a key its owner does not have");
        resync(map, l.slot);
        continue;
      }
      if (l.value == nullptr && l.present) continue;  // contains(): the seq stays as known
      known = owned_key{l.present ? known.seq : 0, floor, l.present};
    }
  }

  // size() and empty(): never more than the key space, plus what a clear() may not have
  // subtracted yet and the updates in flight.
  void check_size(map_type& map) {
    const std::size_t size = map.size();
    (void)map.empty();  // not comparable with size() while updates run
    count_op();
    count_op();
    const std::uint64_t bound = 2 * plan_.keys + plan_.threads;
    if (size > bound) {
      report_error(Traits::kName, static_cast<int>(self_), "size", size,
                   "size() beyond twice the key space (the key index shown is the size)");
    }
  }

  // for_each: every value checked; this thread's own keys exactly (nobody else writes them,
  // so each present one is visited exactly once with the value its owner wrote).
  void walk(map_type& map) {
    const std::uint64_t floor = clear_floor_now();
    std::vector<std::uint8_t> seen(own_.size(), 0);
    map.for_each([&](const key_type& k, const value_type& v) {
      thread_counters::bump(counters_.verified);
      stamp s;
      if (const fault f = Traits::decode(v, s); f != fault::none) {
        report_error(Traits::kName, static_cast<int>(self_), "for_each", 0,
                     std::string(fault_name(f)) + " under " + Traits::describe(k) +
                         " (the key index is unknown)");
        return;
      }
      if (s.key_index >= plan_.keys || !(Traits::key(s.key_index) == k)) {
        report_error(Traits::kName, static_cast<int>(self_), "for_each", s.key_index,
                     "the value does not belong to the key it was visited under");
        return;
      }
      if (!plan_.writer_allowed(s.key_index, s.writer)) {
        report_error(Traits::kName, static_cast<int>(self_), "for_each", s.key_index,
                     "written by a thread that may not write it");
        return;
      }
      if (!key_plan::owned(s.key_index) || plan_.owner(s.key_index) != self_) return;
      const std::uint64_t slot = plan_.slot(s.key_index);
      if (seen[slot] != 0) {
        report_error(Traits::kName, static_cast<int>(self_), "for_each", s.key_index,
                     "owned key visited twice");
      }
      seen[slot] = 1;
      if (!own_[slot].present || own_[slot].seq != s.seq) {
        report_error(Traits::kName, static_cast<int>(self_), "for_each", s.key_index,
                     "owned key: stale or foreign value");
      }
    });
    count_op();
    for (std::uint64_t slot = 0; slot < own_.size(); ++slot) {
      owned_key& known = own_[slot];
      thread_counters::bump(counters_.exact);
      if (seen[slot] == 0 && known.present && !may_be_cleared(known)) {
        report_error(Traits::kName, static_cast<int>(self_), "for_each",
                     plan_.own_index(self_, slot), "owned key: present but not visited");
      }
      if (seen[slot] != 0) {
        known.clear_floor = floor;
      } else {
        known = owned_key{0, floor, false};
      }
    }
  }

  map_state<Traits>& state_;
  const key_plan& plan_;
  unsigned self_;
  thread_counters& counters_;
  std::uint64_t& seq_;  // the thread's sequence numbers, shared by its two maps
  std::vector<owned_key> own_;
  std::uint64_t for_each_odds_;  // a walk costs about as much as keys / 2 operations
  std::uint64_t steps_ = 0;
};

// --- the quiescent check -------------------------------------------------------------------

// Heartbeat of the main thread's own work, for the watchdog.
std::atomic<std::uint64_t> g_main_beats{0};
void main_beat() {
  // Relaxed: a progress signal for the watchdog.
  g_main_beats.fetch_add(1, std::memory_order_relaxed);
}

// With every worker parked: for_each sees each key once with a valid value, each lookup
// agrees with it, size() equals its count, and every owned key is as its owner believes (and
// the owners' knowledge becomes exact again).
template <class Traits>
void check_quiescent(map_state<Traits>& state, std::vector<map_worker<Traits>*>& workers) {
  using value_type = typename Traits::value_type;
  using key_type = typename Traits::key_type;
  auto& map = *state.map;
  const key_plan& plan = state.plan;
  std::vector<std::uint8_t> seen(plan.keys, 0);
  std::vector<std::uint64_t> seqs(plan.keys, 0);
  std::uint64_t count = 0;
  map.for_each([&](const key_type& k, const value_type& v) {
    ++count;
    stamp s;
    if (const fault f = Traits::decode(v, s); f != fault::none) {
      report_error(Traits::kName, -1, "quiescent for_each", 0,
                   std::string(fault_name(f)) + " under " + Traits::describe(k) +
                       " (the key index is unknown)");
      return;
    }
    if (s.key_index >= plan.keys || !(Traits::key(s.key_index) == k)) {
      report_error(Traits::kName, -1, "quiescent for_each", s.key_index,
                   "the value does not belong to the key it was visited under");
      return;
    }
    if (!plan.writer_allowed(s.key_index, s.writer)) {
      report_error(Traits::kName, -1, "quiescent for_each", s.key_index,
                   "written by a thread that may not write it");
    }
    if (seen[s.key_index] != 0) {
      report_error(Traits::kName, -1, "quiescent for_each", s.key_index, "visited twice");
    }
    seen[s.key_index] = 1;
    seqs[s.key_index] = s.seq;
  });
  if (const std::size_t size = map.size(); size != count) {
    report_error(Traits::kName, -1, "quiescent size", count,
                 "size() is " + std::to_string(size) + ", for_each visited " +
                     std::to_string(count) + " (the key index shown is the count)");
  }
  if (map.empty() != (count == 0)) {
    report_error(Traits::kName, -1, "quiescent empty", count, "empty() disagrees with for_each");
  }
  const hash_map_stats stats = map.stats();
  if (!std::has_single_bit(stats.buckets) || stats.buckets < hash_map_options{}.min_buckets) {
    report_error(Traits::kName, -1, "quiescent stats", stats.buckets,
                 "bucket count is not a power of two >= min_buckets (the key index shown is "
                 "the bucket count)");
  }
  // Relaxed: the workers are parked; the barrier ordered their clears before this.
  const std::uint64_t started = state.clears_started.load(std::memory_order_relaxed);
  const std::uint64_t finished = state.clears_finished.load(std::memory_order_relaxed);
  for (std::uint64_t index = 0; index < plan.keys; ++index) {
    if (index % 4096 == 0) main_beat();
    const key_type k = Traits::key(index);
    const std::optional<value_type> v = map.find(k);
    stamp s;
    if (v.has_value()) {
      if (const fault f = Traits::decode(*v, s); f != fault::none) {
        report_error(Traits::kName, -1, "quiescent find", index, fault_name(f));
        continue;
      }
    }
    if (v.has_value() != (seen[index] != 0) || map.contains(k) != v.has_value()) {
      report_error(Traits::kName, -1, "quiescent lookup", index,
                   "find() and contains() disagree with for_each");
      continue;
    }
    if (v.has_value() && s.seq != seqs[index]) {
      report_error(Traits::kName, -1, "quiescent find", index,
                   "a different value than for_each saw");
    }
    if (!key_plan::owned(index)) continue;
    owned_key& known = workers[plan.owner(index)]->model(plan.slot(index));
    const bool present = seen[index] != 0;
    if (present && (!known.present || known.seq != seqs[index])) {
      report_error(Traits::kName, -1, "quiescent check", index,
                   known.present
                       ? "owned key: stale or foreign value (seq " + std::to_string(seqs[index]) +
                             ", its owner wrote " + std::to_string(known.seq) + ")"
                       : "owned key present that its owner does not have");
    } else if (!present && known.present && started <= known.clear_floor) {
      report_error(Traits::kName, -1, "quiescent check", index, "owned key lost");
    }
    known = owned_key{present ? seqs[index] : 0, finished, present};
  }
}

// --inject-corruption: flips a bit of one stored value in place (every worker parked, so no
// reader races with the write; the element's value is not a const object).
template <class Traits>
void inject_corruption(map_state<Traits>& state) {
  auto& map = *state.map;
  using value_type = typename Traits::value_type;
  bool done = false;
  std::uint64_t index = 0;
  auto corrupt_first = [&] {
    map.for_each([&](const typename Traits::key_type&, const value_type& v) {
      if (done) return;
      stamp s;
      if (Traits::decode(v, s) == fault::none) index = s.key_index;
      Traits::corrupt(const_cast<value_type&>(v));
      done = true;
    });
  };
  corrupt_first();
  if (!done) {  // an empty map: store one value of a shared key first
    (void)map.insert(Traits::key(1), Traits::make(1, 0, 0, 1));
    corrupt_first();
  }
  std::fprintf(stderr,
               "grace-bench soak: --inject-corruption: flipped one bit of the %s value of key "
               "index %llu; the check must now fail\n",
               Traits::kName, static_cast<unsigned long long>(index));
}

// --- threads -------------------------------------------------------------------------------

struct run_control {
  std::atomic<bool> pause{false};
  std::atomic<bool> done{false};
  std::atomic<int> kind{static_cast<int>(phase_kind::fill)};
};

class soak_thread {
 public:
  soak_thread(unsigned self, std::uint64_t seed, map_state<pod_traits>& pod,
              map_state<text_traits>& text)
      : self_(self),
        rng_(seed ^ (0x9e3779b97f4a7c15ULL * (self + 1))),
        pod_(pod, self, counters_, seq_),
        text_(text, self, counters_, seq_) {}

  const thread_counters& counters() const { return counters_; }
  map_worker<pod_traits>& pod() { return pod_; }
  map_worker<text_traits>& text() { return text_; }

  void run(run_control& control, std::barrier<>& sync) {
    const bench_clock::time_point start = bench_clock::now();
    bench_clock::time_point next_clear = start + kClearPeriod;
    bool clear_text = false;
    for (;;) {
      sync.arrive_and_wait();
      // Relaxed: set before the barrier phase this thread just completed.
      if (control.done.load(std::memory_order_relaxed)) return;
      // Relaxed: as above.
      const auto kind = static_cast<phase_kind>(control.kind.load(std::memory_order_relaxed));
      for (unsigned n = 1;; ++n) {
        // Relaxed: a stop request; the barrier below is the synchronization.
        if (n % kPauseCheckEvery == 0 && control.pause.load(std::memory_order_relaxed)) break;
        try {
          if (self_ == 0 && n % kClockCheckEvery == 0 && bench_clock::now() >= next_clear) {
            next_clear = bench_clock::now() + kClearPeriod;
            if (clear_text) {
              text_.clear_map();
            } else {
              pod_.clear_map();
            }
            clear_text = !clear_text;
          }
          if (fast_rng::below(rng_.next(), kTextOneIn) == 0) {
            text_.step(rng_, kind);
          } else {
            pod_.step(rng_, kind);
          }
        } catch (const std::exception& error) {
          report_error("-", static_cast<int>(self_), "exception", 0, error.what());
        }
      }
      sync.arrive_and_wait();
    }
  }

 private:
  unsigned self_;
  fast_rng rng_;
  thread_counters counters_;
  std::uint64_t seq_ = 0;
  map_worker<pod_traits> pod_;
  map_worker<text_traits> text_;
};

struct totals {
  std::uint64_t ops = 0;
  std::uint64_t verified = 0;
  std::uint64_t exact = 0;
};

totals sum_counters(const std::vector<std::unique_ptr<soak_thread>>& threads) {
  totals t;
  for (const auto& thread : threads) {
    t.ops += thread_counters::read(thread->counters().ops);
    t.verified += thread_counters::read(thread->counters().verified);
    t.exact += thread_counters::read(thread->counters().exact);
  }
  return t;
}

// Exits the process (kExitHang) when neither the workers nor the main thread make progress
// for kStallLimit: a hung map operation would otherwise hang the test until CTest kills it.
class watchdog {
 public:
  explicit watchdog(const std::vector<std::unique_ptr<soak_thread>>& threads)
      : threads_(threads), thread_([this] { run(); }) {}
  ~watchdog() {
    // Relaxed: a stop request; the join is the synchronization.
    stop_.store(true, std::memory_order_relaxed);
    thread_.join();
  }
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

 private:
  void run() {
    std::uint64_t last = ~std::uint64_t{0};
    bench_clock::time_point since = bench_clock::now();
    // Relaxed: a stop request.
    while (!stop_.load(std::memory_order_relaxed)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      // Relaxed: a progress signal.
      const std::uint64_t beat =
          sum_counters(threads_).ops + g_main_beats.load(std::memory_order_relaxed);
      const bench_clock::time_point now = bench_clock::now();
      if (beat != last) {
        last = beat;
        since = now;
        continue;
      }
      if (now - since < kStallLimit) continue;
      std::fprintf(stderr,
                   "grace-bench soak: ERROR no progress for %lld s (a hang); ops per "
                   "thread:",
                   static_cast<long long>(kStallLimit.count()));
      for (const auto& thread : threads_) {
        std::fprintf(
            stderr, " %llu",
            static_cast<unsigned long long>(thread_counters::read(thread->counters().ops)));
      }
      std::fprintf(stderr, "\n");
      std::fflush(stderr);
      std::_Exit(kExitHang);
    }
  }

  const std::vector<std::unique_ptr<soak_thread>>& threads_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// --- the run -------------------------------------------------------------------------------

double mib(std::uint64_t bytes) { return static_cast<double>(bytes) / kBytesPerMib; }

unsigned default_threads() { return 2 * std::max(1u, std::thread::hardware_concurrency()); }

void describe(options_spec& spec) {
  spec.add_number("minutes", kDefaultMinutes, "how long to run, in minutes (fractions allowed)", 0,
                  100'000);
  spec.add_number("seconds", 0, "how long to run, in seconds; overrides --minutes", 0, 6'000'000);
  spec.set_default_text("seconds", "from --minutes");
  spec.add_count("threads", default_threads(), "worker threads", 1, kMaxThreads);
  spec.set_default_text("threads", "2 x hardware threads = " + std::to_string(default_threads()));
  spec.add_count("keys", kDefaultKeys, "key indices of the pod map (the text map has a quarter)",
                 kMinKeys, kMaxKeys);
  spec.add_number("phase-seconds", kDefaultPhaseSeconds,
                  "length of a fill or drain phase; the maps are checked between phases", 0.05,
                  3600);
  spec.add_count("max-rss-mib", 0, "RSS ceiling in MiB; above it the run fails (exit 3)", 1);
  spec.set_default_text("max-rss-mib", "RSS at start + 192 + --keys / 1024");
  spec.add_count("seed", 1, "seed of the workers' random choices");
  spec.add_flag("inject-corruption",
                "self-check: corrupt one stored value at the first check, which must then "
                "fail (exit 1)");
  spec.set_epilogue(
      "Every hash_map operation from --threads threads (more than cores) on two maps, every\n"
      "value read checksummed, owned keys checked exactly, the quiescent maps checked between\n"
      "phases; exit 0 only if nothing failed. A progress line every 10 s, a summary at the end.\n"
      "Details: the comment at the top of bench/map/soak_mode.cc.\n"
      "Examples:\n"
      "  grace-bench soak --minutes 2\n"
      "  grace-bench soak --seconds 20 --threads 8 --keys 1M");
}

int run(const parsed_options& options, reporter& out) {
  if (options.given("minutes") && options.given("seconds")) {
    throw usage_error("give --minutes or --seconds, not both");
  }
  const double duration_s =
      options.given("seconds") ? options.number("seconds") : options.number("minutes") * 60.0;
  if (!(duration_s > 0)) throw usage_error("the run must last more than 0 seconds");
  const auto threads = static_cast<unsigned>(options.count("threads"));
  const std::uint64_t keys = options.count("keys");
  const double phase_s = options.number("phase-seconds");
  const bool inject = options.flag("inject-corruption");

  rss_sampler rss;
  const std::uint64_t rss_start = current_rss_bytes();
  const std::uint64_t ceiling =
      options.given("max-rss-mib")
          ? options.count("max-rss-mib") * static_cast<std::uint64_t>(kBytesPerMib)
          : rss_start + static_cast<std::uint64_t>(kCeilingBaseMib * kBytesPerMib) +
                kCeilingBytesPerKey * keys;

  map_state<pod_traits> pod;
  pod.plan = key_plan{keys, threads};
  pod.build(hash_map_options{}.initial_buckets, element_destruction::on_reclaim_worker);
  map_state<text_traits> text;
  text.plan = key_plan{keys / kTextKeyDivisor, threads};
  text.build(hash_map_options{}.initial_buckets, element_destruction::on_reclaim_worker);

  std::vector<std::unique_ptr<soak_thread>> workers;
  for (unsigned t = 0; t < threads; ++t) {
    workers.push_back(std::make_unique<soak_thread>(t, options.count("seed"), pod, text));
  }
  std::vector<map_worker<pod_traits>*> pod_workers;
  std::vector<map_worker<text_traits>*> text_workers;
  for (auto& w : workers) {
    pod_workers.push_back(&w->pod());
    text_workers.push_back(&w->text());
  }

  std::fprintf(stderr,
               "grace-bench soak: %u threads, %.1f s, %llu + %llu keys, phases of %.2f s, RSS "
               "ceiling %.0f MiB (%.0f MiB at start)\n",
               threads, duration_s, static_cast<unsigned long long>(keys),
               static_cast<unsigned long long>(text.plan.keys), phase_s, mib(ceiling),
               mib(rss_start));

  run_control control;
  std::barrier<> sync(static_cast<std::ptrdiff_t>(threads) + 1);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] { workers[t]->run(control, sync); });
  }
  watchdog dog(workers);

  const bench_clock::time_point start = bench_clock::now();
  const bench_clock::time_point end = start + std::chrono::duration_cast<bench_clock::duration>(
                                                  std::chrono::duration<double>(duration_s));
  const auto phase =
      std::chrono::duration_cast<bench_clock::duration>(std::chrono::duration<double>(phase_s));
  bench_clock::time_point next_progress = start + kProgressPeriod;
  bench_clock::time_point last_progress = start;
  std::uint64_t last_progress_ops = 0;
  std::uint64_t phases = 0;
  std::uint64_t checks = 0;
  std::uint64_t rebuilds = 0;
  bool over_ceiling = false;
  std::uint64_t over_ceiling_bytes = 0;

  auto grace_periods = [&] { return pod.map->stats().reclamation.grace_periods; };
  auto clears = [&] {
    // Relaxed: a statistic.
    return pod.clears_finished.load(std::memory_order_relaxed) +
           text.clears_finished.load(std::memory_order_relaxed);
  };
  auto emit_progress = [&](bench_clock::time_point now) {
    const totals t = sum_counters(workers);
    const std::uint64_t now_rss = current_rss_bytes();
    const hash_map_stats ps = pod.map->stats();
    const hash_map_stats ts = text.map->stats();
    result r;
    r.add("bench", "soak").add("event", "progress");
    r.add("elapsed_s", seconds_between(start, now), 1);
    r.add("phase", phases).add("kind", phases % 2 == 0 ? "fill" : "drain");
    r.add("ops", t.ops);
    r.add("ops_per_s",
          static_cast<double>(t.ops - last_progress_ops) / seconds_between(last_progress, now), 0);
    r.add("verified", t.verified).add("exact", t.exact).add("errors", error_count());
    r.add("rss_mib", mib(now_rss), 1).add("peak_rss_mib", mib(rss.peak_bytes()), 1);
    r.add("pod_size", ps.size).add("pod_buckets", ps.buckets);
    r.add("text_size", ts.size).add("text_buckets", ts.buckets);
    r.add("grows", pod.grows() + text.grows()).add("shrinks", pod.shrinks() + text.shrinks());
    r.add("clears", clears()).add("rebuilds", rebuilds);
    r.add("grace_periods", ps.reclamation.grace_periods);
    out.emit(r);
    last_progress = now;
    last_progress_ops = t.ops;
  };

  for (;;) {
    const bench_clock::time_point phase_end = std::min(end, bench_clock::now() + phase);
    // Relaxed: the barrier below publishes them to the workers.
    control.kind.store(static_cast<int>(phases % 2 == 0 ? phase_kind::fill : phase_kind::drain),
                       std::memory_order_relaxed);
    control.pause.store(false, std::memory_order_relaxed);
    sync.arrive_and_wait();  // the workers start the phase
    for (;;) {
      const bench_clock::time_point now = bench_clock::now();
      if (now >= next_progress) {
        emit_progress(now);
        next_progress += kProgressPeriod;
      }
      if (const std::uint64_t peak = rss.peak_bytes(); peak > ceiling) {
        over_ceiling = true;
        over_ceiling_bytes = peak;
        break;
      }
      if (now >= phase_end || error_count() != 0) break;
      std::this_thread::sleep_for(std::min<bench_clock::duration>(kTick, phase_end - now));
    }
    // Relaxed: a stop request; the barrier is the synchronization.
    control.pause.store(true, std::memory_order_relaxed);
    sync.arrive_and_wait();  // every worker parked
    ++phases;
    main_beat();

    if (inject && checks == 0) inject_corruption(pod);
    check_quiescent(pod, pod_workers);
    check_quiescent(text, text_workers);
    ++checks;
    main_beat();

    const bool finished = over_ceiling || error_count() != 0 || bench_clock::now() >= end;
    if (finished) break;
    if (checks % kRebuildEvery == 0) {
      // Destroy and build again: the destructor's bulk release, a fresh pool and table.
      constexpr std::size_t kInitialBuckets[] = {64, 1024, 1 << 16};
      const std::size_t initial = kInitialBuckets[rebuilds % 3];
      pod.build(initial, element_destruction::on_reclaim_worker);
      text.build(initial, rebuilds % 2 == 0 ? element_destruction::by_updaters
                                            : element_destruction::on_reclaim_worker);
      // Relaxed: the workers are parked; the barrier ordered their clears before this.
      const std::uint64_t pod_floor = pod.clears_finished.load(std::memory_order_relaxed);
      const std::uint64_t text_floor = text.clears_finished.load(std::memory_order_relaxed);
      for (auto& w : workers) {
        w->pod().forget_all(pod_floor);
        w->text().forget_all(text_floor);
      }
      ++rebuilds;
      main_beat();
    }
  }
  // Relaxed: the barrier publishes it.
  control.done.store(true, std::memory_order_relaxed);
  sync.arrive_and_wait();
  for (std::thread& thread : pool) thread.join();

  const bench_clock::time_point stop = bench_clock::now();
  const double seconds = seconds_between(start, stop);
  const totals t = sum_counters(workers);
  const std::uint64_t peak = rss.peak_bytes();
  const std::uint64_t errors = error_count();
  const char* verdict = errors != 0 ? "fail" : over_ceiling ? "over_memory_ceiling" : "pass";
  result r;
  r.add("bench", "soak").add("event", "summary").add("threads", std::uint64_t{threads});
  r.add("keys", keys).add("seconds", seconds, 1).add("phases", phases);
  r.add("ops", t.ops).add("ops_per_s", static_cast<double>(t.ops) / seconds, 0);
  r.add("verified", t.verified).add("exact", t.exact).add("quiescent_checks", checks);
  r.add("errors", errors);
  r.add("peak_rss_mib", mib(peak), 1).add("max_rss_mib", mib(ceiling), 1);
  r.add("grows", pod.grows() + text.grows()).add("shrinks", pod.shrinks() + text.shrinks());
  r.add("clears", clears()).add("rebuilds", rebuilds).add("grace_periods", grace_periods());
  r.add("result", verdict);
  out.emit(r);

  if (over_ceiling) {
    std::fprintf(stderr, "grace-bench soak: ERROR RSS %.1f MiB is above the ceiling %.1f MiB\n",
                 mib(over_ceiling_bytes), mib(ceiling));
  }
  if (errors != 0) {
    std::fprintf(stderr, "grace-bench soak: FAILED with %llu errors\n",
                 static_cast<unsigned long long>(errors));
    return kExitFailed;
  }
  return over_ceiling ? kExitMemory : 0;
}

[[maybe_unused]] const bool kRegistered = register_subcommand(
    {"soak", "correctness soak: every hash_map operation, checksummed values, memory ceiling",
     describe, run});

}  // namespace
}  // namespace grace::bench
