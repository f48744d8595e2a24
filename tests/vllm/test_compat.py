"""kvadmit.vllm.compat: every vLLM symbol kvadmit uses is checked when the engine
builds the scheduler, on the installed vLLM (CI: 0.32.0 and 0.33.0); a missing one
stops start-up with a message naming it, the installed version and the supported ones."""
import logging

import pytest
import vllm

from kvadmit.vllm import compat
from kvadmit.vllm.inprocess import InProcessEngine
from kvadmit.vllm.scheduler import Scheduler


def build(model_dir, **kvadmit):
    return InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                           additional_config={"kvadmit": kvadmit}).scheduler


def test_the_installed_vllm_is_supported_and_complete(model_dir, caplog):
    assert compat.supported(), vllm.__version__
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        build(model_dir, native_allocator=True, shortfall="pause")   # every feature's symbols
    assert "tested on vLLM" not in caplog.text


def test_series():
    assert compat.series("0.33.1rc2") == compat.series("0.33.0+cpu") == "0.33"
    assert compat.supported("0.32.0") and compat.supported("0.33.4")
    assert not compat.supported("0.34.0") and not compat.supported("0.31.1")


def test_a_missing_method_stops_start_up_naming_it(model_dir, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    monkeypatch.delattr(VllmScheduler, "_preempt_request")
    with pytest.raises(compat.VllmCompatError) as e:
        build(model_dir)
    msg = str(e.value)
    assert "Scheduler._preempt_request (a method kvadmit overrides)" in msg
    assert f"installed vLLM {vllm.__version__}" in msg and "supports vLLM 0.32.x, 0.33.x" in msg


def test_a_new_queue_method_stops_start_up_naming_it(model_dir, monkeypatch):
    """vLLM adds an abstract method to its RequestQueue: kvadmit's queue lacks it."""
    from vllm.v1.core.sched.request_queue import RequestQueue
    monkeypatch.setattr(RequestQueue, "__abstractmethods__",
                        RequestQueue.__abstractmethods__ | {"drain_requests"})
    with pytest.raises(compat.VllmCompatError,
                       match="RequestQueue.drain_requests: a queue method GatedWaitingQueue"):
        build(model_dir)


def test_feature_symbols_are_checked_only_with_the_feature(model_dir, monkeypatch):
    """The pause plan's symbols are checked when the config pauses (shortfall pause, or
    policy auto), not otherwise (here a name kvadmit would read that the installed
    vLLM's block manager lacks)."""
    monkeypatch.setattr(compat, "PAUSE_MANAGER_ATTRS", ("req_to_blocks", "blocks_by_request"))
    build(model_dir, policy="overcommit", shortfall="preempt")
    for cfg in ({"policy": "overcommit", "shortfall": "pause"}, {}):   # {}: policy auto pauses
        with pytest.raises(compat.VllmCompatError, match=r"KVCacheManager.coordinator."
                           r"single_type_managers\[0\].blocks_by_request \(shortfall: pause\)"):
            build(model_dir, **cfg)


def test_displacement_symbols_are_checked_under_every_config(model_dir, monkeypatch):
    """A displacement can run under any config (a request's flow header turns flows
    on), so what it reads in vLLM is checked even without pause or priority."""
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    monkeypatch.delattr(VllmScheduler, "_request_blocks_can_be_freed")
    with pytest.raises(compat.VllmCompatError, match=r"Scheduler._request_blocks_can_be_freed"):
        build(model_dir, policy="overcommit", shortfall="preempt")
    monkeypatch.undo()
    monkeypatch.setattr(compat, "DISPLACE_MANAGER_ATTRS", ("req_to_blocks", "blocks_by_request"))
    with pytest.raises(compat.VllmCompatError, match=r"single_type_managers\[0\].blocks_by_request "
                       r"\(displacement\)"):
        build(model_dir, policy="overcommit", shortfall="preempt")


def test_a_moved_module_fails_naming_it():
    with pytest.raises(compat.VllmCompatError, match=r"vllm.v1.core.sched.gone.Scheduler \("):
        compat.import_names(("vllm.v1.core.sched.gone:Scheduler",))


def test_an_untested_version_with_every_symbol_warns(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        build(model_dir)
    assert "kvadmit is tested on vLLM 0.32.x, 0.33.x; found 0.34.0" in caplog.text


# -- what vLLM would schedule: compat.running_step_tokens against vLLM's schedule() --
class _Drafting:
    """The one number of a speculative config vLLM's running loop reads (parallel
    drafting's extra slots a request): speculative decoding cannot run here, its
    budget arithmetic can."""
    max_num_new_slots_for_drafting = 3


def _replay_running_tokens(model_dir, draft_slots=0, interval=1, async_scheduling=False):
    """vLLM's own scheduler (no kvadmit) on a mixed workload: before every step,
    what compat says each running request would get; after it, what vLLM's
    schedule() gave them. Returns the (said, got) pairs and the skips seen."""
    import random

    eng = InProcessEngine(model_dir, num_blocks=400, max_model_len=512, max_num_seqs=16,
                          max_num_batched_tokens=64, enable_chunked_prefill=True,
                          async_scheduling=async_scheduling,
                          engine_args={"long_prefill_token_threshold": 40,
                                       "prefill_schedule_interval": interval})
    s = eng.scheduler
    if draft_slots:
        s.vllm_config.speculative_config = _Drafting()
    rules = compat.step_rules(sched=s)
    rng = random.Random(7)
    pending = [([rng.randrange(3, 1000) for _ in range(rng.randint(8, 200))], rng.randint(4, 40))
               for _ in range(24)]
    pending.append(([5] * 300, 8))   # first, and alone for four steps: no long-prefill cap
    pairs, seen = [], {"capped": 0, "deferred_decode": 0, "held_chunk": 0, "budget_cut": 0,
                       "input_clamp": 0}
    steps = 0
    while pending or s.has_requests():
        if pending and steps % 2 == 0 and not 0 < steps < 6:
            p, m = pending.pop()
            eng.add(p, m)
        if steps % 5 == 4 and s.running:   # vLLM's own per-request deferral (the pause plan's lever)
            s.running[0].next_decode_eligible_step = s.current_step + 2
        running = list(s.running)
        said = compat.running_step_tokens(s, rules)
        chunks = [r.is_prefill_chunk and s.current_step + 1 >= r.next_decode_eligible_step
                  for r in running]      # a prefill chunk not deferred by next_decode_eligible_step
        token_left = s.max_num_scheduled_tokens
        input_left = s.scheduler_config.max_num_batched_tokens
        out = eng.step()
        assert not out.preempted_req_ids      # ample blocks: budgets alone bound the loop
        for i, (req, want, chunk) in enumerate(zip(running, said, chunks)):
            # The first takes min(its tokens, the token budget), as the pause plan has
            # it; the later ones what vLLM's shrinking input budget leaves them.
            expect = max(min(want, token_left, input_left - draft_slots if i else want), 0)
            got = out.num_scheduled_tokens.get(req.request_id, 0)
            pairs.append((req.request_id, steps, expect, got))
            if expect:
                token_left -= expect
                input_left -= expect + draft_slots
            seen["capped"] += want == 40
            seen["input_clamp"] += want == s.scheduler_config.max_num_batched_tokens - draft_slots
            seen["budget_cut"] += 0 < expect < want
            seen["held_chunk"] += want == 0 and chunk
            seen["deferred_decode"] += want == 0 and s.current_step < req.next_decode_eligible_step
        steps += 1
        assert steps < 2000
    return pairs, seen, rules


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("draft_slots", [0, 3])
def test_running_step_tokens_are_what_vllm_schedules(model_dir, draft_slots, async_scheduling):
    """Step by step, every running request gets from vLLM's schedule() what
    compat.running_step_tokens said (after the step's token budget, which the pause
    plan applies itself): long-prefill cap, decode deferral, the per-request input
    budget less the draft slots, budget cuts all seen."""
    pairs, seen, _ = _replay_running_tokens(model_dir, draft_slots, async_scheduling=async_scheduling)
    wrong = [p for p in pairs if p[2] != p[3]]
    assert not wrong, wrong[:5]
    assert len(pairs) > 100
    assert seen["capped"] and seen["deferred_decode"] and seen["budget_cut"], seen
    assert seen["input_clamp"], seen


def test_running_step_tokens_follow_the_release_prefill_cadence(model_dir):
    """prefill_schedule_interval without data parallelism: vLLM 0.33 holds running
    prefill chunks between prefill steps, 0.32 does not; the version table says
    which, and what it says is what the installed vLLM's schedule() does."""
    pairs, seen, rules = _replay_running_tokens(model_dir, interval=3)
    wrong = [p for p in pairs if p[2] != p[3]]
    assert not wrong, wrong[:5]
    assert rules is compat.STEP_RULES[compat.series(vllm.__version__)]
    assert bool(seen["held_chunk"]) == rules.local_prefill_cadence, seen


def test_step_rules_table():
    assert not compat.step_rules("0.32.0").local_prefill_cadence
    assert compat.step_rules("0.33.0+cpu").local_prefill_cadence
    assert set(compat.STEP_RULES) == set(compat.SUPPORTED_SERIES)
    assert compat.step_rules("0.34.0") is compat.STEP_RULES["0.33"]
