"""shortfall: what a running request that finds no free block does (core rule and
the native engine model; vLLM's real scheduler: tests/simulate/test_vllm_engine.py)."""
import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit import AdmissionConfig
from kvadmit.simulate import EngineShape, Workload, get_preset, run_native


@pytest.mark.parametrize("needs,free,paused", [
    ([1, 1, 1], 3, []),              # enough for everyone
    ([1, 1, 1], 2, [2]),             # the last in serving order sits out
    ([2, 1, 1], 2, [1, 2]),          # first come, first served: the first takes both
    ([3, 1, 0], 2, [0]),             # one that does not fit is skipped, later ones still run
    ([0, 2, 1], 1, [1]),             # a request with room in its last block always runs
    ([1, 1], 0, [1]),                # none could run: the first runs (the engine preempts for it)
    ([1], 0, []),                    # alone: nothing to pause, the engine preempts
    ([], 5, []),
])
def test_pause_plan(needs, free, paused):
    core = make_core("overcommit", shortfall="pause")
    assert core.plan_shortfall(needs, free) == paused
    assert core.stats()["paused"] == len(paused)


def test_preempt_never_pauses():
    core = make_core("overcommit")       # shortfall: "preempt", vLLM's behaviour
    assert core.plan_shortfall([1, 1, 1], 0) == []
    assert core.stats()["paused"] == 0


def test_pause_plan_rejects_bad_input():
    core = make_core("overcommit", shortfall="pause")
    with pytest.raises(ValueError, match=r"needs\[1\]=-1"):
        core.plan_shortfall([1, -1], 3)
    with pytest.raises(ValueError, match="free_blocks=-1"):
        core.plan_shortfall([1], -1)


def test_no_admission_in_a_step_with_paused_requests():
    """Paused requests have the first claim on blocks as they free up."""
    core = make_core("overcommit", num_blocks=100, shortfall="pause")
    add_running(core, 8, 50)
    add_running(core, 8, 50)
    w = add_waiting(core, 4, 10)
    assert core.next_admissible(50) == w
    assert core.plan_shortfall([1, 1], 1) == [1]
    held = core.stats()["held"]["hold_blocks"]
    assert core.next_admissible(50) == -1
    assert core.stats()["held"]["hold_blocks"] == held + 1
    core.on_step()                       # the pause lasts one step
    assert core.next_admissible(50) == w
    assert core.plan_shortfall([1, 1], 2) == []
    assert core.next_admissible(50) == w


def test_config_names_the_choices():
    with pytest.raises(ValueError, match="shortfall"):
        AdmissionConfig(shortfall="swap")


def _workload():
    # A burst whose real lengths are far below max_tokens, with short prompts: an
    # optimistic length quantile admits too many, and running requests run dry.
    n = 120
    prompts = [20 + (7 * i) % 60 for i in range(n)]
    outs = [10 + (37 * i) % 150 for i in range(n)]
    return Workload(name="burst", arrival_s=[0.0] * n, prompt_tokens=prompts,
                    output_tokens=outs, max_tokens=[400] * n)


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
        assert t["finished"] == len(w) and t["rejected"] == 0, shortfall
        assert t["output_tokens"] == sum(w.output_tokens), shortfall
        assert t["free_blocks_at_end"] == shape.num_blocks, shortfall
        runs[shortfall] = (t["preemptions"], r.extra["core"]["paused"])
    assert runs["preempt"][0] > 0 and runs["preempt"][1] == 0
    assert runs["pause"][1] > 0
    assert runs["pause"][0] < runs["preempt"][0], runs
