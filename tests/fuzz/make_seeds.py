#!/usr/bin/env python3
"""Writes the seed corpora in corpus/<target>/: small inputs that each reach one scenario
(fill and drain, every hash pattern, reserve and clear, pins across updates, contention on
shared keys, clear racing with inserts, ...), so a fuzz run starts from deep states instead
of rediscovering the input format. Run it from anywhere; it rewrites both directories.

The encodings mirror map_fuzzing.h, map_model_fuzzer.cc and map_threads_fuzzer.cc: keep the
op lists below in the order of their `enum class op`.
"""
import pathlib

HERE = pathlib.Path(__file__).resolve().parent

MODEL_OPS = ["find", "contains", "visit", "pin", "insert", "try_emplace", "insert_or_assign",
             "assign", "update", "insert_or_update", "erase", "extract", "erase_if", "for_each",
             "reserve", "clear", "size", "insert_range", "erase_range"]
THREAD_OPS = ["find", "contains", "visit", "pin", "insert", "try_emplace", "insert_or_assign",
              "assign", "update", "insert_or_update", "erase", "extract", "erase_if", "for_each",
              "reserve", "clear", "bucket_count", "insert_range", "erase_range"]
# Arguments the ops read (see each target's file comment): bit 0 of insert, try_emplace and
# insert_or_assign moves the key in, bit 0 of contains asks count(), erase_if from
# WHOLE_MAP_ARG up runs over the whole map (map_fuzzing.h's kWholeMapArg), for_each n > 0
# stops at the n-th element.
MOVED = 1
COUNT = 1
WHOLE_MAP_ARG = 10
HASHES = ["mixed", "identity", "mod5", "high_bits", "constant", "halves", "one_bucket",
          "bucket_edges"]
GROW = [1.0, 0.5, 2.0, 4.0]
MAX_BUCKETS = [256, 4, 32, 4096]


def variant(hash_name="mixed", strings=False, three_threads=False):
    return HASHES.index(hash_name) | (8 if strings else 0) | (0x10 if three_threads else 0)


def options(grow=1.0, max_buckets=256, initial16=False, tight_pool=False, min4=False,
            by_updaters=False):
    return (GROW.index(grow) | MAX_BUCKETS.index(max_buckets) << 2 | (0x10 if initial16 else 0)
            | (0x20 if tight_pool else 0) | (0x40 if min4 else 0) | (0x80 if by_updaters else 0))


def model_op(name, key=0, arg=0):
    code = MODEL_OPS.index(name) + len(MODEL_OPS) * arg
    assert code < 256 and 0 <= key < 256
    return bytes([code, key])


def thread_op(name, slot=0, arg=0, delay=0):
    """slot 0-15: the thread's own keys, 16-31: the shared keys."""
    code = THREAD_OPS.index(name) + len(THREAD_OPS) * arg
    assert code < 256 and 0 <= slot < 32 and 0 <= delay < 8
    return bytes([code, slot | delay << 5])


def deal(*streams):
    """Interleaves per-thread op lists the way the threads fuzzer deals records."""
    out = b""
    for i in range(max(len(s) for s in streams)):
        for s in streams:
            out += s[i] if i < len(s) else thread_op("contains", 0)
    return out


def model_seeds():
    seeds = {}
    fill = b"".join(model_op("insert", k) for k in range(128))
    drain = b"".join(model_op("erase", k) for k in range(128))
    seeds["fill_and_drain"] = bytes([variant(), options()]) + fill + model_op("for_each") + drain
    # Every hash pattern: a mixed workload over a few dozen keys.
    mix = b""
    for k in range(0, 48, 3):
        mix += (model_op("insert", k) + model_op("insert_or_assign", k + 1)
                + model_op("try_emplace", k) + model_op("find", k) + model_op("update", k + 1)
                + model_op("visit", k + 2) + model_op("assign", k) + model_op("erase_if", k, 1))
    mix += model_op("for_each")
    for k in range(0, 48, 2):
        mix += model_op("erase", k) + model_op("contains", k + 1) + model_op("erase_if", k + 1, 0)
    for i, h in enumerate(HASHES):
        seeds[f"mix_{h}"] = bytes([variant(h), options(GROW[i % 4], MAX_BUCKETS[i % 4])]) + mix
    seeds["strings_mix"] = bytes([variant("mixed", strings=True), options(tight_pool=True)]) + mix
    seeds["strings_mod5"] = bytes([variant("mod5", strings=True), options(0.5, 4096)]) + mix
    # Population swings: ranges through every size, at each load factor.
    swing = b""
    for arg in (12, 3, 12, 7):
        swing += model_op("insert_range", 0, arg) + model_op("size")
        swing += model_op("erase_range", 8, arg) + model_op("for_each")
    for grow in GROW:
        seeds[f"swing_grow_{grow}"] = bytes([variant("identity"), options(grow, 4096)]) + swing
    seeds["swing_min4_max4"] = bytes([variant("halves"), options(2.0, 4, min4=True)]) + swing
    # reserve() then fill, erase, clear and refill: the reservation holds shrinks off until
    # clear().
    seeds["reserve_clear"] = bytes([variant(), options(1.0, 4096, initial16=True)]) + (
        model_op("reserve", 64) + model_op("insert_range", 0, 12) + model_op("erase_range", 0, 12)
        + model_op("for_each") + model_op("clear") + model_op("insert_range", 10, 7)
        + model_op("reserve", 200, 3) + model_op("clear") + model_op("erase", 3)
        + model_op("insert_range", 100, 12) + model_op("for_each"))
    # A pin held while its element is replaced, erased, the table resized and the map
    # cleared, with a tight pool that reuses elements as soon as a grace period allows.
    pinned = (model_op("insert_range", 0, 3) + model_op("pin", 5, 12) + model_op("update", 5)
              + model_op("erase", 5) + model_op("insert", 5) + model_op("insert_range", 16, 12)
              + model_op("erase_range", 0, 12) + model_op("reserve", 100) + model_op("clear")
              + model_op("pin", 7) + model_op("insert_or_assign", 5) + model_op("assign", 5)
              + model_op("find", 5) + model_op("for_each") + model_op("insert", 9))
    seeds["pin_across_updates"] = bytes([variant(), options(tight_pool=True)]) + pinned
    seeds["pin_strings"] = bytes([variant("constant", strings=True), options(tight_pool=True)]) + pinned
    # The same with the pool destroying erased elements (element_destruction::by_updaters).
    seeds["pin_strings_by_updaters"] = bytes([variant("constant", strings=True),
                                              options(tight_pool=True, by_updaters=True)]) + pinned
    # Replacements of a few keys over and over: elements cycle through the pool.
    churn = b"".join(model_op(op, k) for _ in range(20) for k in range(4)
                     for op in ("insert_or_assign", "update", "assign", "erase", "insert"))
    seeds["churn_tight_pool"] = bytes([variant("high_bits"), options(0.5, 32, tight_pool=True)]) + churn
    seeds["churn_strings_by_updaters"] = bytes([variant("high_bits", strings=True),
                                                options(0.5, 32, tight_pool=True,
                                                        by_updaters=True)]) + churn
    # The members added in session 8: moved keys inserted and given back (present keys),
    # count, insert_or_update both ways, extract of present and absent keys, the table's
    # bounds and load factor, for_each stopped early, and erase_if(pred) over the whole map
    # at each modulus; with std::string keys a moved-from key that did not come back is empty.
    members = b""
    for k in range(0, 40, 2):
        members += (model_op("insert", k, MOVED) + model_op("insert", k, MOVED)
                    + model_op("try_emplace", k + 1, MOVED) + model_op("try_emplace", k, MOVED)
                    + model_op("contains", k + 1, COUNT) + model_op("insert_or_update", k)
                    + model_op("insert_or_update", k + 40)
                    + model_op("insert_or_assign", k, MOVED)
                    + model_op("insert_or_assign", k + 80, MOVED) + model_op("extract", k + 1))
    members += model_op("size") + model_op("for_each", 0, 1) + model_op("for_each", 0, 7)
    for arg, anchor in ((WHOLE_MAP_ARG, 1), (WHOLE_MAP_ARG + 1, 0), (WHOLE_MAP_ARG + 2, 3)):
        members += (model_op("erase_if", anchor, arg) + model_op("size")
                    + model_op("extract", anchor) + model_op("contains", anchor, COUNT)
                    + model_op("insert_range", anchor, 3))
    members += model_op("pin", 4, 6) + model_op("extract", 4) + model_op("insert_or_update", 4)
    members += (model_op("erase_if", 0, WHOLE_MAP_ARG) + model_op("for_each", 0, 12)
                + model_op("size"))
    seeds["members_strings_moved"] = bytes([variant("mod5", strings=True),
                                            options(tight_pool=True)]) + members
    seeds["members_identity_swings"] = bytes([variant("identity"), options(0.5, 4096)]) + members
    return seeds


def thread_seeds():
    seeds = {}

    def own_churn(rounds, delay=0):
        ops = []
        for r in range(rounds):
            for slot in range(0, 16, 2):
                ops += [thread_op("insert", slot, delay=delay),
                        thread_op("insert_or_assign", slot + 1, delay=delay),
                        thread_op("update", slot), thread_op("find", slot + 1),
                        thread_op("erase_if", slot, r & 1), thread_op("assign", slot + 1),
                        thread_op("visit", slot), thread_op("erase", slot + 1)]
        return ops

    def shared_fight(rounds, delay=0):
        ops = []
        for r in range(rounds):
            for slot in range(16, 30, 3):
                ops += [thread_op("insert_or_assign", slot, delay=delay),
                        thread_op("update", slot + 1), thread_op("find", slot),
                        thread_op("try_emplace", slot + 2), thread_op("erase_if", slot + 1, 1),
                        thread_op("visit", slot + 2), thread_op("erase", slot),
                        thread_op("assign", slot + 1)]
        return ops

    def swings(rounds):
        ops = []
        for _ in range(rounds):
            ops += [thread_op("insert_range", 0, 3), thread_op("for_each"),
                    thread_op("erase_range", 4, 3), thread_op("insert_range", 8, 3)]
        return ops

    def clears(rounds):
        ops = []
        for r in range(rounds):
            ops += [thread_op("insert_range", r % 16, 3), thread_op("clear", delay=r % 4),
                    thread_op("find", 3), thread_op("for_each"), thread_op("insert", 20 + r % 8)]
        return ops

    def pins(rounds):
        ops = []
        for r in range(rounds):
            ops += [thread_op("insert", r % 16), thread_op("pin", 16 + r % 16, 6),
                    thread_op("insert_or_assign", 16 + r % 16), thread_op("erase", 16 + r % 16),
                    thread_op("insert_range", 0, 3), thread_op("erase_range", 0, 3),
                    thread_op("pin", r % 16, 2), thread_op("update", r % 16),
                    thread_op("erase", r % 16)]
        return ops

    def header(hash_name="mixed", strings=False, three=False, **opts):
        return bytes([variant(hash_name, strings, three), options(**opts)])

    seeds["own_keys_2"] = header() + deal(own_churn(4), own_churn(4))
    seeds["own_keys_3_identity"] = header("identity", three=True, grow=0.5) + deal(
        own_churn(3), own_churn(3, 2), own_churn(3))
    seeds["shared_fight_2"] = header(tight_pool=True) + deal(shared_fight(6), shared_fight(6, 1))
    seeds["shared_fight_3_mod5"] = header("mod5", three=True, tight_pool=True) + deal(
        shared_fight(4), shared_fight(4), shared_fight(4))
    seeds["swings_2_grow4"] = header("halves", grow=4.0, max_buckets=4096) + deal(
        swings(8), swings(8))
    seeds["swings_3_max4"] = header("high_bits", three=True, max_buckets=4, min4=True) + deal(
        swings(5), swings(5), shared_fight(2))
    seeds["clear_races_inserts"] = header(three=True) + deal(clears(10), own_churn(2),
                                                             swings(6))
    seeds["pins_across_updates"] = header("constant", tight_pool=True) + deal(pins(6), pins(6))
    seeds["reserve_races"] = header(initial16=True, max_buckets=4096) + deal(
        [thread_op("reserve", s, 12) for s in range(31, 0, -3)] + swings(3), swings(6))
    seeds["strings_mixed"] = header(strings=True, tight_pool=True) + deal(
        own_churn(2) + shared_fight(2), shared_fight(3) + clears(2))
    seeds["strings_3_mod5"] = header("mod5", strings=True, three=True, grow=2.0) + deal(
        swings(3) + pins(2), shared_fight(3), own_churn(2))
    seeds["strings_by_updaters"] = header(strings=True, tight_pool=True, by_updaters=True) + deal(
        own_churn(2) + pins(2), shared_fight(3) + clears(2))
    seeds["foreach_during_updates"] = header("identity", max_buckets=32) + deal(
        [thread_op("for_each", delay=d % 4) for d in range(40)], swings(5) + shared_fight(2))

    # The members added in session 8 under contention: moved keys racing for the same shared
    # key (the loser's key comes back after its element was built), counters bumped with
    # insert_or_update, extract, count, and a thread that walks with a for_each that stops
    # and erases with erase_if(pred) over the whole map while the others update.
    def moved_fight(rounds, delay=0):
        ops = []
        for r in range(rounds):
            for slot in range(16, 32, 4):
                ops += [thread_op("insert", slot, MOVED, delay),
                        thread_op("try_emplace", slot + 1, MOVED),
                        thread_op("insert_or_update", slot + 2), thread_op("extract", slot),
                        thread_op("insert_or_assign", slot + 3, MOVED),
                        thread_op("contains", slot + 1, COUNT),
                        thread_op("extract", slot + 1, delay=delay),
                        thread_op("insert_or_update", r % 16)]
        return ops

    def walks(rounds):
        ops = []
        for r in range(rounds):
            ops += [thread_op("insert_range", r % 16, 3), thread_op("for_each", 0, 1 + r % 12),
                    thread_op("erase_if", r % 32, WHOLE_MAP_ARG + r % 3),
                    thread_op("bucket_count"),
                    thread_op("extract", r % 16), thread_op("contains", r % 16, COUNT),
                    thread_op("insert", (r + 1) % 16, MOVED), thread_op("for_each")]
        return ops

    seeds["members_moved_fight_strings"] = header("mod5", strings=True, three=True,
                                                  tight_pool=True) + deal(
        moved_fight(3), moved_fight(3, 1), walks(8))
    seeds["members_walks_erase_matching"] = header("halves", grow=0.5, max_buckets=4096) + deal(
        walks(10), moved_fight(2) + swings(3))
    return seeds


def write(target, seeds):
    directory = HERE / "corpus" / target
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.iterdir():
        old.unlink()
    for name, data in sorted(seeds.items()):
        (directory / name).write_bytes(data)
    total = sum(len(d) for d in seeds.values())
    print(f"{target}: {len(seeds)} seeds, {total} bytes")


if __name__ == "__main__":
    write("map_model_fuzzer", model_seeds())
    write("map_threads_fuzzer", thread_seeds())
