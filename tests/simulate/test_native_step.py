"""The native engine's step API (start / add_requests / advance / drain): a driver
stepping it on its own clock gets exactly what `run` gives, is told of refusals
with their Retry-After, reads the published signals, and gets every block back."""
import random
import re

import pytest

from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit import Requests


def engine(cfg=None, num_blocks=64, prefix=False):
    return NativeEngine(AdmissionConfig(**(cfg or {})), num_blocks, 16, 2048, 64, 512,
                        prefix_caching=prefix, step_a=0.01, step_b=2e-5, step_c=1e-7,
                        hash_block_tokens=32 if prefix else 0)


def workload(n=300, seed=1):
    rng = random.Random(seed)
    t, rows = 0.0, []
    for _ in range(n):
        t += rng.expovariate(8.0)
        p = rng.randint(1, 600)
        o = rng.randint(1, 300)
        ids = [rng.randint(0, 3)] + [rng.randint(0, 10 ** 6) for _ in range(p // 32 - 1)] \
            if p >= 64 else []
        rows.append((t, p, o, o + rng.randint(0, 200), ids))
    return rows


def add(e, rows):
    off, ids = [0], []
    for r in rows:
        ids.extend(r[4])
        off.append(len(ids))
    e.add_requests(Requests([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
            [r[3] for r in rows], hash_offsets=off, hash_ids=ids))


@pytest.mark.parametrize("cfg", [{"policy": "overcommit", "victim": "lifo"}, {},
                                 {"max_queued_requests": 4}])
@pytest.mark.parametrize("prefix", [False, True])
def test_stepping_one_request_at_a_time_gives_what_run_gives(cfg, prefix):
    rows = workload()
    ref = engine(cfg, prefix=prefix)
    add(ref, rows)
    ref.run()
    e = engine(cfg, prefix=prefix)
    e.start(rows[0][0])
    idle_seen = False
    rejections = []
    for r in rows:                       # each request added just as it arrives
        idle_seen |= e.advance(r[0])
        assert e.clock >= r[0]
        e.signals()                      # a look, as a fleet's router scrape: changes nothing
        rejections += e.take_rejections()
        add(e, [r])
    e.drain()
    rejections += e.take_rejections()
    assert e.results() == ref.results()
    # the same refusals, with the same Retry-After to the bit (the drain-rate clock
    # is not moved by signals())
    assert rejections == ref.take_rejections()
    hinted = [x for x in rejections if x[1] == "queue_full"]
    assert all(x[3] is not None for x in hinted)
    assert bool(hinted) == ("max_queued_requests" in cfg)    # Retry-After values compared
    assert e.totals()["preemptions"] == ref.totals()["preemptions"]
    assert e.core.stats() == ref.core.stats()
    assert e.signals()["active_blocks"] == 0


def test_advance_in_slices_with_every_request_added_up_front():
    rows = workload(seed=2)
    ref = engine()
    add(ref, rows)
    ref.run()
    e = engine()
    add(e, rows)
    e.start(0.0)
    t = 0.0
    while not e.advance(t):
        t += 0.37
    assert e.clock == t          # idle: the clock moved to `until`
    e.drain()
    assert e.results() == ref.results()


def test_rejections_are_reported_once_with_retry_after_and_the_signals_count_them():
    e = engine({"max_queued_requests": 2}, num_blocks=16)
    e.start(0.0)
    e.add_requests(Requests([0.0] * 6, [100] * 6, [50] * 6, [50] * 6))
    e.advance(0.001)
    rej = e.take_rejections()
    # 6 arrive at once, before the first step: 2 may wait, 4 are refused (queue_full),
    # each with a Retry-After, at the clock of the step boundary that saw them.
    assert [(r[0], r[1]) for r in rej] == [(i, "queue_full") for i in range(2, 6)]
    assert all(r[2] == 0.0 and r[3] is not None and r[3] > 0 for r in rej)
    assert e.take_rejections() == []
    sig = e.signals()
    assert sig["rejected"] == len(rej)
    assert sig["num_requests_waiting"] + sig["num_requests_running"] == 6 - len(rej)
    assert 0 < sig["kv_cache_usage_perc"] <= 1 and sig["active_blocks"] > 0
    for k in ("kv_headroom_blocks", "admission_pressure", "predicted_queue_delay_s"):
        assert k in sig
    e.drain()
    res = e.results()
    assert all((d is None) == (f >= 0) for d, f in zip(res["rejected"], res["first_token_s"]))
    assert e.signals()["active_blocks"] == 0 and e.signals()["finished"] == 6 - len(rej)


def test_stepping_refuses_an_arrival_before_the_horizon_and_misuse():
    e = engine()
    with pytest.raises(RuntimeError, match="advance before start"):
        e.advance(1.0)
    e.start(0.0)
    e.advance(2.0)
    with pytest.raises(ValueError, match=r"arrival_s\[0\]=1.5: before the engine's horizon 2"):
        e.add_requests(Requests([1.5], [10], [1], [1]))
    with pytest.raises(ValueError, match="until=1.0: before the last advance's until 2"):
        e.advance(1.0)
    with pytest.raises(RuntimeError, match="start after run or start"):
        e.start(3.0)
    with pytest.raises(RuntimeError, match="run after start"):
        e.run()


@pytest.mark.parametrize("bad, match", [
    ({"output_tokens": [5, 0]}, r"output_tokens\[1\]=0"),
    ({"ttft_slo_s": [-1.0, float("nan")]}, r"ttft_slo_s\[1\]=nan"),
    ({"hash_offsets": [0, 2, 1], "hash_ids": [7]}, r"hash_offsets\[2\]=1: must not be below"),
    ({"hash_offsets": [0, 1, 2], "hash_ids": [7]}, r"hash_ids: 1 entries, hash_offsets say 2"),
    ({"priority": [0, 2 ** 70]}, None),            # a value C cannot hold (OverflowError)
    ({"hash_ids": [7, 2 ** 70]}, None),
])
def test_a_refused_batch_adds_nothing(bad, match):
    """A bad row anywhere in a batch refuses the whole batch: the engine runs the
    requests added before it exactly as if the batch had never been offered (a
    half-added batch left the per-request arrays of unequal length)."""
    rows = workload(n=40, seed=3)
    ref = engine(prefix=True)
    add(ref, rows)
    ref.run()
    e = engine(prefix=True)
    add(e, rows)
    cols = {"output_tokens": [5, 5], "ttft_slo_s": None, "hash_offsets": [0, 1, 2],
            "hash_ids": [7, 8], "priority": None}
    cols.update(bad)
    t = rows[-1][0]
    with pytest.raises(OverflowError if match is None else ValueError, match=match):
        e.add_requests(Requests([t, t], [40, 40], cols["output_tokens"], [9, 9],
                priority=cols["priority"], hash_offsets=cols["hash_offsets"],
                hash_ids=cols["hash_ids"], ttft_slo_s=cols["ttft_slo_s"]))
    e.run()
    assert e.results() == ref.results()
    assert e.totals() == ref.totals()


def test_a_turn_whose_parent_has_ended_is_refused_not_lost():
    """A session's next turn arrives when its parent ends; added after that, it
    would never arrive (and drain would report an idle engine with it pending)."""
    e = engine()
    e.start(0.0)
    e.add_requests(Requests([0.0], [10], [2], [2]))
    e.advance(5.0)
    assert e.results()["finish_s"][0] >= 0
    with pytest.raises(ValueError, match=r"parent\[0\]=0: already finished or refused"):
        e.add_requests(Requests([0.0], [10], [2], [2], parent=[0], delay_s=[1.0]))
    e.add_requests(Requests([6.0], [10], [2], [2]))      # the engine is unchanged: it goes on
    e.drain()
    assert [f >= 6.0 for f in e.results()["finish_s"]] == [False, True]


@pytest.mark.parametrize("num_blocks, block_size, message", [
    (64, 0, "block_size=0: must be in [1, 1048576]"),   # was a division by zero (SIGFPE)
    (0, 16, "num_blocks=0: must be >= 1"),              # was "watermark_blocks=0: ..."
])
def test_the_pool_numbers_are_checked_first(num_blocks, block_size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        NativeEngine(AdmissionConfig(), num_blocks, block_size, 2048, 64, 512, step_a=0.01,
                     hash_block_tokens=32)
