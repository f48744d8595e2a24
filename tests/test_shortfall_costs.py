"""shortfall "cost", the cost model (docs/policies.md#the-cost-model): at a shortfall a
running request pauses or lets the engine recompute its victims, whichever loses less
in the engine's step-time terms (kvadmit._shortfall); under auto a request the peak
holds is admitted past it where the pool it would use outweighs recomputing it
(AutoPolicy)."""
import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit import AdmissionConfig
from kvadmit._shortfall import ShortfallPlanner
from kvadmit._step_plan import StepPlanner
from kvadmit.simulate import EngineShape, Workload, get_preset, run_native

# a CPU-like step: a = 2 ms, b = 30 us per token, c = 0.5 us per context token
COSTS = dict(a=2e-3, b=3e-5, c=5e-7)
SHORT = (1, 4, 1)          # a decode that needs a new block (blocks of 4 tokens)
VICTIM = (1, 99, 25)       # 99 tokens computed, room left in its last block


def plan(rows, free, wait, again=None, budget=100, freed=None):
    p = ShortfallPlanner(True, 4, costed=True)
    want, computed, held = ([r[k] for r in rows] for k in range(3))
    paused = p.plan(want, computed, held, free, budget, costs=dict(COSTS, wait_steps=wait),
                    again=again, freed_blocks=freed)
    return paused, p.recompute_now


def test_a_long_wait_recomputes_the_victim_a_short_one_pauses():
    """Two rows (a slot: half a ~2.1 ms step), no block free. Pausing SHORT costs its
    slots for the wait and the victim's stall once it needs a block (from the 4th
    step on: a block every 4 steps for 2 rows); recomputing the victim costs its 99
    tokens (~3 ms) and its slots instead, and its 25 blocks keep SHORT growing past
    the wait. From a wait of 4 steps the stalls outweigh the 3 ms."""
    assert plan([SHORT, VICTIM], 0, wait=3) == ([0], 0)     # SHORT sits out, the victim runs
    assert plan([SHORT, VICTIM], 0, wait=4) == ([], 1)      # the victim goes, SHORT runs
    assert plan([SHORT, VICTIM], 0, wait=1000) == ([], 1)


def test_a_request_recomputed_in_this_shortfall_is_not_priced_again():
    """The no-thrash rule: the engine's victim was recomputed since a running request
    last finished, so the short ones pause however long the wait."""
    rows = [SHORT, SHORT, VICTIM]
    assert plan(rows, 0, wait=1000) == ([], 1)
    assert plan(rows, 0, wait=1000, again=[0, 0, 1]) == ([0, 1], 0)


def test_every_victim_the_engine_would_take_is_priced():
    """A request short of 3 blocks. The engine frees them from the end: three victims
    of one block each would all sit out the wait to let one run, and free nothing
    beyond its need: it pauses. One victim of 10 blocks frees 7 more, which keep the
    other growing for 14 steps: it is recomputed (unless recomputed already)."""
    need3 = (12, 32, 8)
    assert plan([need3, (1, 3, 1), (1, 3, 1), (1, 3, 1)], 0, wait=1000) == ([0], 0)
    assert plan([need3, (1, 39, 10)], 0, wait=1000) == ([], 1)
    assert plan([need3, (1, 39, 10)], 0, wait=1000, again=[0, 1]) == ([0], 0)


def test_a_victims_shared_prefix_blocks_free_nothing():
    """With prefix caching a victim's blocks that other requests share stay held when
    it is preempted. The 10-block victim above, 7 of its blocks shared: it frees 3,
    just the short one's need, as the three 1-block victims did: it pauses. Sharing 2,
    it frees 8 and is recomputed as before."""
    need3 = (12, 32, 8)
    assert plan([need3, (1, 39, 10)], 0, wait=1000, freed=[8, 3]) == ([0], 0)
    assert plan([need3, (1, 39, 10)], 0, wait=1000, freed=[8, 8]) == ([], 1)
    with pytest.raises(ValueError, match=r"freed_blocks\[1\]=11: more than its held blocks \(10\)"):
        plan([need3, (1, 39, 10)], 0, wait=1000, freed=[8, 11])
    with pytest.raises(ValueError, match="freed_blocks: 1 entries"):
        plan([need3, (1, 39, 10)], 0, wait=1000, freed=[8])


def test_a_free_block_is_taken_before_anything_is_priced():
    assert plan([SHORT, VICTIM], 1, wait=1000) == ([], 0)


def test_only_shortfall_cost_is_priced():
    assert make_core("auto", shortfall="cost").shortfall.costed
    assert make_core("overcommit", shortfall="cost").shortfall.costed
    assert not make_core("auto").shortfall.costed          # auto pauses
    assert not make_core("auto", shortfall="pause").shortfall.costed
    assert not make_core("auto", shortfall="preempt").shortfall.costed


def test_the_core_prices_with_its_fit_and_forecast():
    """An engine's pause rows with their slots (StepPlanner.pause): the core prices
    with its step-time fit (config step_time_*) and the policy's soonest expected
    finish. Running requests with long honest caps ahead make the wait long: the
    short one is not paused."""
    core = make_core("auto", num_blocks=256, block_size=4, shortfall="cost")
    planner = StepPlanner(core)
    a = add_running(core, 4, 400)
    b = add_running(core, 99, 400)
    assert planner.pause([1, 1], [4, 99], [1, 25], None, 0, 100, [a, b]) == []
    assert core.stats()["shortfall_recomputes"] == 1
    with pytest.raises(ValueError, match=r"row 1: freed=26: must be in \[0, held=25\]"):
        planner.pause([1, 1], [4, 99], [1, 25], None, 0, 100, [a, b], [1, 26])
    # the core's own plan without slots (an engine that cannot say which): pause, as
    # before (the second runs on its room; the first waits)
    assert core.plan_shortfall([1, 1], [4, 99], [1, 25], 0, 100) == [0]
    # a request recomputed since the last finish is not priced again
    core.preempt(b, 0.0)
    c = add_running(core, 7, 400)
    core.preempt(c, 0.0)
    core.admit(c, 0.0)
    assert planner.pause([1, 1], [4, 7], [1, 2], None, 0, 100, [a, c]) == [0]
    assert core.stats()["shortfall_recomputes"] == 1


def test_an_engine_counts_freed_blocks_only_in_a_priced_step():
    """Counting the blocks a victim frees walks every held block (the vLLM adapter:
    in Python, every step), so an engine may pass a callable: it is called only in a
    step where a row would pause."""
    core = make_core("auto", num_blocks=256, block_size=4, shortfall="cost")
    planner = StepPlanner(core)
    a, b = add_running(core, 4, 400), add_running(core, 99, 400)
    asked = []

    def freed():
        asked.append(1)
        return [1, 25]
    assert planner.pause([1, 1], [4, 99], [1, 25], None, 2, 100, [a, b], freed) == []
    assert asked == []                            # two free blocks: no row is short
    assert planner.pause([1, 1], [4, 99], [1, 25], None, 0, 100, [a, b], freed) == []
    assert asked == [1] and core.stats()["shortfall_recomputes"] == 1


# The admission half: blocks of 4 tokens, a pool of 20, a fit of a = 1 ms, b = 30 us.
FIT = dict(step_time_a=1e-3, step_time_b=3e-5, step_time_c=0.0, shortfall="cost")


def test_admits_past_the_peak_where_the_pool_it_uses_is_worth_more():
    """A runs 40 tokens for 40 more (peak 20 blocks at its end). C (8 tokens, 40 to
    go) would push the peak to 25 blocks, first over the pool at step 17: until then
    it uses ~16 tokens' worth of idle blocks for 17 steps (17 x 16.5 / 4 / 20 of a
    ~1 ms step: ~3.5 ms) against recomputing its 25 tokens then (0.75 ms)."""
    core = make_core("auto", num_blocks=20, block_size=4, **FIT)
    add_running(core, 40, 40)
    c = add_waiting(core, 8, 40)
    assert core.decide(c, 10) == "admit"
    core.admit(c, 0.0)
    assert core.stats()["past_peak"] == 1
    # the peak rule alone (the default, pausing: no prices) holds it
    core = make_core("auto", num_blocks=20, block_size=4, **dict(FIT, shortfall="auto"))
    add_running(core, 40, 40)
    assert core.decide(add_waiting(core, 8, 40), 10) == "hold_capacity"


def test_holds_where_the_overflow_comes_at_once():
    """D (36 tokens) would be over the pool at its second step: a step's use of idle
    pool is worth less than recomputing its 37 tokens."""
    core = make_core("auto", num_blocks=20, block_size=4, **FIT)
    add_running(core, 40, 40)
    assert core.decide(add_waiting(core, 36, 40), 10) == "hold_capacity"


def test_a_preempted_request_starts_again_once_its_blocks_fit():
    """Priced auto resumes a preempted request as vLLM does, on its blocks alone (its
    stream has stalled); the peak rule would hold it behind A's curve. No later
    request passes it while it waits."""
    core = make_core("auto", num_blocks=20, block_size=4, **FIT)
    add_running(core, 40, 40)
    r = add_running(core, 36, 40)
    core.preempt(r, 0.0)
    later = add_waiting(core, 4, 4)
    assert core.decide(r, 9) == "admit"       # its 36 tokens: 9 blocks
    assert core.next_admissible(8) == -1      # they do not fit: held, and `later` waits
    assert core.next_admissible(9) == r
    # the default (no prices) holds r by the peak
    core = make_core("auto", num_blocks=20, block_size=4, **dict(FIT, shortfall="auto"))
    add_running(core, 40, 40)
    r = add_running(core, 36, 40)
    core.preempt(r, 0.0)
    add_waiting(core, 4, 4)
    assert core.decide(r, 9) == "hold_capacity"


PROMPTS = [40, 120, 24, 200, 64, 96, 150, 30, 80, 60, 110, 45] * 2
OUTPUTS = [180, 40, 260, 90, 300, 20, 150, 220, 60, 240, 100, 200] * 2


@pytest.mark.parametrize("outputs", [OUTPUTS, [200] * len(PROMPTS)])
def test_native_engine_prices_and_loses_nothing(outputs):
    """On a burst in a small pool (mixed lengths; equal lengths with honest caps),
    auto with shortfall "cost" admits past the peak and recomputes some requests; every request
    finishes with its tokens, every block comes back, and it takes fewer steps than
    the default (pausing, admitting by the peak)."""
    shape = EngineShape(num_blocks=32, block_size=16, max_model_len=512, max_num_seqs=64,
                        max_num_batched_tokens=512)
    n = len(PROMPTS)
    caps = [512 - p for p in PROMPTS] if outputs is OUTPUTS else outputs
    w = Workload(name="burst", arrival_s=[0.0] * n, prompt_tokens=PROMPTS,
                 output_tokens=outputs, max_tokens=caps)
    runs = {}
    for name, cfg in (("priced", {"shortfall": "cost"}), ("pause", {})):
        r = run_native(w, AdmissionConfig(**cfg), shape, get_preset("cpu-tiny"))
        t = r.totals
        assert t.finished == n and t.output_tokens == sum(outputs), name
        assert t.free_blocks_at_end == shape.num_blocks, name
        core = r.extra["core"]
        runs[name] = (t.steps, core["shortfall_recomputes"], core["past_peak"])
    assert runs["priced"][1] > 0 and runs["priced"][2] > 0, runs
    assert runs["pause"][1] == 0 and runs["pause"][2] == 0, runs
    assert runs["priced"][0] < runs["pause"][0], runs


def test_an_engine_that_cannot_pause_refuses_cost():
    """SGLang (and vLLM models whose KV layout cannot pause) run a shortfall as a
    preemption: "cost" there is a configuration error naming the key, as "pause" is."""
    from kvadmit.config import ConfigError
    with pytest.raises(ConfigError, match="shortfall='cost'"):
        AdmissionConfig(shortfall="cost").for_engine("no pause here")
    assert AdmissionConfig().for_engine("no pause here").shortfall == "preempt"
