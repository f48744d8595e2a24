"""shortfall: what a running request that finds no free block does (core rule and
the native engine model; vLLM's real scheduler: tests/simulate/test_vllm_engine.py)."""
import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit import AdmissionConfig
from kvadmit.simulate import EngineShape, Workload, get_preset, run_native


# Requests by (want tokens, computed tokens, held blocks), blocks of 4 tokens:
D1 = (1, 4, 1)      # a decode that needs a new block
D0 = (1, 5, 2)      # a decode with room left in its last block
P8 = (8, 0, 0)      # an 8-token prefill: 2 blocks
SKIP = (0, 9, 3)    # the engine does not run it this step


@pytest.mark.parametrize("reqs,free,budget,paused", [
    ([D1, D1, D1], 3, 100, []),            # enough for everyone
    ([D1, D1, D1], 2, 100, [2]),           # the last in serving order sits out
    ([P8, D1, D1], 2, 100, [1, 2]),        # first come, first served: the prefill takes both
    ([P8, D1, D0], 1, 100, [0]),           # one that does not fit is skipped; later ones run
    ([D0, P8, D1], 1, 100, [1]),           # room in the last block: always runs
    ([D1, D1], 0, 100, [1]),               # none could run: the first runs (the engine preempts)
    ([SKIP, D1, D1], 0, 100, [2]),         # ... the first that wants to run
    ([D1], 0, 100, []),                    # alone: nothing to pause, the engine preempts
    ([SKIP], 0, 100, []),
    ([], 5, 100, []),
    # A paused request leaves its tokens to those behind it: with a budget of 8 the
    # prefill after it still gets its 8 tokens (2 blocks) and runs.
    ([(8, 1, 0), (8, 0, 0)], 2, 8, [0]),
    # The budget caps a request's tokens (8 wanted, 4 left: 1 block); a request the
    # budget does not reach is not paused (the engine does not run it anyway).
    ([(4, 0, 0), (8, 0, 0), D1], 2, 8, []),
    # With 9: the second gets 5 tokens (2 blocks), too many; the decode behind runs.
    ([(4, 0, 0), (8, 0, 0), D1], 2, 9, [1]),
])
def test_pause_plan(reqs, free, budget, paused):
    core = make_core("overcommit", shortfall="pause")
    want, computed, held = ([r[k] for r in reqs] for k in range(3))
    assert core.plan_shortfall(want, computed, held, free, budget) == paused
    assert core.stats()["paused"] == len(paused)


def test_lookahead_tokens_need_their_slots():
    core = make_core("overcommit", shortfall="pause")
    # 5 + 1 tokens fit the 2 blocks held; with 3 lookahead slots they need a third.
    assert core.plan_shortfall([1, 1], [5, 5], [2, 2], 1, 100) == []
    assert core.plan_shortfall([1, 1], [5, 5], [2, 2], 1, 100, lookahead_tokens=3) == [1]


def test_preempt_never_pauses():
    core = make_core("overcommit")       # shortfall: "preempt", vLLM's behaviour
    assert core.plan_shortfall([1, 1, 1], [4, 4, 4], [1, 1, 1], 0, 100) == []
    assert core.stats()["paused"] == 0


def test_pause_plan_rejects_bad_input():
    core = make_core("overcommit", shortfall="pause")
    with pytest.raises(ValueError, match=r"held_blocks\[1\]=-1"):
        core.plan_shortfall([1, 1], [4, 4], [1, -1], 3, 100)
    with pytest.raises(ValueError, match="free_blocks=-1"):
        core.plan_shortfall([1], [4], [1], -1, 100)
    with pytest.raises(ValueError, match="one entry per running request"):
        core.plan_shortfall([1, 1], [4], [1, 1], 3, 100)


def test_no_admission_in_a_step_with_paused_requests():
    """Paused requests have the first claim on blocks as they free up."""
    core = make_core("overcommit", num_blocks=100, shortfall="pause")
    add_running(core, 8, 50)
    add_running(core, 8, 50)
    w = add_waiting(core, 4, 10)
    assert core.next_admissible(50) == w
    assert core.plan_shortfall([1, 1], [4, 4], [1, 1], 1, 100) == [1]
    assert core.next_admissible(50) == -1
    assert core.stats()["held"]["hold_paused"] == 1
    core.on_step(0.0)                       # the pause lasts one step
    assert core.next_admissible(50) == w
    assert core.plan_shortfall([1, 1], [4, 4], [1, 1], 2, 100) == []
    assert core.next_admissible(50) == w


def test_config_names_the_choices():
    with pytest.raises(ValueError, match="shortfall"):
        AdmissionConfig(shortfall="swap")


# A burst of 120 requests whose real lengths (10-159) are far below max_tokens (400),
# with short prompts: overcommit or an optimistic length quantile admits too many,
# and running requests run dry.
PROMPTS = [20 + (7 * i) % 60 for i in range(120)]
OUTPUTS = [10 + (37 * i) % 150 for i in range(120)]


def _workload():
    n = len(PROMPTS)
    return Workload(name="burst", arrival_s=[0.0] * n, prompt_tokens=PROMPTS,
                    output_tokens=OUTPUTS, max_tokens=[400] * n)


@pytest.mark.parametrize("policy", ["overcommit", "adaptive"])
def test_native_engine_pauses_instead_of_preempting(policy):
    """Same workload and admission, shortfall preempt against pause: every request
    finishes with its tokens, every block comes back, and pausing replaces most
    preemptions."""
    shape = EngineShape(num_blocks=32, block_size=16, max_model_len=512, max_num_seqs=64,
                        max_num_batched_tokens=512)
    w = _workload()
    base = dict(policy=policy, adaptive_quantile=0.2, adaptive_max_quantile=0.2,
                adaptive_min_samples=1)
    runs = {}
    for shortfall in ("preempt", "pause"):
        r = run_native(w, AdmissionConfig(shortfall=shortfall, **base), shape, get_preset("cpu-tiny"))
        t = r.totals
        assert t.finished == len(w) and t.rejected == 0, shortfall
        assert t.output_tokens == sum(w.output_tokens), shortfall
        assert t.free_blocks_at_end == shape.num_blocks, shortfall
        runs[shortfall] = (t.preemptions, r.extra["core"]["paused"])
    assert runs["preempt"][0] > 0 and runs["preempt"][1] == 0
    assert runs["pause"][1] > 0
    assert runs["pause"][0] < runs["preempt"][0], runs


def test_lockstep_model_pauses_too():
    from oracle.lockstep import Request, run_lockstep
    reqs = [Request(0, p, 400, o) for p, o in zip(PROMPTS, OUTPUTS)]
    res = {}
    for shortfall in ("preempt", "pause"):
        r = run_lockstep(AdmissionConfig(policy="overcommit", shortfall=shortfall), reqs,
                         num_blocks=32, block_size=16)
        assert r.finished == len(reqs) and r.leaked_blocks == 0, shortfall
        assert r.output_tokens == sum(q.output_tokens for q in reqs), shortfall
        res[shortfall] = r.preemptions
    assert 0 <= res["pause"] < res["preempt"], res


def test_a_pause_does_not_hold_a_request_that_may_take_the_paused_ones_kv():
    """Under queue_order "priority" a waiting request more important than running
    ones may take their KV (priority retraction): their pause does not hold it, while
    it still holds one of their own priority."""
    core = make_core("overcommit", num_blocks=100, shortfall="pause", queue_order="priority")
    add_running(core, 8, 50, priority=5)
    add_running(core, 8, 50, priority=5)
    same = add_waiting(core, 4, 10, priority=5)
    assert core.plan_shortfall([1, 1], [4, 4], [1, 1], 1, 100, priorities=[5, 5]) == [1]
    assert core.next_admissible(50) == -1
    chat = add_waiting(core, 4, 10, priority=0)
    assert core.next_admissible(50) == chat
    assert core.waiting() == [chat, same]
