"""Workloads (traces, synthetic, agent sessions), metrics and the step-time presets."""
import math
import pathlib

import pytest

from kvadmit.simulate.metrics import Slo, percentile, summarize
from kvadmit.simulate.record import Totals
from kvadmit.simulate.steptime import H100, LLAMA_8B, PRESETS, StepTimeModel, roofline
from kvadmit.simulate.workload import agent_sessions, from_trace, synthetic
from kvadmit.traces import TraceError

DATA = pathlib.Path(__file__).parent.parent / "data"


def test_azure_excerpt_with_max_tokens_rules():
    w = from_trace(DATA / "azure2023_conv_head200.csv", max_tokens_rule="context",
                   max_tokens_cap=2048, max_model_len=4096)
    assert len(w) == 200 and w.arrival_s[0] == 0.0
    for p, o, m in zip(w.prompt_tokens, w.output_tokens, w.max_tokens):
        assert m >= o and (m == min(2048, 4096 - p) or m == o)
    fast = w.scaled(2.0)
    assert fast.arrival_s[-1] == pytest.approx(w.arrival_s[-1] / 2)
    assert w.with_oracle_caps().max_tokens == w.output_tokens


def test_trace_repeat_appends_copies_in_time_order():
    w = from_trace(DATA / "azure2023_conv_head200.csv", repeat=3)
    assert len(w) == 600
    assert all(a <= b for a, b in zip(w.arrival_s, w.arrival_s[1:]))
    assert w.prompt_tokens[:200] == w.prompt_tokens[400:]


def test_mooncake_hash_ids_become_csr_columns():
    w = from_trace(DATA / "mooncake_conversation_head50.jsonl")
    assert w.hash_block_tokens == 512 and len(w.hash_offsets) == 51
    assert w.hash_ids_of(0)[:3] == [0, 1, 2] and w.hash_ids_of(1)[0] == 0


def test_malformed_trace_line_is_named(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,5\n"
                   "2023-11-16 18:15:47.1,ten,5\n")
    with pytest.raises(TraceError, match="t.csv line 3: ContextTokens='ten'"):
        from_trace(bad)


def test_synthetic_is_deterministic_and_bursty():
    a, b = synthetic(2000, 10.0, seed=3), synthetic(2000, 10.0, seed=3)
    assert a.arrival_s == b.arrival_s and a.output_tokens == b.output_tokens
    assert synthetic(2000, 10.0, seed=4).arrival_s != a.arrival_s
    for w, cv_lo, cv_hi in ((a, 0.9, 1.1), (synthetic(4000, 10.0, seed=3, burst_cv=3.0), 2.4, 3.6)):
        gaps = [y - x for x, y in zip(w.arrival_s, w.arrival_s[1:])]
        mean = sum(gaps) / len(gaps)
        cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
        assert cv_lo < cv < cv_hi
        assert 0.08 < mean < 0.12
    assert all(1 <= o <= m for o, m in zip(a.output_tokens, a.max_tokens))


def test_agent_turns_extend_their_session_context():
    w = agent_sessions(30, 1.0, seed=1, block_tokens=16)
    for i, p in enumerate(w.parent):
        if p < 0:
            assert w.arrival_s[i] >= 0 and w.hash_ids_of(i)[:128] == list(range(128))
            continue
        assert w.session[i] == w.session[p] and w.delay_s[i] >= 0
        assert w.prompt_tokens[i] > w.prompt_tokens[p] + w.output_tokens[p] - 1
        prev = w.hash_ids_of(p)
        assert w.hash_ids_of(i)[:len(prev)] == prev           # the history is a shared prefix
        assert w.hashed_tokens[i] <= w.prompt_tokens[i] + w.output_tokens[i]
    assert sum(1 for p in w.parent if p >= 0) > 30


def test_percentile_nearest_rank():
    v = [1.0, 2.0, 3.0, 4.0]
    assert (percentile(v, 50), percentile(v, 99), percentile(v, 0)) == (2.0, 4.0, 1.0)
    assert math.isnan(percentile([], 50))


def test_goodput_counts_refused_requests_as_misses():
    per = {"arrival_s": [0.0, 0.0, 1.0, 2.0], "first_token_s": [0.5, 3.0, 1.2, -1.0],
           "finish_s": [1.5, 3.5, 3.2, 2.0], "output_tokens": [11, 6, 3, 0],
           "preemptions": [0, 0, 0, 0], "rejected": [None, None, None, "queue_full"]}
    totals = Totals(makespan_s=4.0, output_tokens=20, preemptions=0, recomputed_tokens=0,
                    steps=9, kv_util_mean=0.5, kv_util_peak=0.9, prefix_hit_tokens=0,
                    prefix_query_tokens=0, prefill_tokens=20, batch_tokens=40, held_for_blocks=0,
                    busy_s=4.0, finished=3, rejected=1, free_blocks_at_end=10)
    s = summarize(per, totals, Slo(ttft_s=1.0, tpot_s=0.5))
    # TTFT 0.5/3.0/0.2, TPOT 0.1/0.1/1.0: only the first meets both
    assert s["goodput"] == 0.25 and s["finished"] == 3 and s["rejected"] == {"queue_full": 1}
    assert s["throughput_tok_s"] == 5.0 and s["ttft_p50_s"] == 0.5


def test_roofline_preset_numbers():
    m = roofline(H100, LLAMA_8B)
    assert m.a == pytest.approx(16.06e9 / (3.35e12 * 0.8) + 0.002)
    assert m.b == pytest.approx(2 * 8.03e9 / (989e12 * 0.5))
    assert m.c == pytest.approx(131072 / (3.35e12 * 0.8))
    assert m.num_blocks == int((80e9 * 0.9 - 16.06e9) / 131072 // 16)
    assert set(PRESETS) >= {"h100-8b", "h200-8b", "h100x4-70b", "cpu-tiny"}


def test_step_time_model_refuses_bad_constants():
    with pytest.raises(ValueError, match="step time b=-1"):
        StepTimeModel(0.1, -1, 0)
