// `grace-bench sync`: how long a thread waits for one grace period, idle and during a flood,
// and how long barrier() waits for the domain's engine.
//
// Waiters:
//   synchronize  domain.synchronize() on a fresh grace::domain
//   barrier      domain.barrier() on that domain: a marker handed through the GP thread and
//                the reclaim worker, behind whatever the flood retired before it (what
//                ~hash_map(), clear() and a pool's destructor wait for)
//   call_rcu     what users build without a direct synchronize: urcu_memb_call_rcu() of a
//                callback that bumps a counter the waiter sleeps on (C++20 atomic wait, a
//                futex), measured from the call_rcu() to the wake-up. liburcu's worker naps
//                10 ms between batches, so this takes ~10 ms even idle; its rows are bounded
//                by --call-rcu-seconds.
// Floods (phase=flood): one thread allocates 40-byte objects and hands each to
//   retire       domain.retire() on the same domain the synchronize waiter uses
//   call_rcu     urcu_memb_call_rcu() (rcu_head embedded)
//   malloc_free  nothing: it deletes the object at once. The control: a busy core with no
//                reclamation, so the cost of the busy core itself (liburcu's membarrier
//                must interrupt it twice per grace period) is seen apart from the retire
//                flood's.
// or, cpu_hog, one thread per CPU spins without allocating: every core busy at nice 0, so
// the engine's threads get one only from the scheduler (a saturated service);
// for --warmup-ms before the waiter starts and until it has finished. The flooding thread is
// a registered liburcu reader (outside read sections), and so is the main thread, idle, for
// the whole run: every synchronize() runs liburcu's full path, as in a program with readers.
// --flood matched pairs each waiter with its own mechanism's flood (synchronize also with the
// malloc_free control, barrier with retire and cpu_hog); --flood all runs every waiter with
// every flood.
// --worker normal|background|all: the domain's reclaim worker at nice 0, or 19
// (domain_options::worker_nice), in the synchronize rows with the retire flood, the only
// synchronize rows where the worker has work, and in every barrier row; every other row
// runs it at nice 0.
//
// Rows: bench=sync phase=idle|flood waiter=... flood=none|malloc_free|retire|call_rcu|cpu_hog
// samples worker_nice p50_us p99_us max_us, plus the flooding thread's rate (na for cpu_hog)
// and the peak RSS growth.
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "grace/reclaim/domain.h"
#include "reclaim/bench_object.h"
#include "tool/latency.h"
#include "tool/rss_sampler.h"
#include "tool/subcommand.h"

namespace grace::bench {
namespace {

constexpr double kDefaultSyncSeconds = 1.0;
constexpr double kDefaultCallRcuSeconds = 2.0;
constexpr std::uint64_t kDefaultMaxSamples = 200'000;
constexpr std::uint64_t kDefaultSyncGapUs = 100;
constexpr std::uint64_t kDefaultWarmupMs = 100;
// The flooding thread checks its stop flag once per this many objects.
constexpr std::uint64_t kFloodStopCheck = 1024;
// --worker background: the lowest priority a thread can give itself.
constexpr int kBackgroundWorkerNice = 19;

enum class waiter_kind { synchronize, barrier, call_rcu };
enum class flood_kind { none, malloc_free, retire, call_rcu, cpu_hog };

const char* waiter_name(waiter_kind w) {
  switch (w) {
    case waiter_kind::synchronize:
      return "synchronize";
    case waiter_kind::barrier:
      return "barrier";
    case waiter_kind::call_rcu:
      return "call_rcu";
  }
  return "?";
}

const char* flood_name(flood_kind f) {
  switch (f) {
    case flood_kind::none:
      return "none";
    case flood_kind::malloc_free:
      return "malloc_free";
    case flood_kind::retire:
      return "retire";
    case flood_kind::call_rcu:
      return "call_rcu";
    case flood_kind::cpu_hog:
      return "cpu_hog";
  }
  return "?";
}

struct sampling {
  double sync_seconds;
  double call_rcu_seconds;
  std::uint64_t max_samples;
  std::chrono::microseconds sync_gap;
  std::chrono::milliseconds warmup;
};

// The call_rcu waiter's completion: the callback bumps `completed`; the waiter sleeps until it
// reaches the number it issued. It lives in run_row(), which runs urcu_memb_barrier() before
// returning, so it outlives the last callback's notify.
struct call_rcu_completion {
  rcu_head head;
  std::atomic<std::uint32_t> completed{0};
};

void complete_call_rcu(rcu_head* head) {
  auto* completion = reinterpret_cast<call_rcu_completion*>(head);  // head is the first member
  // Release: ends the measured wait; pairs with the waiter's Acquire load.
  completion->completed.fetch_add(1, std::memory_order_release);
  completion->completed.notify_all();
}

// Runs on its own thread: waits for grace periods until the time or sample budget is spent.
std::vector<std::uint64_t> measure(waiter_kind waiter, domain& d, call_rcu_completion& completion,
                                   const sampling& cfg) {
  std::vector<std::uint64_t> samples_ns;
  const bool on_domain = waiter != waiter_kind::call_rcu;  // synchronize or barrier
  const auto budget =
      std::chrono::duration<double>(on_domain ? cfg.sync_seconds : cfg.call_rcu_seconds);
  samples_ns.reserve(on_domain ? std::min<std::uint64_t>(cfg.max_samples, 1 << 16) : 1024);

  std::uint32_t issued = 0;                // completion is fresh: no callback has run on it
  if (!on_domain) urcu_memb_register_thread();  // call_rcu() requires a registered thread
  const auto start = bench_clock::now();
  while (bench_clock::now() - start < budget && samples_ns.size() < cfg.max_samples) {
    const auto begin = bench_clock::now();
    if (waiter == waiter_kind::synchronize) {
      d.synchronize();
    } else if (waiter == waiter_kind::barrier) {
      d.barrier();
    } else {
      ++issued;
      urcu_memb_call_rcu(&completion.head, complete_call_rcu);
      std::uint32_t seen;
      // Acquire: pairs with the Release increment in complete_call_rcu().
      while ((seen = completion.completed.load(std::memory_order_acquire)) != issued) {
        // Acquire: as above.
        completion.completed.wait(seen, std::memory_order_acquire);
      }
    }
    const auto end = bench_clock::now();
    samples_ns.push_back(static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count()));
    if (on_domain && cfg.sync_gap.count() > 0) std::this_thread::sleep_for(cfg.sync_gap);
  }
  if (!on_domain) urcu_memb_unregister_thread();
  return samples_ns;
}

result run_row(waiter_kind waiter, flood_kind flood, int worker_nice, const sampling& cfg,
               rss_sampler& rss) {
  domain d(domain_options{.worker_nice = worker_nice});
  (void)urcu_memb_get_default_call_rcu_data();  // start liburcu's worker outside the timing
  malloc_trim(0);
  const std::uint64_t rss_before = current_rss_bytes();
  rss.reset_peak();

  std::atomic<bool> stop_flood{false};
  std::uint64_t flooded = 0;
  double flood_seconds = 0;
  std::thread flooder;
  std::vector<std::thread> hogs;
  if (flood == flood_kind::cpu_hog) {
    for (unsigned i = 0, n = std::max(1u, std::thread::hardware_concurrency()); i < n; ++i) {
      hogs.emplace_back([&] {
        // Relaxed: a stop request.
        while (!stop_flood.load(std::memory_order_relaxed)) {
        }
      });
    }
    std::this_thread::sleep_for(cfg.warmup);
  } else if (flood != flood_kind::none) {
    flooder = std::thread([&] {
      // A registered reader either way (see run()): call_rcu() requires it; grace registers
      // a thread on its first pin.
      if (flood == flood_kind::call_rcu) {
        urcu_memb_register_thread();
      } else {
        auto g = grace::pin();
      }
      const auto begin = bench_clock::now();
      std::uint64_t count = 0;
      for (;;) {
        for (std::uint64_t i = 0; i < kFloodStopCheck; ++i, ++count) {
          bench_object* object = make_bench_object(count);
          switch (flood) {
            case flood_kind::retire:
              d.retire(object);
              break;
            case flood_kind::call_rcu:
              urcu_memb_call_rcu(&object->head, delete_bench_object);
              break;
            default:
              delete object;
              break;
          }
        }
        // Relaxed: a stop request; the join publishes the counts.
        if (stop_flood.load(std::memory_order_relaxed)) break;
      }
      flood_seconds = seconds_between(begin, bench_clock::now());
      flooded = count;
      if (flood == flood_kind::call_rcu) urcu_memb_unregister_thread();
    });
    std::this_thread::sleep_for(cfg.warmup);
  }

  std::vector<std::uint64_t> samples_ns;
  call_rcu_completion completion;
  std::thread([&] { samples_ns = measure(waiter, d, completion, cfg); }).join();

  // Relaxed: see the flooding loop.
  stop_flood.store(true, std::memory_order_relaxed);
  if (flooder.joinable()) flooder.join();
  for (std::thread& hog : hogs) hog.join();
  // Drain before the next row (not measured). The barrier also ensures the last
  // complete_call_rcu() has returned before `completion` goes away.
  if (flood == flood_kind::call_rcu || waiter == waiter_kind::call_rcu) urcu_memb_barrier();
  d.barrier();
  const std::uint64_t peak = rss.peak_bytes();

  result r;
  r.add("bench", "sync");
  r.add("phase", flood == flood_kind::none ? "idle" : "flood");
  r.add("waiter", waiter_name(waiter)).add("flood", flood_name(flood));
  r.add("worker_nice", static_cast<std::uint64_t>(worker_nice));
  const latency_summary summary = summarize(samples_ns);
  r.add("samples", summary.samples);
  if (summary.samples == 0) {
    r.add_na("p50_us").add_na("p99_us").add_na("max_us");
  } else {
    r.add("p50_us", summary.p50_us, 2)
        .add("p99_us", summary.p99_us, 2)
        .add("max_us", summary.max_us, 2);
  }
  if (flood == flood_kind::none || flood == flood_kind::cpu_hog) {
    r.add_na("flood_objects_per_s");
  } else {
    r.add("flood_objects_per_s", static_cast<double>(flooded) / flood_seconds, 0);
  }
  const double grown = peak > rss_before ? static_cast<double>(peak - rss_before) : 0.0;
  r.add("peak_rss_mib", grown / kBytesPerMib, 1);
  return r;
}

void describe(options_spec& spec) {
  spec.add_choice("phase", "all", {"idle", "flood", "all"}, "idle, during a flood, or both");
  spec.add_choice("waiter", "all", {"synchronize", "barrier", "call_rcu", "all"},
                  "how the thread waits");
  spec.add_choice("flood", "all", {"matched", "all"},
                  "matched: synchronize during malloc_free and retire floods, barrier during "
                  "retire and cpu_hog floods, call_rcu during a call_rcu flood; all: every "
                  "waiter with every flood");
  spec.add_choice("worker", "all", {"normal", "background", "all"},
                  "the reclaim worker in the synchronize rows with the retire flood and in "
                  "every barrier row: nice 0, nice 19 (domain_options::worker_nice), or a row "
                  "each");
  spec.add_number("seconds", kDefaultSyncSeconds,
                  "time budget of each synchronize and barrier row", 0.01, 3600);
  spec.add_number("call-rcu-seconds", kDefaultCallRcuSeconds,
                  "time budget of each call_rcu row (~10 ms per sample)", 0.01, 3600);
  spec.add_count("max-samples", kDefaultMaxSamples, "sample cap per row", 1);
  spec.add_count("sync-gap-us", kDefaultSyncGapUs,
                 "pause between synchronize() samples, microseconds (0 = back to back)");
  spec.add_count("warmup-ms", kDefaultWarmupMs, "flood time before the waiter starts");
  spec.set_epilogue("Keys: see the comment at the top of bench/reclaim/sync_mode.cc.");
}

int run(const parsed_options& options, reporter& out) {
  sampling cfg{};
  cfg.sync_seconds = options.number("seconds");
  cfg.call_rcu_seconds = options.number("call-rcu-seconds");
  cfg.max_samples = options.count("max-samples");
  cfg.sync_gap = std::chrono::microseconds(options.count("sync-gap-us"));
  cfg.warmup = std::chrono::milliseconds(options.count("warmup-ms"));

  const std::string& phase = options.choice("phase");
  const std::string& waiter = options.choice("waiter");
  const bool all_floods = options.choice("flood") == "all";
  const std::string& worker = options.choice("worker");
  std::vector<int> worker_nices;
  if (worker != "background") worker_nices.push_back(0);
  if (worker != "normal") worker_nices.push_back(kBackgroundWorkerNice);
  std::vector<waiter_kind> waiters;
  for (const waiter_kind w :
       {waiter_kind::synchronize, waiter_kind::barrier, waiter_kind::call_rcu}) {
    if (waiter == "all" || waiter == waiter_name(w)) waiters.push_back(w);
  }

  // This thread stays a registered (idle) liburcu reader for the whole run, so every
  // synchronize(), idle or not, has at least one reader to check and runs liburcu's full
  // path (an empty reader registry returns at once, which no real program sees).
  { auto g = grace::pin(); }

  rss_sampler rss;
  // Whether the row's reclaim worker runs at each of --worker's nice values (or at 0 only).
  const auto worker_matters = [](waiter_kind w, flood_kind f) {
    return w == waiter_kind::barrier || (w == waiter_kind::synchronize && f == flood_kind::retire);
  };
  const auto matched = [](waiter_kind w, flood_kind f) {
    switch (w) {
      case waiter_kind::synchronize:
        return f == flood_kind::retire || f == flood_kind::malloc_free;
      case waiter_kind::barrier:
        return f == flood_kind::retire || f == flood_kind::cpu_hog;
      case waiter_kind::call_rcu:
        return f == flood_kind::call_rcu;
    }
    return false;
  };
  for (const waiter_kind w : waiters) {
    for (const flood_kind f : {flood_kind::none, flood_kind::malloc_free, flood_kind::retire,
                               flood_kind::call_rcu, flood_kind::cpu_hog}) {
      if (f == flood_kind::none ? phase == "flood" : phase == "idle") continue;
      if (f != flood_kind::none && !matched(w, f) && !all_floods) continue;
      if (!worker_matters(w, f)) {
        out.emit(run_row(w, f, 0, cfg, rss));
        continue;
      }
      for (const int nice : worker_nices) out.emit(run_row(w, f, nice, cfg, rss));
    }
  }
  return 0;
}

[[maybe_unused]] const bool kRegistered = register_subcommand(
    {"sync", "synchronize() vs a call_rcu()+completion wait, idle and during a flood", describe,
     run});

}  // namespace
}  // namespace grace::bench
