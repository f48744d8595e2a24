"""The native engine model (kvadmit._native.NativeEngine): exact timelines on
hand-built scenarios, prefix reuse, sessions, rejections, and no leaks."""
import pytest
from hypothesis import given, strategies as st

from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit import Requests


def engine(policy="overcommit", victim="lifo", num_blocks=3, block_size=4, max_model_len=10,
           max_num_seqs=8, budget=64, a=1.0, b=0.0, c=0.0, **kw):
    return NativeEngine(AdmissionConfig(policy=policy, victim=victim, **kw.pop("cfg", {})),
                        num_blocks, block_size, max_model_len, max_num_seqs, budget,
                        step_a=a, step_b=b, step_c=c, **kw)


def test_one_request_timeline_and_step_time_formula():
    e = engine(a=0.5, b=0.1, c=0.01, num_blocks=4)
    e.add_requests(Requests([0.0], [4], [3], [3]))
    e.run()
    r = e.results()
    # step 1: prefill 4 tokens, context 4 -> 0.5 + 0.4 + 0.04; then decodes of context 5 and 6
    assert r["first_token_s"] == [pytest.approx(0.94)]
    assert r["finish_s"] == [pytest.approx(0.94 + 0.65 + 0.66)]
    t = e.totals()
    assert (t["steps"], t["output_tokens"], t["prefill_tokens"], t["batch_tokens"]) == (3, 3, 4, 6)
    assert t["free_blocks_at_end"] == 4


def test_preemption_by_recompute_exact_timeline():
    # 3 blocks of 4 tokens; A and B (prompt 4, 5 tokens out) cannot both grow.
    e = engine()
    e.add_requests(Requests([0.0, 0.0], [4, 4], [5, 5], [5, 5]))
    e.run()
    r, t = e.results(), e.totals()
    # step 1 prefills both; in step 2 B (latest admitted) is preempted as A takes the
    # last block; B waits (needs 2 blocks, 1 free) until A finishes at t=5, recomputes
    # prompt + its 1 token in step 6 and emits tokens 2..5 at t=6..9.
    assert r["first_token_s"] == [1.0, 1.0]
    assert r["finish_s"] == [5.0, 9.0]
    assert r["preemptions"] == [0, 1]
    assert (t["steps"], t["preemptions"], t["recomputed_tokens"]) == (9, 1, 4)
    assert r["output_tokens"] == [5, 5]


def test_peak_holds_instead_of_preempting():
    e = engine(policy="peak")
    e.add_requests(Requests([0.0, 0.0], [4, 4], [5, 5], [5, 5]))
    e.run()
    r, t = e.results(), e.totals()
    # Both worst cases (2 blocks each) do not fit 3 blocks: B waits until A's
    # curve leaves room, which is A's last step (A holds 2 blocks, B's prefill 1,
    # and A's blocks come back before B grows): B starts at t=4, not t=5.
    assert r["first_token_s"] == [1.0, 5.0]
    assert r["finish_s"] == [5.0, 9.0]
    assert (t["steps"], t["preemptions"], t["recomputed_tokens"]) == (9, 0, 0)


def test_chunked_prefill_and_token_budget():
    e = engine(num_blocks=8, budget=3, max_model_len=16)
    e.add_requests(Requests([0.0], [7], [2], [2]))
    e.run()
    # 7 prompt tokens in chunks of 3, 3, 1: the first token comes with the last chunk.
    assert e.results()["first_token_s"] == [3.0]
    assert e.results()["finish_s"] == [4.0]


def test_without_chunked_prefill_the_budget_must_hold_the_context():
    with pytest.raises(ValueError, match="max_num_batched_tokens=3"):
        engine(budget=3, chunked_prefill=False)


def test_prefix_hits_reuse_cached_blocks():
    e = engine(num_blocks=6, prefix_caching=True, hash_block_tokens=4)
    # Same two prefix ids; the second arrives after the first is done.
    e.add_requests(Requests([0.0, 5.0], [8, 8], [1, 1], [1, 1], hash_offsets=[0, 2, 4],
            hash_ids=[1, 2, 1, 2]))
    e.run()
    t = e.totals()
    # vLLM never serves the last prompt token from cache: 1 of the 2 blocks is a hit.
    assert (t["prefix_hit_tokens"], t["prefix_query_tokens"]) == (4, 16)
    assert t["prefill_tokens"] == 12
    assert t["free_blocks_at_end"] == 6


def test_different_prefixes_do_not_hit():
    e = engine(num_blocks=6, prefix_caching=True, hash_block_tokens=4)
    e.add_requests(Requests([0.0, 5.0], [8, 8], [1, 1], [1, 1], hash_offsets=[0, 2, 4],
            hash_ids=[1, 2, 3, 2]))
    e.run()
    assert e.totals()["prefix_hit_tokens"] == 0


def test_session_turn_arrives_after_its_parent_plus_delay():
    e = engine(num_blocks=6)
    e.add_requests(Requests([0.0, -1.0], [4, 4], [3, 1], [3, 1], parent=[-1, 0],
            delay_s=[0.0, 2.0]))
    e.run()
    r = e.results()
    assert r["finish_s"][0] == 3.0
    assert r["arrival_s"][1] == 5.0 and r["first_token_s"][1] == 6.0


def test_rejections_are_explicit_and_nothing_leaks():
    e = engine(num_blocks=3, max_model_len=10, cfg={"max_queued_requests": 1})
    # over the context; then a queue of one: the 3rd arrival at t=0 is refused
    e.add_requests(Requests([0.0, 0.0, 0.0, 0.0], [9, 4, 4, 4], [2, 2, 2, 2], [2, 2, 2, 2]))
    e.run()
    r, t = e.results(), e.totals()
    assert r["rejected"] == ["context_length", None, "queue_full", "queue_full"]
    assert r["finish_s"][0] == 0.0 and r["first_token_s"][0] == -1.0
    assert (t["finished"], t["rejected"], t["free_blocks_at_end"]) == (1, 3, 3)


@pytest.mark.parametrize("bad, match", [
    (dict(arrival_s=[1.0, 0.0]), "arrival_s\\[1\\]"),
    (dict(output_tokens=[3, 9]), "output_tokens\\[1\\]=9"),
    (dict(prompt_tokens=[4, 0]), "prompt_tokens\\[1\\]=0"),
    (dict(max_tokens=[5]), "max_new_tokens: 1 entries, expected 2"),
    (dict(max_tokens=[5, 0]), "max_new_tokens\\[1\\]=0: must be >= 1"),
])
def test_bad_requests_name_the_field(bad, match):
    cols = dict(arrival_s=[0.0, 1.0], prompt_tokens=[4, 4], output_tokens=[3, 3], max_tokens=[5, 5])
    cols.update(bad)
    with pytest.raises(ValueError, match=match):
        engine().add_requests(Requests(cols["arrival_s"], cols["prompt_tokens"],
                cols["output_tokens"], cols["max_tokens"]))


def test_bad_parent_is_refused():
    with pytest.raises(ValueError, match="parent\\[0\\]=0"):
        engine().add_requests(Requests([0.0], [4], [1], [1], parent=[0], delay_s=[0.0]))


@given(st.lists(st.tuples(st.floats(0, 20), st.integers(1, 40), st.integers(1, 30)),
                min_size=1, max_size=40),
       st.sampled_from(["overcommit", "reserve", "peak", "predict", "adaptive"]),
       st.sampled_from(["lifo", "priority", "lcf", "length"]),
       st.booleans())
def test_every_request_completes_or_is_refused_and_blocks_come_back(reqs, policy, victim, prefix):
    reqs.sort()
    e = NativeEngine(AdmissionConfig(policy=policy, victim=victim), 12, 8, 64, 4, 24,
                     prefix_caching=prefix, step_a=0.01, step_b=0.001, hash_block_tokens=8)
    ids, off = [], [0]
    for _, p, _ in reqs:
        ids.extend(range(p // 8))          # every prompt shares its leading blocks
        off.append(len(ids))
    e.add_requests(Requests([r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs],
            [r[2] + 3 for r in reqs], hash_offsets=off, hash_ids=ids))
    e.run()
    r, t = e.results(), e.totals()
    for i, (_, p, o) in enumerate(reqs):
        if r["rejected"][i] is None:
            assert r["output_tokens"][i] == o
            assert r["arrival_s"][i] < r["first_token_s"][i] <= r["finish_s"][i]
        else:
            assert r["output_tokens"][i] == 0
    assert t["finished"] + t["rejected"] == len(reqs)
    assert t["free_blocks_at_end"] == 12
    if policy in ("reserve", "peak"):
        assert t["preemptions"] == 0


def test_native_totals_have_exactly_the_totals_fields():
    """The native engine's counters and the Python drivers' (RunRecord) are one
    `Totals`: a counter one side adds and the other lacks fails here or in
    RunRecord.totals (a missing keyword), not silently in a table."""
    import dataclasses

    from kvadmit.simulate.record import RunRecord, Totals
    e = engine()
    e.add_requests(Requests([0.0, 0.0], [4, 4], [5, 5], [5, 5]))
    e.run()
    counts = e.totals()
    totals = Totals.from_engine(counts)
    assert totals.as_dict() == counts and list(totals.as_dict()) == list(counts)
    with pytest.raises(ValueError, match=r"missing \['held_for_blocks'\]"):
        Totals.from_engine({k: v for k, v in counts.items() if k != "held_for_blocks"})
    with pytest.raises(ValueError, match=r"not in Totals \['new_counter'\]"):
        Totals.from_engine({**counts, "new_counter": 1})
    record = RunRecord(1, 3, 0.0, 1.0).totals(2.0, 3, prefix_hit_tokens=0, prefix_query_tokens=0,
                                               held_for_blocks=0)
    assert [f.name for f in dataclasses.fields(record)] == list(counts)
