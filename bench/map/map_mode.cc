// `grace-bench map`: grace::hash_map beside peer concurrent maps on the Linux htab-mem use
// cases (tools/testing/selftests/bpf/benchs/bench_htab_mem.c) and on lookup / mixed loads,
// all maps in one run, the same templated loop for each (map/map_adapters.h).
//
// Use cases (keys uint64_t, values 64 bytes that encode their key; every read checks it):
//   overwrite            htab-mem: thread t owns keys t, t+p, ..., t+63p (filled before the
//                        timed phase); each batch upserts (insert_or_assign, BPF_ANY) its 64
//                        keys. One batch = 1 op.
//   batch_add_batch_del  htab-mem: each batch upserts the thread's 64 keys (absent), then
//                        erases them. = 2 ops (htab-mem's op_cnt += 2).
//   add_del_on_diff_cpu  htab-mem: threads in pairs (q = t/2, keys q, q+p/2, ...): the even
//                        thread inserts the 64 keys (insert if absent, BPF_NOEXIST), the odd
//                        one erases them, alternating through a two-thread hand-over that
//                        spins, then yields (pair_handover), so allocation and free happen on
//                        different threads. Each side's batch = 1 op. Needs an even number
//                        of producers.
//   lookup               N keys present (N = 10k and 1M, or --keys); uniform random visits.
//   mixed                N keys, half present at the start; per operation 90% visit, 5%
//                        insert if absent, 5% erase, uniform random keys.
//   footprint            RSS growth from filling an empty map with --footprint-keys keys.
//   destroy              time to destroy a grace map of --destroy-elements elements.
// htab-mem's capacity hint max(8192, 64 x producers) is given to every map for the htab-mem
// cases (grace: reserve(); cds_lfht: init_size; absl: reserve(); tbb / libcuckoo: their
// constructor); the other cases hint N.
//
// Measurement (timed cases): the map is built and filled first (fill_mib = RSS growth from
// before building it, after malloc_trim). Then the p producers start together; the first
// --warmup seconds are not counted; over the next --duration seconds the main thread takes
// a sample every 100 ms: the batches all producers completed and the RSS relative to the
// RSS just before the producers started.
//   per_prod_op_kps  batches (htab-mem "op": 64 element operations) per producer per second,
//                    in thousands, over the whole measured window
//   stddev_kps       sample standard deviation of that rate over the 100 ms samples (htab-mem
//                    takes it over 1 s samples)
//   elem_mops        element operations per second, all producers together, in millions
//   avg_mem_mib, mem_stddev_mib  mean and standard deviation of the 100 ms RSS samples
//   peak_mem_mib     the highest RSS seen from the producers' start to their end (warm-up
//                    included; read every 10 ms), relative as above
//   fill_mib         RSS growth from building and filling the map
//   cpu_cores        CPU time of the whole process in the window / the window: about p when
//                    the producers had their cores (less: they slept or another process
//                    took a core; more: helper threads such as grace's engine or liburcu's
//                    call_rcu worker ran too)
//   add_batch_us, del_batch_us  add_del_on_diff_cpu: wall-clock microseconds an adder (a
//                    deleter) spends inside one batch of 64 inserts (erases), hand-overs
//                    excluded, averaged over the window and the pairs that ran a batch in it
//                    (na if none did): which side of the exchange a map pays on. Time a
//                    helper thread (grace's engine, liburcu's call_rcu worker) took the
//                    producer's core for counts too.
//   errors           reads that found a wrong value or missed a key that must be present,
//                    updates whose outcome contradicts the use case (overwrite inserting,
//                    an add or delete of an owned key failing), fill inserts that failed,
//                    and the after-run check (the overwrite keys all present and correct;
//                    batch / add_del keys all gone)
//   read_sections    batch: the RCU maps (grace, cds_lfht) ran each htab-mem batch inside
//                    one read section, as the kernel's BPF program runs its 64 operations
//                    under one rcu_read_lock(); operation: one per operation (--read-sections
//                    operation; always for lookup and mixed, whose operations stand alone);
//                    none: a map without read sections (absl, oneTBB, libcuckoo)
//   worker_nice      grace: its reclaim worker's nice value (--grace-worker-nice; 0: the
//                    global domain's worker, at the process's nice value); na for the others
//   destruction      grace: where erased and replaced elements with a destructor are
//                    destroyed (--grace-destruction: on_reclaim_worker, by_updaters); na for
//                    the others
//   fast_path        grace: how its element pool's allocate() and deallocate() take their
//                    CPU's cache (--grace-fast-path: rseq, a restartable sequence where the
//                    machine offers one, or held, an exchange on the cache's flag); na for
//                    the others
//   hash             (timed and footprint lines) the map's hash function: absl (absl::Hash:
//                    grace, cds_lfht, absl, and oneTBB and libcuckoo under --peer-hash absl)
//                    or std (std::hash, the identity on an integer key in libstdc++ and
//                    libc++: oneTBB's and libcuckoo's defaults; see map_adapters.h, "Hashes")
//   peer_hash        (timed and footprint lines) the run's --peer-hash, std or absl, so that
//                    the lines of two runs that differ only there stay apart
//   value            fixed64: 64-byte trivially copyable values (value64, the default);
//                    string: the same 64 bytes in a std::string (--value string), so every
//                    stored value owns heap memory, and grace's elements then have a
//                    destructor (see destruction; footprint and destroy rows carry it too)
// footprint: resident_mib (RSS growth after filling), bytes_per_key. destroy: ns_per_element
// and destroy_ms (the destructor, on a helper thread), fill_s, fill_mib, left_mib (RSS after
// the destructor and malloc_trim, relative to before the map was built).
// RSS here is resident anonymous memory (statm resident - shared; see anon_rss_bytes()).
// Before each baseline the heap is trimmed (malloc_trim; oneTBB: its tbbmalloc caches too).
// Any error makes the subcommand exit with status 1. --grace-stats prints grace's resize,
// grace-period and pool counters for each timed grace case to stderr.
//
// Processes: each job (one map on one use case and key count) runs in a fresh grace-bench
// process (`map --in-process` with the job's options), whose result lines the parent
// forwards: no heap, allocator cache, call_rcu backlog or grace domain carries over from one
// job into the next one's memory figures. --in-process runs every job in one process (for
// valgrind and debuggers).
// Rounds: --rounds N (N > 1) runs the whole job list N times, round after round, so a slow
// spell of a shared machine falls on every map alike; each line then ends in round=K. After
// the last round comes one summary line per job (rounds=N at its end): the fields of its
// first round, in order, each number the median over the rounds (errors: the sum), with
// kps_min and kps_max (the range of per_prod_op_kps) and grace_ratio (grace's median
// per_prod_op_kps on the same use case and keys over this map's; grace's own line has 1.00).
// The htab-mem style lines then show the medians.
// Threads: every map operation runs on a thread holding the map's thread_scope (cds_lfht's
// liburcu registration); the fill, the after-run check and the map's destruction run on
// helper threads, so the main thread never registers with liburcu twice.
#include <fcntl.h>
#include <malloc.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "map/map_adapters.h"
#include "map/map_value.h"
#include "tool/affinity.h"
#include "tool/latency.h"
#include "tool/rss_sampler.h"
#include "tool/start_gate.h"
#include "tool/subcommand.h"

namespace grace::bench {
namespace {

constexpr unsigned kBatch = 64;  // htab-mem's OP_BATCH
constexpr std::uint64_t kMinCapacityHint = 8192;
constexpr std::chrono::milliseconds kSamplePeriod{100};
constexpr std::uint64_t kDefaultProducers = 2;
constexpr std::uint64_t kMaxProducers = 256;
constexpr double kDefaultWarmupS = 1;
constexpr double kDefaultDurationS = 3;
constexpr std::uint64_t kSmallKeys = 10'000;
constexpr std::uint64_t kLargeKeys = 1'000'000;
constexpr std::uint64_t kDefaultFootprintKeys = 1'000'000;
constexpr std::uint64_t kDefaultDestroyElements = 10'000'000;
constexpr std::uint64_t kMaxKeys = std::uint64_t{1} << 31;  // fast_rng::below()
constexpr unsigned kMaxErrorMessages = 10;

// add_del_on_diff_cpu's hand-over between the two threads of a pair: two arrivals end a
// phase. Each side spins while its partner finishes a batch (a few microseconds; the 4096
// pauses last ~0.1-0.2 ms), then yields its core. It never sleeps in the kernel: a futex
// wake-up per batch (std::barrier's) cost more than the batch and drowned the maps'
// differences.
class pair_handover {
 public:
  void arrive_and_wait() noexcept {
    // AcqRel: publishes this side's batch and `done`, and sees the partner's if it arrived
    // first; pairs with the partner's fetch_add and with the Acquire loads below.
    const std::uint64_t before = arrivals_.fetch_add(1, std::memory_order_acq_rel);
    const std::uint64_t phase_end = (before / 2 + 1) * 2;
    // Acquire: the partner's arrival, with everything it wrote before it.
    for (unsigned spins = 0; arrivals_.load(std::memory_order_acquire) < phase_end;) {
      if (spins < kSpinsBeforeYield) {
        ++spins;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr unsigned kSpinsBeforeYield = 4096;
  std::atomic<std::uint64_t> arrivals_{0};
};

enum class use_case {
  overwrite,
  batch_add_batch_del,
  add_del_on_diff_cpu,
  lookup,
  mixed,
  footprint,
  destroy
};
constexpr use_case kAllUseCases[] = {use_case::overwrite,
                                     use_case::batch_add_batch_del,
                                     use_case::add_del_on_diff_cpu,
                                     use_case::lookup,
                                     use_case::mixed,
                                     use_case::footprint,
                                     use_case::destroy};

const char* use_case_name(use_case u) {
  switch (u) {
    case use_case::overwrite:
      return "overwrite";
    case use_case::batch_add_batch_del:
      return "batch_add_batch_del";
    case use_case::add_del_on_diff_cpu:
      return "add_del_on_diff_cpu";
    case use_case::lookup:
      return "lookup";
    case use_case::mixed:
      return "mixed";
    case use_case::footprint:
      return "footprint";
    case use_case::destroy:
      return "destroy";
  }
  return "?";
}

struct config {
  unsigned producers = 2;
  double warmup_s = kDefaultWarmupS;
  double duration_s = kDefaultDurationS;
  std::vector<std::uint64_t> key_counts;  // lookup and mixed
  std::uint64_t footprint_keys = kDefaultFootprintKeys;
  std::uint64_t destroy_elements = kDefaultDestroyElements;
  bool affinity = false;
  bool grace_stats = false;  // print grace's own counters per timed case to stderr
  // htab-mem cases: one read section per batch of 64 (the BPF program's), or per operation.
  bool batch_read_sections = true;
  bool string_values = false;  // std::string values (--value string), not value64
  int grace_worker_nice = 0;   // grace's reclaim worker (--grace-worker-nice)
  // grace's element destruction (--grace-destruction)
  grace::element_destruction grace_destruction = grace::element_destruction::on_reclaim_worker;
  bool grace_restartable_sequences = true;  // grace's pool fast paths (--grace-fast-path)
  bool peer_absl_hash = false;  // oneTBB and libcuckoo hash with absl::Hash (--peer-hash)
};

const char* value_name(bool string_values) { return string_values ? "string" : "fixed64"; }
template <class Map>
const char* value_name_of() {
  return value_name(std::is_same_v<typename Map::value_type, std::string>);
}

const char* read_sections_name(bool per_batch) { return per_batch ? "batch" : "operation"; }
// What a result line's read_sections= says: none for the maps without read sections.
template <class Map>
const char* read_sections_of(bool per_batch) {
  return Map::kReadSections ? read_sections_name(per_batch) : "none";
}

// The read section of one htab-mem batch (Map::batch_scope), unless --read-sections
// operation leaves every operation to take its own.
template <class Map>
class batch_section {
 public:
  explicit batch_section(const config& cfg) {
    if (cfg.batch_read_sections) scope_.emplace();
  }

 private:
  std::optional<typename Map::batch_scope> scope_;
};

// --- errors --------------------------------------------------------------------------------

std::atomic<unsigned> g_error_messages{0};

[[gnu::cold, gnu::noinline]] void report_error(const char* map, const char* what,
                                               std::uint64_t key) {
  // Relaxed: only limits how many messages are printed.
  if (g_error_messages.fetch_add(1, std::memory_order_relaxed) < kMaxErrorMessages) {
    std::fprintf(stderr, "grace-bench map: ERROR map=%s: %s (key %llu)\n", map, what,
                 static_cast<unsigned long long>(key));
  }
}

// --- threads -------------------------------------------------------------------------------

// Runs f() on a fresh thread that holds Map's thread_scope, and waits for it.
template <class Map, class F>
void on_map_thread(F&& f) {
  std::thread([&f] {
    [[maybe_unused]] typename Map::thread_scope scope;
    f();
  }).join();
}

// Runs f(t) for t in [0, n) on n fresh threads holding Map's thread_scope, and waits.
template <class Map, class F>
void on_map_threads(unsigned n, F f) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (unsigned t = 0; t < n; ++t) {
    threads.emplace_back([&f, t] {
      [[maybe_unused]] typename Map::thread_scope scope;
      f(t);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// The map, built and destroyed on threads holding its thread_scope.
template <class Map>
class map_holder {
 public:
  explicit map_holder(std::size_t capacity_hint) {
    on_map_thread<Map>([&] { map_ = std::make_unique<Map>(capacity_hint); });
  }
  ~map_holder() { reset(); }
  map_holder(const map_holder&) = delete;
  map_holder& operator=(const map_holder&) = delete;

  Map& operator*() const { return *map_; }
  void reset() {
    if (!map_) return;
    on_map_thread<Map>([&] { map_.reset(); });
    Map::release_cached_memory();
  }

 private:
  std::unique_ptr<Map> map_;
};

// Fills keys key_of(i) for i in [0, n) with i % stride == 0, on `threads` threads; returns
// the inserts that failed (distinct keys: each must succeed).
template <class Map>
std::uint64_t fill(Map& map, std::uint64_t n, std::uint64_t stride, unsigned threads) {
  if (!Map::kConcurrent) threads = 1;
  std::atomic<std::uint64_t> errors{0};
  on_map_threads<Map>(threads, [&](unsigned t) {
    std::uint64_t failed = 0;
    for (std::uint64_t i = std::uint64_t{t} * stride; i < n; i += std::uint64_t{threads} * stride) {
      const std::uint64_t key = key_of(i);
      if (!map.insert(key, value_for<typename Map::value_type>(key))) [[unlikely]] {
        report_error(Map::kName, "fill: insert of a new key failed", key);
        ++failed;
      }
    }
    // Relaxed: read after join.
    errors.fetch_add(failed, std::memory_order_relaxed);
  });
  // Relaxed: the joins ordered the adds.
  return errors.load(std::memory_order_relaxed);
}

// --- memory --------------------------------------------------------------------------------

// The peak of anon_rss_bytes(), read every 10 ms by a background thread (as
// tool/rss_sampler.h does for total RSS).
class anon_peak_sampler {
 public:
  anon_peak_sampler() : thread_([this] { run(); }) {}
  ~anon_peak_sampler() {
    // Relaxed: a stop request; the join is the synchronization.
    stop_.store(true, std::memory_order_relaxed);
    thread_.join();
  }
  anon_peak_sampler(const anon_peak_sampler&) = delete;
  anon_peak_sampler& operator=(const anon_peak_sampler&) = delete;

  void reset_peak() noexcept {
    std::lock_guard lock(mutex_);
    peak_ = anon_rss_bytes();
  }
  std::uint64_t peak_bytes() noexcept {
    sample();
    std::lock_guard lock(mutex_);
    return peak_;
  }

 private:
  void sample() noexcept {
    // Read under the mutex, so a read taken before reset_peak() never lands after it.
    std::lock_guard lock(mutex_);
    peak_ = std::max(peak_, anon_rss_bytes());
  }
  void run() noexcept {
    // Relaxed: a stop request; the join in the destructor is the synchronization.
    while (!stop_.load(std::memory_order_relaxed)) {
      sample();
      std::this_thread::sleep_for(kRssSamplePeriod);
    }
  }

  std::mutex mutex_;
  std::uint64_t peak_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Trims the heap and returns the resident memory: a baseline that freed memory of earlier
// runs does not hide growth in.
std::uint64_t trimmed_rss() {
  malloc_trim(0);
  return anon_rss_bytes();
}

double mib(double bytes) { return bytes / kBytesPerMib; }
double signed_mib(std::uint64_t now, std::uint64_t base) {
  return mib(static_cast<double>(static_cast<std::int64_t>(now - base)));
}

// --- grace's own counters (--grace-stats) -------------------------------------------------

// Snapshots grace's map and domain counters when the timed phase starts and prints what
// changed when it ends (stderr, `#` lines): how the map resized, how many grace periods ran,
// and what the element pool did. A no-op for the other maps.
template <class Map>
class grace_stats_probe {
 public:
  grace_stats_probe(const config&, Map&, const char*, std::uint64_t) {}
  void start() {}
  void finish() {}
};

template <class Value>
class grace_stats_probe<grace_map_of<Value>> {
 public:
  grace_stats_probe(const config& cfg, grace_map_of<Value>& map, const char* use_case,
                    std::uint64_t keys)
      : enabled_(cfg.grace_stats), map_(map), use_case_(use_case), keys_(keys) {}
  void start() {
    if (enabled_) before_ = map_.raw().stats();
  }
  void finish() {
    if (!enabled_) return;
    const hash_map_stats after = map_.raw().stats();
    std::fprintf(
        stderr,
        "# grace use_case=%s keys=%llu: size=%llu buckets=%llu grows=+%llu "
        "shrinks=+%llu grace_periods=+%llu batches=+%llu batches_without_own_gp=+%llu "
        "pool: allocated=+%llu fresh=+%llu "
        "reused_from_chunks=+%llu reused_after_gp=+%llu waiting_for_gp=%llu held_mib=%.2f "
        "peak_held_mib=%.2f\n",
        use_case_, static_cast<unsigned long long>(keys_),
        static_cast<unsigned long long>(after.size), static_cast<unsigned long long>(after.buckets),
        static_cast<unsigned long long>(after.grows - before_.grows),
        static_cast<unsigned long long>(after.shrinks - before_.shrinks),
        static_cast<unsigned long long>(after.reclamation.grace_periods -
                                        before_.reclamation.grace_periods),
        static_cast<unsigned long long>(after.reclamation.batches - before_.reclamation.batches),
        static_cast<unsigned long long>(after.reclamation.batches_without_own_gp -
                                        before_.reclamation.batches_without_own_gp),
        static_cast<unsigned long long>(after.pool.allocated - before_.pool.allocated),
        static_cast<unsigned long long>(after.pool.fresh - before_.pool.fresh),
        static_cast<unsigned long long>(after.pool.reused_from_chunks -
                                        before_.pool.reused_from_chunks),
        static_cast<unsigned long long>(after.pool.reused_after_gp - before_.pool.reused_after_gp),
        static_cast<unsigned long long>(after.pool.waiting_for_gp),
        mib(static_cast<double>(after.pool.held_bytes)),
        mib(static_cast<double>(after.pool.peak_held_bytes)));
  }

 private:
  bool enabled_;
  grace_map_of<Value>& map_;
  const char* use_case_;
  std::uint64_t keys_;
  hash_map_stats before_;
};

// --- the timed phase -----------------------------------------------------------------------

// One producer's counters, written only by that producer.
struct alignas(64) worker_slot {
  std::atomic<std::uint64_t> ops{0};  // htab-mem ops (64-element batches)
  // Nanoseconds spent inside batches, where a use case times them (add_del_on_diff_cpu: its
  // hand-overs are not map work).
  std::atomic<std::uint64_t> busy_ns{0};
  std::uint64_t errors = 0;  // read by the main thread after join

  void add_ops(std::uint64_t n) noexcept { add(ops, n); }
  void add_busy(bench_clock::duration d) noexcept {
    add(busy_ns, static_cast<std::uint64_t>(
                     std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()));
  }

 private:
  static void add(std::atomic<std::uint64_t>& counter, std::uint64_t n) noexcept {
    // Relaxed: a statistics counter with a single writer, sampled by the main thread.
    counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
};

struct timed_stats {
  double seconds = 0;     // the measured window
  double cpu_cores = 0;   // this process's CPU time in the window / the window
  std::uint64_t ops = 0;  // in the window, all producers
  double rate_mean_kps = 0;
  double rate_stddev_kps = 0;
  double mem_mean_mib = 0;
  double mem_stddev_mib = 0;
  double peak_mib = 0;
  std::uint64_t errors = 0;
  // Per producer, in the window: microseconds per batch inside timed batches (add_busy()),
  // 0 where the use case times none.
  std::vector<double> batch_us;
};

// CPU time of every thread of this process so far.
double process_cpu_seconds() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

void mean_stddev(const std::vector<double>& xs, double& mean, double& stddev) {
  mean = 0;
  stddev = 0;
  if (xs.empty()) return;
  for (double x : xs) mean += x;
  mean /= static_cast<double>(xs.size());
  if (xs.size() < 2) return;
  for (double x : xs) stddev += (x - mean) * (x - mean);
  stddev = std::sqrt(stddev / static_cast<double>(xs.size() - 1));
}

// Starts `threads` producers running body(t, slot, stop) together, samples them as described
// at the top, stops and joins them.
template <class Map, class Body>
timed_stats run_timed(const config& cfg, unsigned threads, anon_peak_sampler& rss,
                      grace_stats_probe<Map>& probe, Body body) {
  std::unique_ptr<worker_slot[]> slots(new worker_slot[threads]);
  std::atomic<bool> stop{false};
  start_gate gate(static_cast<std::ptrdiff_t>(threads));
  auto total_ops = [&] {
    std::uint64_t sum = 0;
    // Relaxed: an approximate snapshot is what a sample is.
    for (unsigned t = 0; t < threads; ++t) sum += slots[t].ops.load(std::memory_order_relaxed);
    return sum;
  };

  malloc_trim(0);
  probe.start();
  const std::uint64_t rss_before = anon_rss_bytes();
  rss.reset_peak();
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      if (cfg.affinity) pin_to_cpu(t);
      [[maybe_unused]] typename Map::thread_scope scope;
      gate.arrive_and_wait();
      body(t, slots[t], stop);
    });
  }

  const bench_clock::time_point start = gate.open();
  const auto warm_end = start + std::chrono::duration_cast<bench_clock::duration>(
                                    std::chrono::duration<double>(cfg.warmup_s));
  std::this_thread::sleep_until(warm_end);
  const std::size_t samples = std::max<std::size_t>(
      1, static_cast<std::size_t>(
             std::llround(cfg.duration_s * 1000.0 / static_cast<double>(kSamplePeriod.count()))));
  const auto period = std::chrono::duration_cast<bench_clock::duration>(
      std::chrono::duration<double>(cfg.duration_s / static_cast<double>(samples)));
  std::vector<double> rates_kps;
  std::vector<double> mem_mib;
  rates_kps.reserve(samples);
  mem_mib.reserve(samples);
  const double cpu_start = process_cpu_seconds();
  bench_clock::time_point prev_time = bench_clock::now();
  const bench_clock::time_point window_start = prev_time;
  // Relaxed, both: approximate snapshots, as total_ops().
  std::vector<std::uint64_t> start_busy_ns(threads), start_slot_ops(threads);
  std::uint64_t window_start_ops = 0;
  for (unsigned t = 0; t < threads; ++t) {
    start_busy_ns[t] = slots[t].busy_ns.load(std::memory_order_relaxed);
    start_slot_ops[t] = slots[t].ops.load(std::memory_order_relaxed);
    window_start_ops += start_slot_ops[t];
  }
  std::uint64_t prev_ops = window_start_ops;
  for (std::size_t k = 1; k <= samples; ++k) {
    std::this_thread::sleep_until(warm_end + period * static_cast<long>(k));
    const bench_clock::time_point now = bench_clock::now();
    const std::uint64_t ops = total_ops();
    mem_mib.push_back(signed_mib(anon_rss_bytes(), rss_before));
    rates_kps.push_back(static_cast<double>(ops - prev_ops) / threads /
                        seconds_between(prev_time, now) / 1e3);
    prev_time = now;
    prev_ops = ops;
  }
  const std::uint64_t window_ops = prev_ops - window_start_ops;
  std::vector<double> batch_us(threads, 0.0);  // 0: no timed batch in the window
  for (unsigned t = 0; t < threads; ++t) {
    // Relaxed: as above.
    const std::uint64_t busy = slots[t].busy_ns.load(std::memory_order_relaxed) - start_busy_ns[t];
    const std::uint64_t batches = slots[t].ops.load(std::memory_order_relaxed) - start_slot_ops[t];
    if (batches != 0) batch_us[t] = static_cast<double>(busy) / static_cast<double>(batches) / 1e3;
  }
  const double window_s = seconds_between(window_start, prev_time);
  const double cpu_s = process_cpu_seconds() - cpu_start;
  // Relaxed: a stop request; the joins below are the synchronization.
  stop.store(true, std::memory_order_relaxed);
  for (std::thread& worker : workers) worker.join();
  const std::uint64_t peak = rss.peak_bytes();
  probe.finish();

  timed_stats s;
  s.seconds = window_s;
  s.cpu_cores = cpu_s / window_s;
  s.ops = window_ops;
  double unused_mean = 0;
  mean_stddev(rates_kps, unused_mean, s.rate_stddev_kps);
  s.rate_mean_kps = static_cast<double>(window_ops) / threads / window_s / 1e3;
  mean_stddev(mem_mib, s.mem_mean_mib, s.mem_stddev_mib);
  s.peak_mib = peak > rss_before ? mib(static_cast<double>(peak - rss_before)) : 0.0;
  for (unsigned t = 0; t < threads; ++t) s.errors += slots[t].errors;
  s.batch_us = std::move(batch_us);
  return s;
}

// --- use cases -----------------------------------------------------------------------------

struct case_result {
  timed_stats stats;
  std::uint64_t keys = 0;
  double fill_mib = 0;
  std::uint64_t errors = 0;  // fill and after-run check (stats.errors: the producers)
};

template <class Map>
bool check_value(const Map& map, std::uint64_t key) {
  bool good = false;
  const bool found = map.visit(key, [&](const auto& v) { good = value_matches(v, key); });
  return found && good;
}

// The keys of htab-mem thread t: t, t + p, ..., t + 63p.
inline std::uint64_t htab_key(unsigned t, unsigned i, unsigned p) {
  return std::uint64_t{t} + std::uint64_t{i} * p;
}

template <class Map>
case_result run_htab_case(use_case uc, const config& cfg, anon_peak_sampler& rss) {
  const unsigned p = cfg.producers;
  const std::uint64_t hint = std::max<std::uint64_t>(kMinCapacityHint, std::uint64_t{kBatch} * p);
  case_result r;
  const std::uint64_t rss_empty = trimmed_rss();
  map_holder<Map> holder(hint);
  Map& map = *holder;
  grace_stats_probe<Map> probe(cfg, map, use_case_name(uc), 0);

  if (uc == use_case::overwrite) {
    r.keys = std::uint64_t{kBatch} * p;
    on_map_thread<Map>([&] {
      for (unsigned t = 0; t < p; ++t) {
        for (unsigned i = 0; i < kBatch; ++i) {
          const std::uint64_t key = htab_key(t, i, p);
          if (!map.insert(key, value_for<typename Map::value_type>(key))) ++r.errors;
        }
      }
    });
    r.fill_mib = signed_mib(anon_rss_bytes(), rss_empty);
    r.stats = run_timed<Map>(
        cfg, p, rss, probe, [&](unsigned t, worker_slot& slot, const std::atomic<bool>& stop) {
          // Relaxed: a stop request, see run_timed.
          while (!stop.load(std::memory_order_relaxed)) {
            const batch_section<Map> section(cfg);
            for (unsigned i = 0; i < kBatch; ++i) {
              const std::uint64_t key = htab_key(t, i, p);
              if (map.upsert(key, value_for<typename Map::value_type>(key))) [[unlikely]] {
                report_error(Map::kName, "overwrite: upsert inserted a key that was present", key);
                ++slot.errors;
              }
            }
            slot.add_ops(1);
          }
        });
  } else if (uc == use_case::batch_add_batch_del) {
    r.keys = std::uint64_t{kBatch} * p;
    r.fill_mib = signed_mib(anon_rss_bytes(), rss_empty);
    r.stats = run_timed<Map>(
        cfg, p, rss, probe, [&](unsigned t, worker_slot& slot, const std::atomic<bool>& stop) {
          // Relaxed: a stop request, see run_timed.
          while (!stop.load(std::memory_order_relaxed)) {
            const batch_section<Map> section(cfg);  // the adds and the deletes: one program
            for (unsigned i = 0; i < kBatch; ++i) {
              const std::uint64_t key = htab_key(t, i, p);
              if (!map.upsert(key, value_for<typename Map::value_type>(key))) [[unlikely]] {
                report_error(Map::kName, "batch_add_batch_del: add found the key present", key);
                ++slot.errors;
              }
            }
            for (unsigned i = 0; i < kBatch; ++i) {
              const std::uint64_t key = htab_key(t, i, p);
              if (!map.erase(key)) [[unlikely]] {
                report_error(Map::kName, "batch_add_batch_del: delete found the key absent", key);
                ++slot.errors;
              }
            }
            slot.add_ops(2);
          }
        });
  } else {  // add_del_on_diff_cpu
    const unsigned pairs = p / 2;
    r.keys = std::uint64_t{kBatch} * pairs;
    struct alignas(64) pair_state {  // one cache line each: pairs spin apart
      pair_handover sync;
      bool done = false;  // written by the adder before a hand-over, read after it
    };
    std::unique_ptr<pair_state[]> pair(new pair_state[pairs]);
    r.fill_mib = signed_mib(anon_rss_bytes(), rss_empty);
    r.stats = run_timed<Map>(
        cfg, p, rss, probe, [&](unsigned t, worker_slot& slot, const std::atomic<bool>& stop) {
          const unsigned q = t / 2;
          pair_state& ps = pair[q];
          if (t % 2 == 0) {  // adder
            for (;;) {
              // Relaxed: a stop request, see run_timed; the hand-over passes the decision on.
              if (stop.load(std::memory_order_relaxed)) {
                ps.done = true;
                ps.sync.arrive_and_wait();
                return;
              }
              const bench_clock::time_point batch_start = bench_clock::now();
              {
                // Ends before the hand-over: a thread waiting in a read section for its
                // partner would hold back the grace periods the partner may wait for.
                const batch_section<Map> section(cfg);
                for (unsigned i = 0; i < kBatch; ++i) {
                  const std::uint64_t key = htab_key(q, i, pairs);
                  if (!map.insert(key, value_for<typename Map::value_type>(key))) [[unlikely]] {
                    report_error(Map::kName, "add_del_on_diff_cpu: add found the key present",
                                 key);
                    ++slot.errors;
                  }
                }
              }
              slot.add_busy(bench_clock::now() - batch_start);
              slot.add_ops(1);
              ps.sync.arrive_and_wait();  // the deleter may delete
              ps.sync.arrive_and_wait();  // it has deleted
            }
          } else {  // deleter
            for (;;) {
              ps.sync.arrive_and_wait();  // the adder has added (or is done)
              if (ps.done) return;
              const bench_clock::time_point batch_start = bench_clock::now();
              {
                const batch_section<Map> section(cfg);  // ends before the hand-over, as above
                for (unsigned i = 0; i < kBatch; ++i) {
                  const std::uint64_t key = htab_key(q, i, pairs);
                  if (!map.erase(key)) [[unlikely]] {
                    report_error(Map::kName, "add_del_on_diff_cpu: delete found the key absent",
                                 key);
                    ++slot.errors;
                  }
                }
              }
              slot.add_busy(bench_clock::now() - batch_start);
              slot.add_ops(1);
              ps.sync.arrive_and_wait();
            }
          }
        });
  }

  // After-run check: overwrite keys present with their values; the others all gone.
  on_map_thread<Map>([&] {
    const unsigned owners = uc == use_case::add_del_on_diff_cpu ? p / 2 : p;
    for (unsigned t = 0; t < owners; ++t) {
      for (unsigned i = 0; i < kBatch; ++i) {
        const std::uint64_t key = htab_key(t, i, owners);
        const bool present = map.visit(key, [](const auto&) {});
        if (uc == use_case::overwrite ? !check_value(map, key) : present) {
          report_error(Map::kName, "after-run check failed", key);
          ++r.errors;
        }
      }
    }
  });
  return r;
}

template <class Map>
case_result run_keyed_case(use_case uc, std::uint64_t n, const config& cfg,
                           anon_peak_sampler& rss) {
  const unsigned p = cfg.producers;
  case_result r;
  r.keys = n;
  const std::uint64_t rss_empty = trimmed_rss();
  map_holder<Map> holder(n);
  Map& map = *holder;
  grace_stats_probe<Map> probe(cfg, map, use_case_name(uc), n);
  r.errors += fill(map, n, uc == use_case::mixed ? 2 : 1, p);
  r.fill_mib = signed_mib(anon_rss_bytes(), rss_empty);
  const std::uint64_t seed = 0x5eed0000ULL ^ n ^ (static_cast<std::uint64_t>(uc) << 40);

  if (uc == use_case::lookup) {
    r.stats = run_timed<Map>(
        cfg, p, rss, probe, [&](unsigned t, worker_slot& slot, const std::atomic<bool>& stop) {
          fast_rng rng(seed + t * 0x9e3779b97f4a7c15ULL);
          // Relaxed: a stop request, see run_timed.
          while (!stop.load(std::memory_order_relaxed)) {
            for (unsigned i = 0; i < kBatch; ++i) {
              const std::uint64_t key = key_of(fast_rng::below(rng.next(), n));
              if (!check_value(map, key)) [[unlikely]] {
                report_error(Map::kName, "lookup: key missing or value wrong", key);
                ++slot.errors;
              }
            }
            slot.add_ops(1);
          }
        });
  } else {  // mixed
    r.stats = run_timed<Map>(
        cfg, p, rss, probe, [&](unsigned t, worker_slot& slot, const std::atomic<bool>& stop) {
          fast_rng rng(seed + t * 0x9e3779b97f4a7c15ULL);
          // Relaxed: a stop request, see run_timed.
          while (!stop.load(std::memory_order_relaxed)) {
            for (unsigned i = 0; i < kBatch; ++i) {
              const std::uint64_t draw = rng.next();
              const std::uint64_t key = key_of(fast_rng::below(draw, n));
              const std::uint64_t op = fast_rng::below(draw >> 32, 20);  // 1/20 = 5%
              if (op == 0) {
                map.insert(key, value_for<typename Map::value_type>(key));
              } else if (op == 1) {
                map.erase(key);
              } else {
                bool good = true;
                map.visit(key, [&](const auto& v) { good = value_matches(v, key); });
                if (!good) [[unlikely]] {
                  report_error(Map::kName, "mixed: wrong value", key);
                  ++slot.errors;
                }
              }
            }
            slot.add_ops(1);
          }
        });
  }
  return r;
}

// --- reporting -----------------------------------------------------------------------------

std::string keys_label(std::uint64_t n) {
  if (n % 1'000'000 == 0) return std::to_string(n / 1'000'000) + "M";
  if (n % 1'000 == 0) return std::to_string(n / 1'000) + "k";
  return std::to_string(n);
}

// What a result line's worker_nice= says: grace's reclaim worker's nice value; na for the
// other maps.
template <class Map>
std::string worker_nice_of(const config& cfg) {
  return std::string(Map::kName) == "grace" ? std::to_string(cfg.grace_worker_nice) : "na";
}

const char* destruction_name(grace::element_destruction destruction) {
  return destruction == grace::element_destruction::by_updaters ? "by_updaters"
                                                                 : "on_reclaim_worker";
}

// What a result line's destruction= says: where grace destroys erased elements; na for the
// other maps.
template <class Map>
const char* destruction_of(const config& cfg) {
  return std::string(Map::kName) == "grace" ? destruction_name(cfg.grace_destruction) : "na";
}

const char* peer_hash_name(bool peer_absl_hash) {
  return peer_absl_hash ? kPeerHashName<true> : kPeerHashName<false>;
}

const char* fast_path_name(bool restartable_sequences) {
  return restartable_sequences ? "rseq" : "held";
}

// What a result line's fast_path= says: how grace's pool takes a cache; na for the others.
template <class Map>
const char* fast_path_of(const config& cfg) {
  return std::string(Map::kName) == "grace" ? fast_path_name(cfg.grace_restartable_sequences)
                                            : "na";
}

result timed_result(const char* map, const char* value, use_case uc, unsigned threads,
                    const case_result& c, const char* read_sections,
                    const std::string& worker_nice, const char* destruction,
                    const char* fast_path, const char* hash, const char* peer_hash) {
  const timed_stats& s = c.stats;
  result r;
  r.add("bench", "map").add("map", map).add("value", value).add("use_case", use_case_name(uc));
  r.add("threads", std::uint64_t{threads}).add("keys", c.keys);
  r.add("per_prod_op_kps", s.rate_mean_kps, 2);
  r.add("stddev_kps", s.rate_stddev_kps, 2);
  r.add("elem_mops", static_cast<double>(s.ops) * kBatch / s.seconds / 1e6, 2);
  r.add("avg_mem_mib", s.mem_mean_mib, 2);
  r.add("mem_stddev_mib", s.mem_stddev_mib, 2);
  r.add("peak_mem_mib", s.peak_mib, 2);
  r.add("fill_mib", c.fill_mib, 2);
  r.add("errors", c.errors + s.errors);
  r.add("cpu_cores", s.cpu_cores, 2);
  if (uc == use_case::add_del_on_diff_cpu) {
    // The adders are the even producers, the deleters the odd ones; a side that ran no batch
    // in the window is left out of its mean rather than counted as 0 µs.
    for (const unsigned side : {0u, 1u}) {
      double sum_us = 0;
      unsigned timed = 0;
      for (std::size_t t = side; t < s.batch_us.size(); t += 2) {
        if (s.batch_us[t] > 0) {
          sum_us += s.batch_us[t];
          ++timed;
        }
      }
      const char* key = side == 0 ? "add_batch_us" : "del_batch_us";
      if (timed == 0) {
        r.add_na(key);
      } else {
        r.add(key, sum_us / timed, 2);
      }
    }
  }
  r.add("read_sections", read_sections);
  r.add("worker_nice", worker_nice);
  r.add("destruction", destruction);
  r.add("fast_path", fast_path);
  r.add("hash", hash);
  r.add("peer_hash", peer_hash);
  return r;
}

// One result as a job produced it, before a round= tag: the input of the --rounds summary.
struct job_result {
  std::size_t job;  // index into run()'s job list
  unsigned round;   // 1-based
  result r;
};

// What a run reports: every result goes to the reporter at once (with round=K when there is
// more than one round) and is kept, untagged, for the summaries and the htab-mem style lines.
struct result_sink {
  reporter& out;
  bool tag_rounds = false;
  std::vector<job_result> results;
  std::uint64_t errors = 0;
  std::size_t job = 0;  // the job now running
  unsigned round = 1;   // the round now running

  void emit(const result& r) {
    results.push_back({job, round, r});
    if (!tag_rounds) {
      out.emit(r);
      return;
    }
    result tagged = r;
    tagged.add("round", std::uint64_t{round});
    out.emit(tagged);
  }
};

struct run_state {
  const config& cfg;
  result_sink& sink;
  anon_peak_sampler rss;
};

template <class Map>
void run_timed_case(run_state& st, use_case uc, std::uint64_t n) {
  const bool keyed = uc == use_case::lookup || uc == use_case::mixed;
  const case_result c = keyed ? run_keyed_case<Map>(uc, n, st.cfg, st.rss)
                              : run_htab_case<Map>(uc, st.cfg, st.rss);
  st.sink.errors += c.errors + c.stats.errors;
  // Lookups and mixed operations are single operations: one read section each.
  st.sink.emit(timed_result(Map::kName, value_name_of<Map>(), uc, st.cfg.producers, c,
                            read_sections_of<Map>(!keyed && st.cfg.batch_read_sections),
                            worker_nice_of<Map>(st.cfg), destruction_of<Map>(st.cfg),
                            fast_path_of<Map>(st.cfg), Map::kHashName,
                            peer_hash_name(st.cfg.peer_absl_hash)));
}

template <class Map>
void run_footprint(run_state& st) {
  const std::uint64_t n = st.cfg.footprint_keys;
  const std::uint64_t before = trimmed_rss();
  map_holder<Map> holder(n);
  const std::uint64_t errors = fill(*holder, n, 1, st.cfg.producers);
  const std::uint64_t after = anon_rss_bytes();
  st.sink.errors += errors;
  result r;
  r.add("bench", "map").add("map", Map::kName).add("value", value_name_of<Map>());
  r.add("use_case", "footprint");
  r.add("threads", std::uint64_t{Map::kConcurrent ? st.cfg.producers : 1u}).add("keys", n);
  r.add("resident_mib", signed_mib(after, before), 2);
  r.add("bytes_per_key",
        static_cast<double>(static_cast<std::int64_t>(after - before)) / static_cast<double>(n), 1);
  r.add("errors", errors);
  r.add("hash", Map::kHashName);
  r.add("peer_hash", peer_hash_name(st.cfg.peer_absl_hash));
  st.sink.emit(r);
}

template <class Value>
void run_destroy(run_state& st) {
  const std::uint64_t n = st.cfg.destroy_elements;
  const std::uint64_t before = trimmed_rss();
  map_holder<grace_map_of<Value>> holder(n);
  const auto fill_begin = bench_clock::now();
  std::uint64_t errors = fill(*holder, n, 1, st.cfg.producers);
  const double fill_s = seconds_between(fill_begin, bench_clock::now());
  const std::uint64_t filled = anon_rss_bytes();
  if ((*holder).raw().size() != n) {
    report_error("grace", "destroy: size() after the fill is not the element count", n);
    ++errors;
  }
  const auto begin = bench_clock::now();
  holder.reset();  // on a helper thread; the thread's start and join are inside the timing
  const double destroy_s = seconds_between(begin, bench_clock::now());
  const std::uint64_t left = trimmed_rss();
  st.sink.errors += errors;
  result r;
  r.add("bench", "map").add("map", "grace").add("value", value_name_of<grace_map_of<Value>>());
  r.add("use_case", "destroy").add("elements", n);
  r.add("ns_per_element", destroy_s * 1e9 / static_cast<double>(n), 2);
  r.add("destroy_ms", destroy_s * 1e3, 2);
  r.add("fill_s", fill_s, 2);
  r.add("fill_mib", signed_mib(filled, before), 1);
  r.add("left_mib", signed_mib(left, before), 1);
  r.add("errors", errors);
  st.sink.emit(r);
}

// --- maps and dispatch ---------------------------------------------------------------------

enum class map_kind { grace, cds_lfht, absl_sharded, absl_single, tbb, libcuckoo };
constexpr map_kind kAllMaps[] = {map_kind::grace,       map_kind::cds_lfht, map_kind::absl_sharded,
                                 map_kind::absl_single, map_kind::tbb,      map_kind::libcuckoo};

const char* map_name(map_kind m) {
  switch (m) {
    case map_kind::grace:
      return "grace";
    case map_kind::cds_lfht:
      return "cds_lfht";
    case map_kind::absl_sharded:
      return "absl_sharded";
    case map_kind::absl_single:
      return "absl_single";
    case map_kind::tbb:
      return "tbb";
    case map_kind::libcuckoo:
      return "libcuckoo";
  }
  return "?";
}

bool map_built(map_kind m) {
  switch (m) {
    case map_kind::cds_lfht:
      return GRACE_BENCH_HAVE_CDS_LFHT != 0;
    case map_kind::tbb:
      return GRACE_BENCH_HAVE_TBB != 0;
    case map_kind::libcuckoo:
      return GRACE_BENCH_HAVE_LIBCUCKOO != 0;
    default:
      return true;
  }
}

// Calls f(static_cast<M*>(nullptr)) with M the adapter of map m holding Value, hashing with
// absl::Hash where the map would otherwise use std::hash and `peer_absl_hash` asks.
template <class Value, class F>
void with_map_type(map_kind m, bool peer_absl_hash, F&& f) {
  switch (m) {
    case map_kind::grace:
      f(static_cast<grace_map_of<Value>*>(nullptr));
      break;
    case map_kind::cds_lfht:
#if GRACE_BENCH_HAVE_CDS_LFHT
      f(static_cast<cds_lfht_map_of<Value>*>(nullptr));
#endif
      break;
    case map_kind::absl_sharded:
      f(static_cast<absl_sharded_map_of<Value>*>(nullptr));
      break;
    case map_kind::absl_single:
      f(static_cast<absl_single_map_of<Value>*>(nullptr));
      break;
    case map_kind::tbb:
#if GRACE_BENCH_HAVE_TBB
      if (peer_absl_hash) {
        f(static_cast<tbb_map_of<Value, true>*>(nullptr));
      } else {
        f(static_cast<tbb_map_of<Value>*>(nullptr));
      }
#endif
      break;
    case map_kind::libcuckoo:
#if GRACE_BENCH_HAVE_LIBCUCKOO
      if (peer_absl_hash) {
        f(static_cast<libcuckoo_map_of<Value, true>*>(nullptr));
      } else {
        f(static_cast<libcuckoo_map_of<Value>*>(nullptr));
      }
#endif
      break;
  }
}

// The htab-mem style line of a timed result ("per-prod-op X ± Y k/s, avg mem A ± B MiB, peak
// mem P MiB"), from its key=value fields; empty for other results.
// The field of `r` named `key`, or nullptr.
const result::field* find_field(const result& r, const std::string& key) {
  for (const result::field& f : r.fields()) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

std::string human_line(const result& r) {
  auto field = [&r](const char* key) -> std::string {
    const result::field* f = find_field(r, key);
    return f != nullptr ? f->value : std::string();
  };
  auto number = [&field](const char* key) { return std::strtod(field(key).c_str(), nullptr); };
  if (field("per_prod_op_kps").empty()) return {};
  std::string label = field("use_case");
  if (label == "lookup" || label == "mixed") {
    label += "/" + keys_label(std::strtoull(field("keys").c_str(), nullptr, 10));
  }
  char text[256];
  std::snprintf(text, sizeof text,
                "%-13s %-20s per-prod-op %8.2f ± %7.2fk/s, avg mem %8.2f ± %7.2fMiB, "
                "peak mem %8.2fMiB",
                field("map").c_str(), label.c_str(), number("per_prod_op_kps"),
                number("stddev_kps"), number("avg_mem_mib"), number("mem_stddev_mib"),
                number("peak_mem_mib"));
  return text;
}

void print_human(const std::vector<result>& results) {
  std::vector<std::string> lines;
  for (const result& r : results) {
    if (std::string line = human_line(r); !line.empty()) lines.push_back(std::move(line));
  }
  if (lines.empty()) return;
  std::printf("\nhtab-mem style:\n");
  for (const std::string& line : lines) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// --- one job per process -----------------------------------------------------------------

// One map on one use case (and key count).
struct job {
  use_case uc;
  std::uint64_t keys;  // lookup and mixed
  map_kind map;
};

// --- the --rounds summary ----------------------------------------------------------------

std::optional<double> number_field(const result& r, const std::string& key) {
  const result::field* f = find_field(r, key);
  if (f == nullptr || f->type != result::kind::number) return std::nullopt;
  return std::strtod(f->value.c_str(), nullptr);
}

int decimals_of(const std::string& value) {
  const std::size_t dot = value.find('.');
  return dot == std::string::npos ? 0 : static_cast<int>(value.size() - dot - 1);
}

// The median (of an even count: the mean of the two middle values); xs is not empty.
double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const std::size_t mid = xs.size() / 2;
  return xs.size() % 2 != 0 ? xs[mid] : (xs[mid - 1] + xs[mid]) / 2;
}

// One job's k-th result over every round: the first round's fields in their order, each
// number the median over the rounds that measured it (errors: their sum), text as the first
// round has it; kps_min and kps_max follow per_prod_op_kps; rounds= closes the line.
result summarize_rounds(const std::vector<const result*>& rounds) {
  result summary;
  for (const result::field& f : rounds.front()->fields()) {
    std::vector<double> xs;
    int decimals = 0;
    for (const result* r : rounds) {
      if (const std::optional<double> x = number_field(*r, f.key)) {
        if (xs.empty()) decimals = decimals_of(find_field(*r, f.key)->value);
        xs.push_back(*x);
      }
    }
    if (f.type == result::kind::text) {
      summary.add(f.key, f.value);
    } else if (xs.empty()) {
      summary.add_na(f.key);
    } else if (f.key == "errors") {
      double total = 0;
      for (const double x : xs) total += x;
      summary.add(f.key, static_cast<std::uint64_t>(total));
    } else {
      summary.add(f.key, median(xs), decimals);
      if (f.key == "per_prod_op_kps") {
        summary.add("kps_min", *std::min_element(xs.begin(), xs.end()), decimals);
        summary.add("kps_max", *std::max_element(xs.begin(), xs.end()), decimals);
      }
    }
  }
  summary.add("rounds", std::uint64_t{rounds.size()});
  return summary;
}

// The summaries of a --rounds run, in job order: one per job and k-th result of that job.
// A timed result also gets grace_ratio: grace's median per_prod_op_kps on the same use case
// and key count over this map's (the side-by-side ratio, from medians of interleaved runs).
std::vector<result> round_summaries(const std::vector<job>& jobs,
                                    const std::vector<job_result>& results) {
  // [job][k][round]: the k-th result of a job in each round that produced one.
  std::vector<std::vector<std::vector<const result*>>> by_job(jobs.size());
  std::vector<std::size_t> next_k(jobs.size(), 0);
  unsigned round = 0;
  for (const job_result& jr : results) {
    if (jr.round != round) {
      round = jr.round;
      std::fill(next_k.begin(), next_k.end(), 0);
    }
    std::vector<std::vector<const result*>>& lines = by_job[jr.job];
    if (lines.size() <= next_k[jr.job]) lines.emplace_back();
    lines[next_k[jr.job]++].push_back(&jr.r);
  }
  std::vector<result> summaries;
  std::vector<std::pair<std::size_t, std::optional<double>>> kps;  // job, median kps
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    for (const std::vector<const result*>& rounds : by_job[i]) {
      summaries.push_back(summarize_rounds(rounds));
      kps.emplace_back(i, number_field(summaries.back(), "per_prod_op_kps"));
    }
  }
  for (std::size_t s = 0; s < summaries.size(); ++s) {
    const job& j = jobs[kps[s].first];
    if (!kps[s].second) continue;
    for (std::size_t g = 0; g < summaries.size(); ++g) {
      const job& grace_job = jobs[kps[g].first];
      if (grace_job.map == map_kind::grace && grace_job.uc == j.uc && grace_job.keys == j.keys &&
          kps[g].second && *kps[s].second > 0) {
        summaries[s].add("grace_ratio", *kps[g].second / *kps[s].second, 2);
        break;
      }
    }
  }
  return summaries;
}

template <class Value>
void run_job_with_values(run_state& st, const job& j) {
  if (j.uc == use_case::destroy) {
    run_destroy<Value>(st);
    return;
  }
  with_map_type<Value>(j.map, st.cfg.peer_absl_hash, [&]<class Map>(Map*) {
    if (j.uc == use_case::footprint) {
      run_footprint<Map>(st);
    } else {
      run_timed_case<Map>(st, j.uc, j.keys);
    }
  });
}

void run_job_in_process(run_state& st, const job& j) {
  if (st.cfg.string_values) {
    run_job_with_values<std::string>(st, j);
  } else {
    run_job_with_values<value64>(st, j);
  }
}

std::string number_text(double x) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", x);
  return text;
}

// Runs the job in a fresh grace-bench process (`map --in-process` with this job's options)
// and forwards its result lines: every job starts from a clean heap (glibc's malloc_trim
// cannot trim the top of a thread arena, and tbbmalloc keeps its own pools), a fresh liburcu
// call_rcu backlog and a fresh grace domain. The child's stderr is inherited.
void run_job_isolated(const config& cfg, const job& j, result_sink& sink) {
  std::vector<std::string> args = {"grace-bench",
                                   "map",
                                   "--in-process",
                                   "--producers",
                                   std::to_string(cfg.producers),
                                   "--warmup",
                                   number_text(cfg.warmup_s),
                                   "--duration",
                                   number_text(cfg.duration_s),
                                   "--map",
                                   map_name(j.map),
                                   "--use-case",
                                   use_case_name(j.uc),
                                   "--footprint-keys",
                                   std::to_string(cfg.footprint_keys),
                                   "--destroy-elements",
                                   std::to_string(cfg.destroy_elements),
                                   "--read-sections",
                                   read_sections_name(cfg.batch_read_sections),
                                   "--value",
                                   value_name(cfg.string_values),
                                   "--grace-worker-nice",
                                   std::to_string(cfg.grace_worker_nice),
                                   "--grace-destruction",
                                   destruction_name(cfg.grace_destruction),
                                   "--grace-fast-path",
                                   fast_path_name(cfg.grace_restartable_sequences),
                                   "--peer-hash",
                                   peer_hash_name(cfg.peer_absl_hash)};
  if (j.uc == use_case::lookup || j.uc == use_case::mixed) {
    args.insert(args.end(), {"--keys", std::to_string(j.keys)});
  }
  if (cfg.affinity) args.emplace_back("--affinity");
  if (cfg.grace_stats) args.emplace_back("--grace-stats");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error("map: pipe2 failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (spawned != 0) {
    close(pipe_fds[0]);
    throw std::runtime_error("map: cannot start a grace-bench child process");
  }
  FILE* from_child = fdopen(pipe_fds[0], "r");
  char* line = nullptr;
  std::size_t capacity = 0;
  ssize_t length;
  while ((length = getline(&line, &capacity, from_child)) > 0) {
    std::string text(line, static_cast<std::size_t>(length));
    while (!text.empty() && text.back() == '\n') text.pop_back();
    result r;
    if (result::parse_line(text, r)) sink.emit(r);
  }
  std::free(line);
  std::fclose(from_child);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "grace-bench map: ERROR the %s %s process %s %d\n", map_name(j.map),
                 use_case_name(j.uc), WIFEXITED(status) ? "exited with" : "died of signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    ++sink.errors;
  }
}

void describe(options_spec& spec) {
  spec.add_count("producers", kDefaultProducers, "producer threads (htab-mem -p)", 1,
                 kMaxProducers);
  spec.add_number("warmup", kDefaultWarmupS, "warm-up seconds, not measured (htab-mem -w)", 0,
                  3600);
  spec.add_number("duration", kDefaultDurationS, "measured seconds (htab-mem -d)", 0.1, 3600);
  spec.add_choice_list(
      "map", "all", {"grace", "cds_lfht", "absl_sharded", "absl_single", "tbb", "libcuckoo", "all"},
      "maps to run, in the order given; all = every map built in "
      "(absl_single only at --producers 1)");
  spec.add_choice_list("use-case", "all",
                       {"overwrite", "batch_add_batch_del", "add_del_on_diff_cpu", "lookup",
                        "mixed", "footprint", "destroy", "all"},
                       "use cases, in the order given; all = overwrite,batch_add_batch_del,"
                       "add_del_on_diff_cpu,lookup,mixed,footprint,destroy");
  spec.add_count("keys", 0, "keys of lookup and mixed", 1, kMaxKeys);
  spec.set_default_text("keys", "10k, then 1M");
  spec.add_count("footprint-keys", kDefaultFootprintKeys, "keys filled by footprint", 1);
  spec.add_count("destroy-elements", kDefaultDestroyElements,
                 "elements of the grace map that destroy times", 1);
  spec.add_choice("read-sections", "batch", {"batch", "operation"},
                  "htab-mem cases, RCU maps (grace, cds_lfht): one read section per batch of 64 "
                  "operations, as the kernel's BPF program runs them, or one per operation");
  spec.add_choice("value", "fixed64", {"fixed64", "string"},
                  "what each map stores: a 64-byte trivially copyable struct, or the same 64 "
                  "bytes in a std::string (heap-allocated: grace's elements then have a "
                  "destructor, see --grace-destruction)");
  spec.add_choice("grace-destruction", "on_reclaim_worker", {"on_reclaim_worker", "by_updaters"},
                  "where grace destroys erased and replaced elements that have a destructor "
                  "(hash_map_options::destruction): retired to the domain's reclaim worker, or "
                  "pooled and destroyed by the updating threads after the grace period");
  spec.add_choice("peer-hash", "std", {"std", "absl"},
                  "oneTBB's and libcuckoo's hash: their default, std::hash (the identity on an "
                  "integer: consecutive keys in consecutive buckets), or absl::Hash, which grace, "
                  "cds_lfht and absl use");
  spec.add_choice("grace-fast-path", "rseq", {"rseq", "held"},
                  "how grace's element pool takes its CPU's cache in allocate() and "
                  "deallocate() (pool_options::restartable_sequences): a restartable sequence "
                  "where the machine offers one, or an exchange on the cache's flag");
  spec.add_count("grace-worker-nice", 0,
                 "grace's reclaim worker's nice value: 0 uses the global domain, above 0 a "
                 "domain of the process's own (domain_options::worker_nice)",
                 0, 19);
  spec.add_count("rounds", 1,
                 "run every job this many times, round by round; after the rounds, one "
                 "summary line per job: medians, kps_min, kps_max, grace_ratio",
                 1, 100);
  spec.add_flag("affinity", "pin producer t to CPU t mod the CPU count");
  spec.add_flag("in-process",
                "run every job in this process (default: each map and use case in a fresh "
                "grace-bench process, so no heap, allocator cache or RCU backlog carries over)");
  spec.add_flag("grace-stats",
                "after each timed grace case, print grace's resize, grace-period and pool "
                "counters to stderr");
  spec.set_epilogue(
      "The Linux htab-mem use cases (bench_htab_mem.c) plus lookup and mixed loads, every\n"
      "map in one run. One result line per map and use case; on a terminal (or --table) the\n"
      "htab-mem style lines and the table follow.\n"
      "Examples:\n"
      "  grace-bench map                                     # everything, ~3 minutes\n"
      "  grace-bench map --use-case add_del_on_diff_cpu --duration 30  # memory over 30 s\n"
      "  grace-bench map --producers 1 --map absl_single,grace\n"
      "  grace-bench map --rounds 5 --duration 1 --use-case lookup  # medians, grace_ratio\n"
      "Keys: see the comment at the top of bench/map/map_mode.cc.");
}

int run(const parsed_options& options, reporter& out) {
  config cfg;
  cfg.producers = static_cast<unsigned>(options.count("producers"));
  cfg.warmup_s = options.number("warmup");
  cfg.duration_s = options.number("duration");
  cfg.affinity = options.flag("affinity");
  cfg.grace_stats = options.flag("grace-stats");
  cfg.batch_read_sections = options.choice("read-sections") == "batch";
  cfg.string_values = options.choice("value") == "string";
  cfg.grace_worker_nice = static_cast<int>(options.count("grace-worker-nice"));
  grace_worker_nice = cfg.grace_worker_nice;
  cfg.grace_destruction = options.choice("grace-destruction") == "by_updaters"
                              ? grace::element_destruction::by_updaters
                              : grace::element_destruction::on_reclaim_worker;
  grace_destruction = cfg.grace_destruction;
  cfg.grace_restartable_sequences = options.choice("grace-fast-path") == "rseq";
  grace_restartable_sequences = cfg.grace_restartable_sequences;
  cfg.peer_absl_hash = options.choice("peer-hash") == "absl";
  cfg.footprint_keys = options.count("footprint-keys");
  cfg.destroy_elements = options.count("destroy-elements");
  if (options.given("keys")) {
    cfg.key_counts = {options.count("keys")};
  } else {
    cfg.key_counts = {kSmallKeys, kLargeKeys};
  }
  const bool human = options.flag("table") || isatty(STDOUT_FILENO) == 1;

  std::vector<map_kind> maps;
  auto add_map = [&](map_kind m, bool explicitly) {
    if (std::find(maps.begin(), maps.end(), m) != maps.end()) return;
    if (!map_built(m)) {
      if (explicitly) {
        throw usage_error(std::string("--map: ") + map_name(m) +
                          " was not found when grace-bench was configured");
      }
      return;
    }
    if (m == map_kind::absl_single && cfg.producers != 1) {
      if (explicitly) throw usage_error("--map: absl_single runs only with --producers 1");
      return;
    }
    maps.push_back(m);
  };
  for (const std::string& name : options.choice_list("map")) {
    for (map_kind m : kAllMaps) {
      if (name == "all") add_map(m, false);
      if (name == map_name(m)) add_map(m, true);
    }
  }
  std::vector<use_case> cases;
  for (const std::string& name : options.choice_list("use-case")) {
    for (use_case u : kAllUseCases) {
      if ((name == "all" || name == use_case_name(u)) &&
          std::find(cases.begin(), cases.end(), u) == cases.end()) {
        cases.push_back(u);
      }
    }
  }

  std::vector<job> jobs;
  for (const use_case uc : cases) {
    if (uc == use_case::add_del_on_diff_cpu && cfg.producers % 2 != 0) {
      std::fprintf(stderr,
                   "grace-bench map: add_del_on_diff_cpu skipped: it pairs producers and "
                   "needs an even --producers\n");
      continue;
    }
    if (uc == use_case::destroy) {
      if (std::find(maps.begin(), maps.end(), map_kind::grace) != maps.end()) {
        jobs.push_back({uc, 0, map_kind::grace});
      }
      continue;
    }
    const bool keyed = uc == use_case::lookup || uc == use_case::mixed;
    for (const std::uint64_t n : keyed ? cfg.key_counts : std::vector<std::uint64_t>{0}) {
      for (const map_kind m : maps) jobs.push_back({uc, n, m});
    }
  }

  const auto rounds = static_cast<unsigned>(options.count("rounds"));
  result_sink sink{out, rounds > 1, {}, 0, 0, 1};
  // Round by round, every job once per round: a slow spell of a shared machine then falls on
  // every map alike, not on one map's whole run.
  auto run_rounds = [&](auto&& run_job) {
    for (sink.round = 1; sink.round <= rounds; ++sink.round) {
      for (sink.job = 0; sink.job < jobs.size(); ++sink.job) run_job(jobs[sink.job]);
    }
  };
  if (options.flag("in-process")) {
    run_state st{cfg, sink, {}};
    run_rounds([&](const job& j) { run_job_in_process(st, j); });
  } else {
    run_rounds([&](const job& j) { run_job_isolated(cfg, j, sink); });
  }
  std::vector<result> shown;
  if (rounds > 1) {
    shown = round_summaries(jobs, sink.results);
    for (const result& r : shown) out.emit(r);
  } else {
    for (const job_result& jr : sink.results) shown.push_back(jr.r);
  }
  if (human) print_human(shown);
  if (sink.errors != 0) {
    std::fprintf(stderr, "grace-bench map: %llu errors\n",
                 static_cast<unsigned long long>(sink.errors));
    return 1;
  }
  return 0;
}

[[maybe_unused]] const bool kRegistered = register_subcommand(
    {"map", "grace::hash_map vs cds_lfht, absl, oneTBB, libcuckoo: htab-mem use cases, lookups",
     describe, run});

}  // namespace
}  // namespace grace::bench
