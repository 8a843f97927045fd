// `grace-bench alloc`: what reuse after a grace period costs, against its alternatives.
//
// Modes, run one after another in one process so their ratios are comparable:
//   after-gp       grace::object_pool (reuse only after a grace period)
//   after-gp-held  the same pool with pool_options::restartable_sequences = false: its fast
//                  paths take the cache's flag by an exchange (what rseq saves; where the
//                  machine has no rseq, the two modes run the same code)
//   immediate      the same pool with reuse_after_gp = false: UNSAFE for readers; the speed
//                  and memory reference
//   malloc-retire  malloc + grace::domain::retire(free)
//   call_rcu       malloc + liburcu call_rcu(free), the object embedding its rcu_head
// Workloads:
//   pairs              each thread: allocate, write, deallocate, in read sections of 64
//                      operations (as a map's updates are)
//   producer-consumer  thread 2k allocates and hands each object to thread 2k+1 through a
//                      ring; that thread deallocates it (allocation and free on different
//                      CPUs: htab-mem's add_del_on_diff_cpu)
//   burst              each thread allocates its share of --burst live objects, then frees
//                      them all; settle_ms is how long until the memory is given back
// Keys:
//   ops_per_s        allocations + deallocations per second, all threads (burst: of the
//                    allocate-all, free-all phase)
//   avg_rss_mib      RSS sampled every 100 ms during the run, minus RSS before it (average)
//   peak_rss_mib     peak RSS (10 ms sampler) minus RSS before the run
//   peak_rss_abs_mib the absolute peak (the ratio between modes whose growth is ~0)
//   rss_growth_mib   RSS at the end minus RSS one second in (producer-consumer: flatness)
//   settle_ms        burst: pool modes, until the pool holds no more objects than its caches'
//                    high watermarks, and no more chunks than those need (plus the chunk
//                    each cache cuts from); malloc modes, until
//                    every retired object is reclaimed. Other workloads: na
//   grace_periods    grace periods run through the run's domain (by the engine, the pool's
//                    deallocating threads, or retire())
//   caller_gp_threshold  pool modes: --caller-gp-threshold; na for the malloc modes
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "grace/alloc/object_pool.h"
#include "grace/reclaim/domain.h"
#include "tool/affinity.h"
#include "tool/latency.h"
#include "tool/rss_sampler.h"
#include "tool/start_gate.h"
#include "tool/subcommand.h"

namespace grace::bench {
namespace {

constexpr std::uint64_t kDefaultThreads = 2;
constexpr std::uint64_t kDefaultObjectSize = 64;
constexpr double kDefaultSeconds = 2.0;
constexpr std::uint64_t kDefaultBurst = 1'000'000;
constexpr std::uint64_t kOpsPerReadSection = 64;
constexpr std::size_t kRingSize = 1024;
constexpr std::chrono::milliseconds kAverageSamplePeriod{100};
constexpr std::chrono::milliseconds kSettleLimit{5000};
constexpr std::uint64_t kChunkBytes = std::uint64_t{64} << 10;  // object_pool's chunk size

enum class mode { after_gp, after_gp_held, immediate, malloc_retire, call_rcu };
enum class workload { pairs, producer_consumer, burst };

const char* mode_name(mode m) {
  switch (m) {
    case mode::after_gp:
      return "after-gp";
    case mode::after_gp_held:
      return "after-gp-held";
    case mode::immediate:
      return "immediate";
    case mode::malloc_retire:
      return "malloc-retire";
    case mode::call_rcu:
      return "call_rcu";
  }
  return "?";
}

const char* workload_name(workload w) {
  switch (w) {
    case workload::pairs:
      return "pairs";
    case workload::producer_consumer:
      return "producer-consumer";
    case workload::burst:
      return "burst";
  }
  return "?";
}

struct config {
  unsigned threads;
  std::size_t object_size;
  double seconds;
  std::uint64_t burst;
  bool affinity;  // worker t on CPU t mod the CPU count (producer-consumer: 2p and 2p + 1)
  // The pool modes' pool_options of the same names (who drives grace periods, and when).
  std::uint64_t caller_gp_threshold;
  std::uint64_t gp_request_threshold;
};

// The object the malloc modes allocate: the payload plus, for call_rcu, an rcu_head in front
// (what a cds_lfht node carries). The pool modes allocate object_size bytes.
struct rcu_object_header {
  rcu_head head;
};

void free_after_call_rcu(rcu_head* head) { std::free(head); }

// One mode's allocator, behind the same two calls for every workload.
class allocator_under_test {
 public:
  allocator_under_test(mode m, const config& cfg, domain& reclamation)
      : mode_(m), object_size_(cfg.object_size), domain_(reclamation) {
    if (m == mode::after_gp || m == mode::after_gp_held || m == mode::immediate) {
      pool_options options;
      options.reuse_after_gp = m != mode::immediate;
      options.restartable_sequences = m != mode::after_gp_held;
      options.caller_gp_threshold = cfg.caller_gp_threshold;
      options.gp_request_threshold = cfg.gp_request_threshold;
      pool_.emplace(object_size_, options, reclamation);
    }
  }

  void* allocate() {
    switch (mode_) {
      case mode::after_gp:
      case mode::after_gp_held:
      case mode::immediate:
        return pool_->allocate();
      case mode::malloc_retire:
        return std::malloc(object_size_);
      case mode::call_rcu:
        return static_cast<char*>(std::malloc(sizeof(rcu_object_header) + object_size_)) +
               sizeof(rcu_object_header);
    }
    return nullptr;
  }

  void deallocate(void* object) noexcept {
    switch (mode_) {
      case mode::after_gp:
      case mode::after_gp_held:
      case mode::immediate:
        pool_->deallocate(object);
        return;
      case mode::malloc_retire:
        domain_.retire(object, &std::free, object_size_);
        return;
      case mode::call_rcu: {
        auto* header = reinterpret_cast<rcu_object_header*>(static_cast<char*>(object) -
                                                            sizeof(rcu_object_header));
        urcu_memb_call_rcu(&header->head, free_after_call_rcu);
        return;
      }
    }
  }

  // Each worker thread, before the gate: call_rcu() requires a registered reader; the
  // others register through their first pin.
  void enter_thread() {
    if (mode_ == mode::call_rcu) {
      urcu_memb_register_thread();
    } else {
      auto g = pin();
    }
  }
  void leave_thread() {
    if (mode_ == mode::call_rcu) urcu_memb_unregister_thread();
  }
  // Read sections around batches of operations, as a data structure's updates hold them.
  void lock() {
    if (mode_ == mode::call_rcu) {
      urcu_memb_read_lock();
    } else {
      detail::read_lock();
    }
  }
  void unlock() {
    if (mode_ == mode::call_rcu) {
      urcu_memb_read_unlock();
    } else {
      detail::read_unlock();
    }
  }

  // Burst settle: has the memory the burst needed been given back?
  bool settled() const {
    switch (mode_) {
      case mode::after_gp:
      case mode::after_gp_held:
      case mode::immediate: {
        // The caches' high watermarks in whole chunks, plus the chunk each cache cuts from.
        const pool_stats s = pool_->stats();
        const std::uint64_t caches = detail::cpu_shard_count();
        const std::uint64_t watermark_bytes =
            caches * pool_->options().high_watermark * object_size_;
        const std::uint64_t chunks = (watermark_bytes + kChunkBytes - 1) / kChunkBytes + caches;
        return s.ready + s.waiting_for_gp <= caches * pool_->options().high_watermark &&
               s.held_bytes <= chunks * kChunkBytes;
      }
      case mode::malloc_retire:
        return domain_.stats().pending_objects == 0;
      case mode::call_rcu:
        return true;  // measured with urcu_memb_barrier() instead
    }
    return true;
  }
  mode which() const { return mode_; }
  // The pool under test; nullptr in the malloc modes.
  const object_pool* pool() const { return pool_ ? &*pool_ : nullptr; }

 private:
  mode mode_;
  std::size_t object_size_;
  domain& domain_;
  std::optional<object_pool> pool_;
};

void touch(void* object, std::size_t bytes, std::uint64_t value) {
  std::memset(object, static_cast<int>(value & 0xff), std::min<std::size_t>(bytes, 64));
}

// Samples RSS every 100 ms on the calling thread until `done`; returns {average, value one
// second in, last}.
struct rss_trace {
  double average_bytes = 0;
  std::uint64_t at_one_second = 0;
  std::uint64_t last = 0;
};
rss_trace trace_rss(const std::atomic<bool>& done, bench_clock::time_point start) {
  rss_trace trace;
  double sum = 0;
  std::uint64_t samples = 0;
  // Acquire: pairs with the Release store that ends the run.
  while (!done.load(std::memory_order_acquire)) {
    std::this_thread::sleep_for(kAverageSamplePeriod);
    const std::uint64_t rss = current_rss_bytes();
    sum += static_cast<double>(rss);
    ++samples;
    trace.last = rss;
    if (trace.at_one_second == 0 && bench_clock::now() - start >= std::chrono::seconds(1)) {
      trace.at_one_second = rss;
    }
  }
  trace.average_bytes = samples == 0 ? static_cast<double>(current_rss_bytes()) : sum / samples;
  if (trace.at_one_second == 0) trace.at_one_second = trace.last;
  return trace;
}

struct run_numbers {
  std::uint64_t ops = 0;
  double seconds = 0;
  rss_trace rss;
  double settle_ms = -1;
};

run_numbers run_pairs(allocator_under_test& a, const config& cfg) {
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> ops{0};
  start_gate gate(static_cast<std::ptrdiff_t>(cfg.threads));
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < cfg.threads; ++t) {
    threads.emplace_back([&, t] {
      if (cfg.affinity) pin_to_cpu(t);
      a.enter_thread();
      gate.arrive_and_wait();
      std::uint64_t done = 0;
      // Relaxed: a stop flag polled once per batch; the join orders everything after it.
      while (!stop.load(std::memory_order_relaxed)) {
        a.lock();
        for (std::uint64_t i = 0; i < kOpsPerReadSection; ++i) {
          void* object = a.allocate();
          touch(object, cfg.object_size, t + i);
          a.deallocate(object);
        }
        a.unlock();
        done += 2 * kOpsPerReadSection;
      }
      ops.fetch_add(done, std::memory_order_relaxed);  // Relaxed: read after join.
      a.leave_thread();
    });
  }
  run_numbers n;
  const auto start = gate.open();
  std::atomic<bool> traced{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(cfg.seconds));
    stop.store(true, std::memory_order_relaxed);  // Relaxed: see the workers' loop.
    // Release: ends the RSS trace; pairs with its Acquire load.
    traced.store(true, std::memory_order_release);
  });
  n.rss = trace_rss(traced, start);
  stopper.join();
  for (auto& thread : threads) thread.join();
  n.seconds = seconds_between(start, bench_clock::now());
  n.ops = ops.load(std::memory_order_relaxed);
  return n;
}

// A single-producer single-consumer ring of object pointers.
class ring {
 public:
  bool push(void* object) {
    // Relaxed: only the producer writes tail_.
    const std::size_t tail = tail_.load(std::memory_order_relaxed);
    // Acquire: the consumer is done with the slot; pairs with its Release store of head_.
    if (tail - head_.load(std::memory_order_acquire) == kRingSize) return false;
    slots_[tail % kRingSize] = object;
    // Release: the slot's pointer is visible to the consumer; pairs with its Acquire load.
    tail_.store(tail + 1, std::memory_order_release);
    return true;
  }
  void* pop() {
    // Relaxed: only the consumer writes head_.
    const std::size_t head = head_.load(std::memory_order_relaxed);
    // Acquire: pairs with the producer's Release store of tail_.
    if (tail_.load(std::memory_order_acquire) == head) return nullptr;
    void* object = slots_[head % kRingSize];
    // Release: the slot may be reused; pairs with the producer's Acquire load.
    head_.store(head + 1, std::memory_order_release);
    return object;
  }

 private:
  alignas(64) std::atomic<std::size_t> head_{0};
  alignas(64) std::atomic<std::size_t> tail_{0};
  alignas(64) void* slots_[kRingSize];
};

// What the producer pushes after its last object. Not nullptr, which pop() returns for an
// empty ring; never an object's address (objects are aligned to more than 1).
void* end_of_stream() { return reinterpret_cast<void*>(std::uintptr_t{1}); }

run_numbers run_producer_consumer(allocator_under_test& a, const config& cfg) {
  const unsigned pairs = std::max(1u, cfg.threads / 2);
  std::vector<std::unique_ptr<ring>> rings;
  for (unsigned p = 0; p < pairs; ++p) rings.push_back(std::make_unique<ring>());
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> ops{0};
  start_gate gate(static_cast<std::ptrdiff_t>(2 * pairs));
  std::vector<std::thread> threads;
  for (unsigned p = 0; p < pairs; ++p) {
    threads.emplace_back([&, p] {  // producer
      if (cfg.affinity) pin_to_cpu(2 * p);
      a.enter_thread();
      gate.arrive_and_wait();
      std::uint64_t done = 0;
      std::uint64_t value = 0;
      void* batch[kOpsPerReadSection];
      // Relaxed: see run_pairs().
      while (!stop.load(std::memory_order_relaxed)) {
        a.lock();
        for (void*& object : batch) {
          object = a.allocate();
          touch(object, cfg.object_size, ++value);
        }
        a.unlock();
        // Never wait for the consumer inside a read section: it may be waiting for a grace
        // period, which waits for this thread's read section.
        for (void* object : batch) {
          while (!rings[p]->push(object)) std::this_thread::yield();
        }
        done += kOpsPerReadSection;
      }
      while (!rings[p]->push(end_of_stream())) std::this_thread::yield();
      ops.fetch_add(done, std::memory_order_relaxed);                // Relaxed: after join.
      a.leave_thread();
    });
    threads.emplace_back([&, p] {  // consumer
      if (cfg.affinity) pin_to_cpu(2 * p + 1);
      a.enter_thread();
      gate.arrive_and_wait();
      std::uint64_t done = 0;
      // Until the end of the stream, not until stop: the producer may still be pushing the
      // batch it allocated before it saw stop, and every object must come back.
      for (;;) {
        void* object = rings[p]->pop();
        if (object == nullptr) {  // empty for now
          std::this_thread::yield();
          continue;
        }
        if (object == end_of_stream()) break;
        a.lock();
        a.deallocate(object);
        a.unlock();
        ++done;
      }
      ops.fetch_add(done, std::memory_order_relaxed);  // Relaxed: read after join.
      a.leave_thread();
    });
  }
  run_numbers n;
  const auto start = gate.open();
  std::atomic<bool> traced{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::duration<double>(cfg.seconds));
    stop.store(true, std::memory_order_relaxed);  // Relaxed: see run_pairs().
    // Release: ends the RSS trace; pairs with its Acquire load.
    traced.store(true, std::memory_order_release);
  });
  n.rss = trace_rss(traced, start);
  stopper.join();
  for (auto& thread : threads) thread.join();
  n.seconds = seconds_between(start, bench_clock::now());
  n.ops = ops.load(std::memory_order_relaxed);
  return n;
}

run_numbers run_burst(allocator_under_test& a, const config& cfg) {
  const std::uint64_t per_thread = cfg.burst / cfg.threads;
  start_gate gate(static_cast<std::ptrdiff_t>(cfg.threads));
  std::vector<std::thread> threads;
  std::vector<bench_clock::time_point> finished(cfg.threads);
  for (unsigned t = 0; t < cfg.threads; ++t) {
    threads.emplace_back([&, t] {
      if (cfg.affinity) pin_to_cpu(t);
      a.enter_thread();
      std::vector<void*> live(per_thread);
      gate.arrive_and_wait();
      for (std::uint64_t i = 0; i < per_thread; ++i) {
        live[i] = a.allocate();
        touch(live[i], cfg.object_size, i);
      }
      for (void* object : live) a.deallocate(object);
      finished[t] = bench_clock::now();
      a.leave_thread();
    });
  }
  run_numbers n;
  const auto start = gate.open();
  for (auto& thread : threads) thread.join();
  const auto end = *std::max_element(finished.begin(), finished.end());
  n.seconds = seconds_between(start, end);
  n.ops = 2 * per_thread * cfg.threads;
  // Settle: nobody touches the allocator any more; the memory must come back by itself.
  if (a.which() == mode::call_rcu) {
    urcu_memb_barrier();
  } else {
    while (!a.settled() && bench_clock::now() - end < kSettleLimit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  n.settle_ms = seconds_between(end, bench_clock::now()) * 1e3;
  if (!a.settled()) n.settle_ms = -1;  // did not settle within the limit
  n.rss.last = current_rss_bytes();
  n.rss.at_one_second = n.rss.last;
  n.rss.average_bytes = static_cast<double>(n.rss.last);
  return n;
}

result run_one(mode m, workload w, const config& cfg, rss_sampler& rss) {
  domain reclamation;  // one per run: its stats and memory are this run's alone
  allocator_under_test a(m, cfg, reclamation);
  malloc_trim(0);
  const std::uint64_t rss_before = current_rss_bytes();
  rss.reset_peak();
  run_numbers n;
  switch (w) {
    case workload::pairs:
      n = run_pairs(a, cfg);
      break;
    case workload::producer_consumer:
      n = run_producer_consumer(a, cfg);
      break;
    case workload::burst:
      n = run_burst(a, cfg);
      break;
  }
  const std::uint64_t peak = rss.peak_bytes();
  auto mib_over = [&](double bytes) {
    return bytes > static_cast<double>(rss_before)
               ? (bytes - static_cast<double>(rss_before)) / kBytesPerMib
               : 0.0;
  };
  result r;
  r.add("bench", "alloc").add("mode", mode_name(m)).add("workload", workload_name(w));
  r.add("threads", std::uint64_t{cfg.threads}).add("object_size", std::uint64_t{cfg.object_size});
  r.add("ops_per_s", static_cast<double>(n.ops) / n.seconds, 0);
  r.add("avg_rss_mib", mib_over(n.rss.average_bytes), 1);
  r.add("peak_rss_mib", mib_over(static_cast<double>(peak)), 1);
  r.add("peak_rss_abs_mib", static_cast<double>(peak) / kBytesPerMib, 1);
  if (w == workload::burst) {
    r.add_na("rss_growth_mib");
  } else {
    r.add("rss_growth_mib", (static_cast<double>(n.rss.last) -
                             static_cast<double>(n.rss.at_one_second)) / kBytesPerMib, 1);
  }
  if (w == workload::burst && n.settle_ms >= 0) {
    r.add("settle_ms", n.settle_ms, 1);
  } else {
    r.add_na("settle_ms");
  }
  const domain_stats ds = reclamation.stats();
  r.add("grace_periods", ds.grace_periods);
  if (const object_pool* pool = a.pool()) {
    r.add("caller_gp_threshold", std::uint64_t{pool->options().caller_gp_threshold});
  } else {
    r.add_na("caller_gp_threshold");
  }
  return r;
}

void describe(options_spec& spec) {
  spec.add_count("threads", kDefaultThreads, "worker threads (producer-consumer: pairs)", 1, 256);
  spec.add_count("object-size", kDefaultObjectSize, "bytes per object", 1,
                 object_pool::max_object_size);
  spec.add_number("seconds", kDefaultSeconds, "duration of pairs and producer-consumer", 0.1,
                  3600);
  spec.add_count("burst", kDefaultBurst, "live objects in the burst workload (all threads)", 1);
  spec.add_choice_list("mode", "all",
                       {"after-gp", "after-gp-held", "immediate", "malloc-retire", "call_rcu",
                        "all"},
                       "allocators to compare, in order; all = after-gp,after-gp-held,immediate,"
                       "malloc-retire,call_rcu");
  spec.add_choice_list("workload", "all", {"pairs", "producer-consumer", "burst", "all"},
                       "workloads; all = pairs,producer-consumer,burst");
  spec.add_count("caller-gp-threshold", pool_options{}.caller_gp_threshold,
                 "pool modes: waiting objects per CPU cache above which the deallocating "
                 "thread runs a grace period itself; 0: never (pool_options)");
  spec.add_count("gp-request-threshold", 0,
                 "pool modes: waiting objects per CPU cache above which the pool asks its "
                 "domain for a grace period; 0: the pool's default, 2 x magazine capacity "
                 "(pool_options)");
  spec.add_flag("affinity",
                "pin worker t to CPU t mod the CPU count (producer-consumer: producer and "
                "consumer of a pair on neighbouring CPUs); without it, where the scheduler "
                "puts a pair decides whether its ring hand-over spins or yields");
  spec.set_epilogue(
      "Keys: see the comment at the top of bench/alloc/alloc_mode.cc.\n"
      "Flat memory over 30 s: grace-bench alloc --workload producer-consumer --seconds 30");
}

int run(const parsed_options& options, reporter& out) {
  config cfg{};
  cfg.threads = static_cast<unsigned>(options.count("threads"));
  cfg.object_size = options.count("object-size");
  cfg.seconds = options.number("seconds");
  cfg.burst = options.count("burst");
  cfg.affinity = options.flag("affinity");
  cfg.caller_gp_threshold = options.count("caller-gp-threshold");
  cfg.gp_request_threshold = options.count("gp-request-threshold");
  if (cfg.burst < cfg.threads) throw usage_error("--burst: must be at least --threads");
  std::vector<mode> modes;
  for (const std::string& name : options.choice_list("mode")) {
    if (name == "after-gp" || name == "all") modes.push_back(mode::after_gp);
    if (name == "after-gp-held" || name == "all") modes.push_back(mode::after_gp_held);
    if (name == "immediate" || name == "all") modes.push_back(mode::immediate);
    if (name == "malloc-retire" || name == "all") modes.push_back(mode::malloc_retire);
    if (name == "call_rcu" || name == "all") modes.push_back(mode::call_rcu);
  }
  std::vector<workload> workloads;
  for (const std::string& name : options.choice_list("workload")) {
    if (name == "pairs" || name == "all") workloads.push_back(workload::pairs);
    if (name == "producer-consumer" || name == "all") {
      workloads.push_back(workload::producer_consumer);
    }
    if (name == "burst" || name == "all") workloads.push_back(workload::burst);
  }
  (void)urcu_memb_get_default_call_rcu_data();  // same readers in every mode (see retire)
  rss_sampler rss;
  for (const workload w : workloads) {
    for (const mode m : modes) out.emit(run_one(m, w, cfg, rss));
  }
  return 0;
}

[[maybe_unused]] const bool kRegistered = register_subcommand(
    {"alloc", "object pool: reuse after GP vs immediate reuse, malloc+retire, malloc+call_rcu",
     describe, run});

}  // namespace
}  // namespace grace::bench
