// `grace-bench retire`: the Linux rcuperf kfree test (kfree_perf_thread) in user space.
//
// T threads each run L loops; each loop allocates N 40-byte objects, then retires each
// (--pattern bulk, the default), or retires each right after allocating it (--pattern
// interleaved: kfree_perf_thread's own loop). Modes, run one after another in one
// process so their ratios are comparable (in this order; see run()):
//   batch     grace::domain with default options (per-CPU page-sized blocks), except the
//             pending-object limits when --soft-limit-objects / --hard-limit-objects are given
//             and the reclaim worker's nice value when --worker-nice is
//   call_rcu  urcu_memb_call_rcu() per object, the object embedding its rcu_head (what
//             cds_lfht users do); finished with urcu_memb_barrier()
//   handoff   the control, not an RCU mode: each thread hands full page-sized blocks of
//             pointers straight to one freeing thread, with no grace period and no limit:
//             the rate of freeing on another thread, which batch and call_rcu both do, with
//             nothing else in the way
//   nobatch   grace::domain with .batching = grace::batching::per_object (a GP per object),
//             its pending-object limits above the default flood (kNobatchHardLimit)
// The flooding threads are registered liburcu readers in every mode (call_rcu() requires
// it; the grace modes register through one grace::pin() and retire outside read sections).
// Each mode gets a fresh domain. While the flood runs, a separate measuring thread calls
// domain.synchronize() (call_rcu and handoff: urcu_memb_synchronize_rcu()) in a loop. Right
// after the flood, barrier() (call_rcu mode: urcu_memb_barrier(); handoff: until its freeing
// thread has freed everything) is timed.
//
// What each key measures:
//   seconds         from the start gate opening to the last flooding thread's last retire
//                   (allocation and retire both inside; reclamation runs concurrently)
//   objects_per_s   objects / seconds
//   e2e_objects_per_s objects / (seconds + barrier), i.e. until every object is reclaimed
//   grace_periods   synchronize_rcu() calls during the mode by every thread except the
//                   measuring one (counted by interposition, tool/gp_counter.h): the grace
//                   periods reclamation cost, the same way for all three modes
//   domain_gps      domain.stats().grace_periods, which also counts the measuring thread's
//                   synchronize() calls (= grace_periods + sync_samples); na for call_rcu
//   peak_rss_mib    peak RSS during flood + barrier minus the RSS before the mode (after
//                   malloc_trim, so memory freed by an earlier mode does not hide growth)
//   peak_rss_abs_mib the absolute peak
//   peak_pending    domain.stats().peak_pending_objects; na for call_rcu
//   worker_nice     the domain's reclaim worker's nice value; na for call_rcu
//   sync_*          the measuring thread's synchronize latencies during the flood
//   barrier_ms      barrier() right after the flood
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "grace/reclaim/domain.h"
#include "reclaim/bench_object.h"
#include "tool/gp_counter.h"
#include "tool/latency.h"
#include "tool/rss_sampler.h"
#include "tool/start_gate.h"
#include "tool/subcommand.h"

namespace grace::bench {
namespace {

constexpr std::uint64_t kDefaultThreads = 2;
// 2 threads x 20 loops x 50,000 = 2M objects: the whole three-mode run takes a few seconds.
// nobatch stays under its domain's hard limit (kNobatchHardLimit) at this size; above it,
// nobatch runs into back-pressure at one grace period per object (~250k objects/s).
constexpr std::uint64_t kDefaultLoops = 20;
constexpr std::uint64_t kDefaultAllocNum = 50'000;
constexpr std::uint64_t kMaxThreads = 256;
constexpr std::uint64_t kDefaultSyncGapUs = 100;
constexpr std::size_t kReservedSamples = std::size_t{1} << 16;
// nobatch's pending-object limits: the defaults before session 9 lowered them, so that its
// 2M-object flood (a grace period per object, far slower than the retiring threads) never
// waits on back-pressure, as in every measurement of it recorded before.
constexpr std::size_t kNobatchSoftLimit = std::size_t{1} << 18;
constexpr std::size_t kNobatchHardLimit = std::size_t{1} << 21;

enum class mode { batch, nobatch, call_rcu, handoff };

const char* mode_name(mode m) {
  switch (m) {
    case mode::batch:
      return "batch";
    case mode::nobatch:
      return "nobatch";
    case mode::call_rcu:
      return "call_rcu";
    case mode::handoff:
      return "handoff";
  }
  return "?";
}

struct config {
  unsigned threads;
  std::uint64_t loops;
  std::uint64_t alloc_num;
  bool bulk;  // each loop allocates all its objects, then retires them
  std::chrono::microseconds sync_gap;
  grace::domain_options batch_options;  // batch mode's domain
};

// The measuring thread: synchronize latencies while the flood runs.
class sync_measurer {
 public:
  template <class Synchronize>
  sync_measurer(start_gate& gate, const std::atomic<bool>& flood_done,
                std::chrono::microseconds gap, Synchronize synchronize)
      : thread_([this, &gate, &flood_done, gap, synchronize] {
          const scoped_gp_count_exclusion not_reclamation;
          samples_ns_.reserve(kReservedSamples);
          gate.arrive_and_wait();
          // Acquire: pairs with the Release store by the last flooding thread.
          while (!flood_done.load(std::memory_order_acquire)) {
            const auto begin = bench_clock::now();
            synchronize();
            const auto end = bench_clock::now();
            samples_ns_.push_back(static_cast<std::uint64_t>(
                std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count()));
            if (gap.count() > 0) std::this_thread::sleep_for(gap);
          }
        }) {}

  latency_summary join() {
    thread_.join();
    return summarize(samples_ns_);
  }

 private:
  std::vector<std::uint64_t> samples_ns_;
  std::thread thread_;
};

// Runs the flood on cfg.threads threads (the measuring thread waits at the same gate).
// setup() and teardown() run on each flooding thread outside the timed region;
// retire(object) hands one object to the mode's mechanism. Returns the flood's wall time
// (gate open to the last thread's last retire).
template <class Setup, class Retire, class Teardown>
double run_flood(const config& cfg, start_gate& gate, std::atomic<bool>& flood_done, Setup setup,
                 Retire retire, Teardown teardown) {
  std::atomic<unsigned> running{cfg.threads};
  std::vector<bench_clock::time_point> finished(cfg.threads);
  std::vector<std::thread> threads;
  threads.reserve(cfg.threads);
  for (unsigned t = 0; t < cfg.threads; ++t) {
    threads.emplace_back([&, t] {
      setup();
      std::vector<bench_object*> loop_objects(cfg.bulk ? cfg.alloc_num : 0);
      gate.arrive_and_wait();
      std::uint64_t seed = std::uint64_t{t} << 40;
      for (std::uint64_t loop = 0; loop < cfg.loops; ++loop) {
        if (cfg.bulk) {
          for (bench_object*& object : loop_objects) object = make_bench_object(seed++);
          for (bench_object* object : loop_objects) retire(object);
        } else {
          for (std::uint64_t i = 0; i < cfg.alloc_num; ++i) retire(make_bench_object(seed++));
        }
      }
      finished[t] = bench_clock::now();
      // AcqRel: the last thread to finish sees the others' decrements before it raises
      // flood_done; pairs with the other threads' decrements.
      if (running.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        // Release: pairs with the measuring thread's Acquire load.
        flood_done.store(true, std::memory_order_release);
      }
      teardown();
    });
  }
  const bench_clock::time_point start = gate.open();
  for (std::thread& thread : threads) thread.join();
  const bench_clock::time_point end = *std::max_element(finished.begin(), finished.end());
  return seconds_between(start, end);
}

// handoff mode's freeing thread: retiring threads fill blocks of pointers (a page, as batch
// mode's) and push full ones onto a stack; the thread takes the whole stack, oldest block
// first, and frees every object at once. No grace period, no limit on the backlog.
class handoff_freer {
 public:
  handoff_freer() : thread_([this] { run(); }) {}

  // Called by a flooding thread for each object; setup()/teardown() bracket its flood.
  static void retire(handoff_freer& freer, bench_object* object) {
    handoff_block*& open = open_block();
    if (open == nullptr) open = new handoff_block;
    open->objects[open->count++] = object;
    if (open->count == kObjectsPerBlock) {
      freer.push(open);
      open = nullptr;
    }
  }
  void flush_this_thread() {
    if (handoff_block*& open = open_block()) {
      push(open);
      open = nullptr;
    }
  }
  // Frees everything handed over so far, then stops the thread.
  void finish() {
    // Release: pairs with the freeing thread's Acquire load; every push came before.
    stopping_.store(true, std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_release);  // Release: as above
    wake_.notify_one();
    thread_.join();
  }

 private:
  static constexpr std::size_t kObjectsPerBlock = 4096 / sizeof(void*) - 2;
  struct handoff_block {
    handoff_block* next = nullptr;
    std::size_t count = 0;
    bench_object* objects[kObjectsPerBlock];
  };
  static handoff_block*& open_block() {
    thread_local handoff_block* open = nullptr;
    return open;
  }
  void push(handoff_block* block) {
    // Relaxed load: the CAS below checks it.
    block->next = blocks_.load(std::memory_order_relaxed);
    // Release: publishes the block's pointers to the freeing thread's Acquire exchange.
    while (!blocks_.compare_exchange_weak(block->next, block, std::memory_order_release,
                                          std::memory_order_relaxed)) {
    }
    // Release: the push before the wake; pairs with run()'s Acquire load of wake_.
    wake_.fetch_add(1, std::memory_order_release);
    wake_.notify_one();
  }
  void run() {
    for (;;) {
      // Acquire: the wake count first, so a push after this load changes it (no lost wake).
      const std::uint32_t seen = wake_.load(std::memory_order_acquire);
      // Acquire: pairs with push()'s Release CAS.
      handoff_block* newest = blocks_.exchange(nullptr, std::memory_order_acquire);
      if (newest == nullptr) {
        // Acquire: pairs with finish()'s Release store (every push happened before it).
        if (stopping_.load(std::memory_order_acquire) &&
            blocks_.load(std::memory_order_acquire) == nullptr) {  // Acquire: as above
          return;
        }
        wake_.wait(seen, std::memory_order_acquire);  // Acquire: as the load above
        continue;
      }
      handoff_block* oldest_first = nullptr;
      while (newest != nullptr) {
        handoff_block* next = newest->next;
        newest->next = oldest_first;
        oldest_first = newest;
        newest = next;
      }
      while (oldest_first != nullptr) {
        handoff_block* next = oldest_first->next;
        for (std::size_t i = 0; i < oldest_first->count; ++i) delete oldest_first->objects[i];
        delete oldest_first;
        oldest_first = next;
      }
    }
  }

  std::atomic<handoff_block*> blocks_{nullptr};
  std::atomic<std::uint32_t> wake_{0};
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

// The flooding threads are registered liburcu readers in every mode, as threads that use a
// concurrent structure are: call_rcu() requires it, and grace registers a thread on its first
// pin. So every synchronize() has the same readers to wait for. The grace modes retire outside
// read sections (call_rcu() takes a read lock inside).
void register_reader() { auto g = grace::pin(); }

// A mode that starts with much more resident memory than the first one grows into memory an
// earlier mode left resident (glibc keeps the top of a thread arena's heap resident even after
// malloc_trim), so its peak_rss_mib reads low.
constexpr double kRssCarryOverWarnMib = 32;

result run_mode(mode m, const config& cfg, rss_sampler& rss, std::uint64_t& first_rss_before) {
  std::optional<domain> dom;
  if (m == mode::batch) dom.emplace(cfg.batch_options);
  if (m == mode::nobatch) {
    dom.emplace(domain_options{.soft_limit_objects = kNobatchSoftLimit,
                               .hard_limit_objects = kNobatchHardLimit,
                               .batching = batching::per_object});
  }

  malloc_trim(0);
  const std::uint64_t rss_before = current_rss_bytes();
  if (first_rss_before == 0) first_rss_before = rss_before;
  const double carried_mib =
      (static_cast<double>(rss_before) - static_cast<double>(first_rss_before)) / kBytesPerMib;
  if (carried_mib > kRssCarryOverWarnMib) {
    std::fprintf(stderr,
                 "grace-bench retire: warning: mode %s starts with %.0f MiB more resident than the "
                 "first mode (left by an earlier mode); its peak_rss_mib reads low. Run nobatch "
                 "last, as --mode all does.\n",
                 mode_name(m), carried_mib);
  }
  rss.reset_peak();
  const std::uint64_t gps_before = urcu_grace_periods();

  start_gate gate(static_cast<std::ptrdiff_t>(cfg.threads) + 1);
  std::atomic<bool> flood_done{false};

  double flood_seconds = 0;
  latency_summary sync_latency;
  double barrier_ms = 0;
  if (dom) {
    domain& d = *dom;
    sync_measurer measurer(gate, flood_done, cfg.sync_gap, [&d] { d.synchronize(); });
    flood_seconds = run_flood(
        cfg, gate, flood_done, register_reader, [&d](bench_object* object) { d.retire(object); },
        [] {});
    sync_latency = measurer.join();
    const auto barrier_begin = bench_clock::now();
    d.barrier();
    barrier_ms = seconds_between(barrier_begin, bench_clock::now()) * 1e3;
  } else if (m == mode::handoff) {
    handoff_freer freer;
    sync_measurer measurer(gate, flood_done, cfg.sync_gap, [] { urcu_memb_synchronize_rcu(); });
    flood_seconds = run_flood(
        cfg, gate, flood_done, register_reader,
        [&freer](bench_object* object) { handoff_freer::retire(freer, object); },
        [&freer] { freer.flush_this_thread(); });
    sync_latency = measurer.join();
    const auto barrier_begin = bench_clock::now();
    freer.finish();
    barrier_ms = seconds_between(barrier_begin, bench_clock::now()) * 1e3;
  } else {
    sync_measurer measurer(gate, flood_done, cfg.sync_gap, [] { urcu_memb_synchronize_rcu(); });
    flood_seconds = run_flood(
        cfg, gate, flood_done, [] { urcu_memb_register_thread(); },
        [](bench_object* object) { urcu_memb_call_rcu(&object->head, delete_bench_object); },
        [] { urcu_memb_unregister_thread(); });
    sync_latency = measurer.join();
    const auto barrier_begin = bench_clock::now();
    urcu_memb_barrier();
    barrier_ms = seconds_between(barrier_begin, bench_clock::now()) * 1e3;
  }
  const std::uint64_t peak = rss.peak_bytes();
  const std::uint64_t grace_periods = urcu_grace_periods() - gps_before;

  const std::uint64_t objects = cfg.threads * cfg.loops * cfg.alloc_num;
  result r;
  r.add("bench", "retire").add("mode", mode_name(m));
  r.add("threads", std::uint64_t{cfg.threads}).add("objects", objects);
  if (dom) {
    r.add("worker_nice", static_cast<std::uint64_t>(dom->options().worker_nice));
  } else {
    r.add_na("worker_nice");
  }
  r.add("seconds", flood_seconds, 3);
  r.add("objects_per_s", static_cast<double>(objects) / flood_seconds, 0);
  r.add("e2e_objects_per_s", static_cast<double>(objects) / (flood_seconds + barrier_ms / 1e3), 0);
  if (grace_periods == 0 && m == mode::call_rcu) {
    r.add_na("grace_periods");  // liburcu's internal calls were not interposed
  } else {
    r.add("grace_periods", grace_periods);
  }
  const std::optional<domain_stats> stats =
      dom ? std::optional<domain_stats>(dom->stats()) : std::nullopt;
  if (stats) {
    r.add("domain_gps", stats->grace_periods);
  } else {
    r.add_na("domain_gps");
  }
  const double grown = peak > rss_before ? static_cast<double>(peak - rss_before) : 0.0;
  r.add("peak_rss_mib", grown / kBytesPerMib, 1);
  r.add("peak_rss_abs_mib", static_cast<double>(peak) / kBytesPerMib, 1);
  if (stats) {
    r.add("peak_pending", stats->peak_pending_objects);
  } else {
    r.add_na("peak_pending");
  }
  add_latency(r, "sync_", sync_latency);
  r.add("barrier_ms", barrier_ms, 2);
  return r;
}

void describe(options_spec& spec) {
  spec.add_count("threads", kDefaultThreads, "retiring (flooding) threads", 1, kMaxThreads);
  spec.add_count("loops", kDefaultLoops, "loops per thread", 1);
  spec.add_count("alloc-num", kDefaultAllocNum, "objects allocated and retired per loop", 1);
  spec.add_count("objects", 0,
                 "total objects (all threads); if set, --loops becomes "
                 "ceil(objects / (threads * alloc-num))");
  spec.set_default_text("objects", "off");
  spec.add_choice_list("mode", "all", {"batch", "nobatch", "call_rcu", "handoff", "all"},
                       "what retires the objects, one mode or a list run in the order given "
                       "(batch,call_rcu); handoff is the control (freed on another thread, no "
                       "grace period); all = batch,call_rcu,handoff,nobatch");
  spec.add_choice("pattern", "bulk", {"bulk", "interleaved"},
                  "bulk: each loop allocates --alloc-num objects, then retires them; "
                  "interleaved: retire each right after allocating it (rcuperf's loop)");
  const grace::domain_options defaults;
  spec.add_count("soft-limit-objects", defaults.soft_limit_objects,
                 "batch mode: pending objects above which the engine drains at once "
                 "(domain_options::soft_limit_objects)",
                 1);
  spec.add_count("hard-limit-objects", defaults.hard_limit_objects,
                 "batch mode: pending objects above which retiring threads wait "
                 "(domain_options::hard_limit_objects; at least the soft limit)",
                 1);
  spec.add_count("worker-nice", 0,
                 "batch mode: the reclaim worker's nice value (domain_options::worker_nice; "
                 "19 = freeing as background work)",
                 0, 19);
  spec.add_count("sync-gap-us", kDefaultSyncGapUs,
                 "pause of the measuring thread between synchronize() calls, microseconds "
                 "(0 = back to back)");
  spec.set_epilogue(
      "The rcuperf kfree test: each thread runs --loops loops; each loop allocates\n"
      "--alloc-num 40-byte objects and retires them (see --pattern).\n"
      "Examples: barrier() after a 10M-object flood, batch beside call_rcu:\n"
      "  grace-bench retire --mode batch,call_rcu --threads 2 --loops 50 --alloc-num 100000\n"
      "(nobatch at 10M objects takes about a minute: a grace period per object.)\n"
      "More memory for more throughput: the pending limits (the defaults before session 9):\n"
      "  grace-bench retire --mode batch --soft-limit-objects 262144 --hard-limit-objects 2097152\n"
      "Keys: see the comment at the top of bench/reclaim/retire_mode.cc.");
}

int run(const parsed_options& options, reporter& out) {
  config cfg{};
  cfg.threads = static_cast<unsigned>(options.count("threads"));
  cfg.alloc_num = options.count("alloc-num");
  cfg.loops = options.count("loops");
  cfg.sync_gap = std::chrono::microseconds(options.count("sync-gap-us"));
  cfg.bulk = options.choice("pattern") == "bulk";
  cfg.batch_options.soft_limit_objects = options.count("soft-limit-objects");
  cfg.batch_options.hard_limit_objects = options.count("hard-limit-objects");
  cfg.batch_options.worker_nice = static_cast<int>(options.count("worker-nice"));
  if (cfg.batch_options.hard_limit_objects < cfg.batch_options.soft_limit_objects) {
    throw usage_error("--hard-limit-objects: must be at least --soft-limit-objects");
  }
  if (options.given("objects")) {
    const std::uint64_t objects = options.count("objects");
    if (objects == 0) throw usage_error("--objects: must be at least 1");
    if (options.given("loops")) throw usage_error("--objects: give either --objects or --loops");
    const std::uint64_t per_loop = cfg.threads * cfg.alloc_num;
    cfg.loops = (objects + per_loop - 1) / per_loop;
  }

  // `all` runs nobatch last: malloc_trim() cannot hand all of its ~250 MiB back to the
  // kernel, and a later mode would grow into that resident memory and look smaller than it is.
  std::vector<mode> modes;
  for (const std::string& name : options.choice_list("mode")) {
    if (name == "batch" || name == "all") modes.push_back(mode::batch);
    if (name == "call_rcu" || name == "all") modes.push_back(mode::call_rcu);
    if (name == "handoff" || name == "all") modes.push_back(mode::handoff);
    if (name == "nobatch" || name == "all") modes.push_back(mode::nobatch);
  }

  // liburcu's call_rcu worker starts before any mode and stays: it is a registered reader,
  // and grace periods cost more with one (liburcu skips its memory barriers while no thread
  // is registered). Started here, every mode runs with the same readers, whatever the order,
  // as in a program that uses call_rcu anywhere (cds_lfht does); and call_rcu mode does not
  // pay for starting it inside its timed region.
  (void)urcu_memb_get_default_call_rcu_data();
  rss_sampler rss;
  std::uint64_t first_rss_before = 0;
  for (const mode m : modes) out.emit(run_mode(m, cfg, rss, first_rss_before));
  return 0;
}

[[maybe_unused]] const bool kRegistered = register_subcommand(
    {"retire", "rcuperf-style retire flood: batch vs nobatch vs call_rcu (throughput, GPs, RSS)",
     describe, run});

}  // namespace
}  // namespace grace::bench
