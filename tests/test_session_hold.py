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
    assert h.finished(7, 1.0, 0.0) == [7]              # done: released at once
    assert h.finished(8, 1.0, 2.0) == []
    assert h.take_due(2.99) == [] and h.take_due(3.0) == [8]
    assert h.take_due(100.0) == []                       # each hold once
    assert h.finished(-1, 1.0, 0.0) == [] and h.finished(9, 1.0, -1.0) == []   # none given


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
