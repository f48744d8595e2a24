"""Session holds (issue 55): a client's kv_hold_s releases its session's cached KV to
the front of the eviction order -- at once when it says the session is done (0), or
when it is not back by its hold -- and a session that comes back keeps its place."""
import pytest

from kvadmit.config import AdmissionConfig
from kvadmit.request_fields import FieldError, parse
from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.run import run_policy
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import agent_sessions, append_turn, session_workload
from kvadmit._session_hold import SessionHold


def test_done_releases_now_and_a_hold_when_it_runs_out():
    h = SessionHold()
    assert h.finished(7, 1.0, 0.0)                       # done: released at once
    assert not h.finished(8, 1.0, 2.0)
    assert h.take_due(2.99) == [] and h.take_due(3.0) == [8]
    assert h.take_due(100.0) == []                       # each hold once
    assert not h.finished(-1, 1.0, 0.0) and not h.finished(9, 1.0, -1.0)   # none given


def test_voided_holds_do_not_pile_up():
    """Sessions that come back before their hold leave no entry behind for long: a
    server that runs for days keeps at most about twice its pending holds."""
    h = SessionHold()
    for i in range(10_000):
        h.finished(i % 50, float(i), 86400.0)            # a day's hold, replaced each turn
        if i % 3 == 0:
            h.returned(i % 50)
    pending = h.pending
    assert 0 < pending <= 50 and h.queued <= 2 * pending + 65
    due = h.take_due(1e9)                                # each pending session once
    assert len(due) == len(set(due)) == pending and h.pending == 0


def test_a_session_back_before_its_hold_keeps_its_place():
    h = SessionHold()
    h.finished(5, 0.0, 1.0)
    h.returned(5)
    assert h.take_due(10.0) == []
    h.finished(5, 2.0, 1.0)                              # a later turn's hold counts anew
    h.finished(5, 2.5, 4.0)                              # the latest hold replaces it
    assert h.take_due(3.5) == [] and h.take_due(6.5) == [5]
    assert h.stats() == {"released": 0, "expired": 1, "came_back": 1}


def test_the_field_is_checked_at_the_first_layer():
    assert parse({"kv_hold_s": 0}).kv_hold_s == 0.0
    assert parse({"kv_hold_s": 30}).kv_hold_s == 30.0
    for bad in (-1, 1e9, "soon", float("nan")):
        with pytest.raises(FieldError, match="kv_hold_s"):
            parse({"kv_hold_s": bad})


BS = 16


def _two_sessions(done_hint: bool):
    """Session 1 ends first and comes back after 5 s; session 0 ends later, for good
    (kv_hold_s 0 when `done_hint`); at 3 s a stranger needs most of the pool. LRU
    evicts session 1's history first (freed first); the hint evicts session 0's."""
    w = session_workload("two", BS)
    nid = 1 << 40
    ctx1: list[int] = []
    nid = append_turn(w, ctx1, nid, 0.0, 160, 16, 16, -1, 0.0, 1)
    nid = append_turn(w, ctx1, nid, 0.0, 176 + 32, 16, 16, 0, 5.0, 1)
    nid = append_turn(w, [], nid, 0.5, 160, 48, 48, -1, 0.0, 0)
    nid = append_turn(w, [], nid, 3.0, 320, 1, 1, -1, 0.0, 2)
    order = sorted(range(len(w)), key=lambda i: (w.arrival_s[i] if w.parent[i] < 0 else 1e9))
    assert order == [0, 2, 3, 1]
    if done_hint:
        w.record_columns["kv_hold_s"] = [-1.0, -1.0, 0.0, -1.0]
    return w


@pytest.mark.parametrize("policy", ["auto", "vllm-default"])
def test_a_done_session_is_evicted_before_one_coming_back(policy):
    step = StepTimeModel(1e-3, 1e-5, 0.0, name="t", num_blocks=36, block_size=BS, max_model_len=512)
    shape = EngineShape(num_blocks=36, block_size=BS, max_model_len=512, max_num_seqs=8,
                        max_num_batched_tokens=512, prefix_caching=True)
    hits = {}
    for hint in (False, True):
        raw = run_policy(_two_sessions(hint), parse_policy(policy), "native", shape, step,
                         AdmissionConfig())
        assert raw.totals.finished == 4 and raw.totals.free_blocks_at_end == 36
        hits[hint] = raw.totals.prefix_hit_tokens
    if policy == "vllm-default":
        assert hits[True] == hits[False]          # vLLM's own eviction ignores the field
    else:
        # session 1's history (10 computed blocks: the last output token has no KV)
        # survives the stranger whole; without the hint LRU took most of it
        assert hits[True] == 10 * BS and hits[False] <= 5 * BS, hits


def test_agent_clients_say_when_a_session_is_done():
    w = agent_sessions(20, 2.0, seed=1, kv_hold="done")
    holds = w.record_columns["kv_hold_s"]
    last = {s: i for i, s in enumerate(w.session)}
    assert [i for i, h in enumerate(holds) if h == 0.0] == sorted(last.values())
    assert all(h == -1.0 for i, h in enumerate(holds) if i not in last.values())
    assert "kv_hold_s" not in w.without_kvadmit_fields().record_columns
    with pytest.raises(ValueError, match="kv_hold"):
        agent_sessions(2, 1.0, kv_hold="soon")


def test_a_done_session_releases_its_own_blocks_not_the_prefix_it_shares():
    """Sessions 0 and 1 share a 4-block prefix; session 1 says it is done. Its own two
    blocks go first; the shared prefix stays in LRU order, so a stranger that takes
    16 of the 20 blocks leaves it for session 2, which hits it whole."""
    w = session_workload("shared", BS)
    prefix = [100, 101, 102, 103]
    nid = 1 << 40
    nid = append_turn(w, list(prefix), nid, 0.0, 96, 1, 1, -1, 0.0, 0)
    nid = append_turn(w, list(prefix), nid, 0.5, 96, 1, 1, -1, 0.0, 1)
    nid = append_turn(w, [], nid, 1.0, 240, 1, 1, -1, 0.0, 3)        # the stranger: 16 blocks
    nid = append_turn(w, list(prefix), nid, 2.0, 96, 1, 1, -1, 0.0, 2)
    w.record_columns["kv_hold_s"] = [-1.0, 0.0, -1.0, -1.0]
    step = StepTimeModel(1e-3, 1e-5, 0.0, name="t", num_blocks=20, block_size=BS, max_model_len=256)
    shape = EngineShape(num_blocks=20, block_size=BS, max_model_len=256, max_num_seqs=8,
                        max_num_batched_tokens=512, prefix_caching=True)
    raw = run_policy(w, parse_policy("auto"), "native", shape, step, AdmissionConfig())
    assert raw.totals.finished == 4 and raw.totals.free_blocks_at_end == 20
    assert raw.totals.prefix_hit_tokens == 2 * 4 * BS      # sessions 1 and 2 on the prefix


def test_a_session_not_back_by_its_hold_loses_its_tail_first():
    """Session 1 says it will be back within 1 s and comes back after 5 s: released at
    1 s, its blocks go to the head of the free queue, last block first, so a stranger
    taking 3 blocks leaves its first 3 and its return hits them."""
    w = session_workload("late", BS)
    nid = 1 << 40
    ctx: list[int] = []
    nid = append_turn(w, ctx, nid, 0.0, 96, 1, 1, -1, 0.0, 1)
    nid = append_turn(w, ctx, nid, 0.0, 112, 1, 1, 0, 5.0, 1)
    nid = append_turn(w, [], nid, 3.0, 47, 1, 1, -1, 0.0, 3)         # the stranger: 3 blocks
    w.record_columns["kv_hold_s"] = [1.0, -1.0, -1.0]
    step = StepTimeModel(1e-3, 1e-5, 0.0, name="t", num_blocks=20, block_size=BS, max_model_len=256)
    shape = EngineShape(num_blocks=20, block_size=BS, max_model_len=256, max_num_seqs=8,
                        max_num_batched_tokens=512, prefix_caching=True)
    raw = run_policy(w, parse_policy("auto"), "native", shape, step, AdmissionConfig())
    assert raw.totals.finished == 3 and raw.totals.free_blocks_at_end == 20
    assert raw.totals.prefix_hit_tokens == 3 * BS
