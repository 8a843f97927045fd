// Counting words from several threads into one map: insert_or_update() is "++counts[word]"
// without a lock, a reporter reads running totals meanwhile, and lookups by
// std::string_view build no std::string. At the end every word is counted exactly once.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "grace/map/hash_map.h"

// Transparent hashing, so a word read as a std::string_view is looked up without a copy.
struct word_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view word) const {
    return absl::Hash<std::string_view>{}(word);
  }
};

int main() {
  // A text of 400,000 words drawn from a vocabulary of 5,000.
  constexpr int kWords = 400'000;
  constexpr std::uint64_t kVocabulary = 5'000;
  std::vector<std::string> text;
  text.reserve(kWords);
  std::uint64_t state = 42;
  for (int i = 0; i < kWords; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    text.push_back("word" + std::to_string((state >> 33) % kVocabulary));
  }

  grace::hash_map<std::string, std::uint64_t, word_hash, std::equal_to<>> counts;
  std::atomic<bool> done{false};

  // The reporter: running totals while the counters work (each for_each is one read section;
  // counts only grow, so each total is at most the final one).
  std::thread reporter([&] {
    std::uint64_t reports = 0;
    // Acquire: pairs with the Release store of `done` below.
    while (!done.load(std::memory_order_acquire)) {
      std::uint64_t total = 0;
      counts.for_each([&](const std::string&, std::uint64_t n) { total += n; });
      if (total > kWords) std::abort();
      ++reports;
    }
    std::printf("reporter: %llu running totals taken\n", static_cast<unsigned long long>(reports));
  });

  std::vector<std::thread> counters;
  for (int t = 0; t < 2; ++t) {
    counters.emplace_back([&, t] {
      for (int i = t; i < kWords; i += 2) {
        // Each element published (an update's replacement too: values never change in
        // place) holds its own copy of the word.
        counts.insert_or_update(text[i], 1, [](std::uint64_t n) { return n + 1; });
      }
    });
  }
  for (std::thread& counter : counters) counter.join();
  done.store(true, std::memory_order_release);  // Release: pairs with the reporter's load.
  reporter.join();

  std::uint64_t total = 0;
  counts.for_each([&](const std::string&, std::uint64_t n) { total += n; });
  std::uint64_t expected_word0 = 0;
  for (const std::string& word : text) expected_word0 += word == "word0";
  // Heterogeneous read, then extract: the count leaves the map with its word.
  const std::uint64_t word0 = counts.find(std::string_view("word0")).value_or(0);
  const std::optional<std::uint64_t> taken = counts.extract(std::string_view("word0"));
  std::printf("%llu words, %zu distinct; \"word0\" %llu times\n",
              static_cast<unsigned long long>(total), counts.size() + 1,
              static_cast<unsigned long long>(word0));
  if (total != kWords || word0 != expected_word0 || taken != word0 ||
      counts.contains(std::string_view("word0"))) {
    std::printf("wrong counts\n");
    return 1;
  }
  return 0;
}
