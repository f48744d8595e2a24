"""The core port's step entry without an engine: `CorePort.step(StepReport)`
at a step's start and `step_done` once the engine scheduled it, the sequence both
adapters run (kvadmit.vllm.admission, kvadmit.sglang.adapter)."""
from helpers import make_core
from kvadmit.arrival import ArrivalRecord
from kvadmit.port import CorePort, StepReport


def arrive(port, key, prompt, max_new, now=0.0):
    arrival = port.arrive(key, object(), lambda: ArrivalRecord(prompt, max_new), now)
    assert arrival.accepted, arrival.refusal
    return arrival.slot


def test_step_reports_progress_and_plans_the_victim_order():
    core = make_core("peak", num_blocks=40, victim="length")
    port = CorePort(core)
    a, b = arrive(port, "a", 8, 20), arrive(port, "b", 8, 4)
    core.admit(a, 0.0)                  # b starts outside the gate: the step admits it
    plan = port.step(StepReport(now=1.0, used_blocks=6, slots=[a, b], computed=[10, 9],
                                  generated=[2, 1]))
    assert core.state(b) == "running" and core.num_running == 2
    assert core.info(a)["computed_tokens"] == 10 and core.info(b)["generated_tokens"] == 1
    assert sorted(plan.victim_order) == [a, b] and plan.victim_order == core.victim_order()


def test_step_time_is_the_interval_between_step_starts_charged_to_what_ran():
    core = make_core("peak", num_blocks=40)
    port = CorePort(core)
    port.step(StepReport(now=1.0, used_blocks=0))
    port.step_done(64, 640, now=1.0)
    port.step(StepReport(now=1.5, used_blocks=0))           # 0.5 s for 64 tokens
    assert port.observed_steps == 1
    port.step_done(0, 0, now=1.5)                           # nothing ran
    port.step(StepReport(now=9.0, used_blocks=0))           # idle: not a step time
    port.step_done(32, 320, now=9.0)
    port.step(StepReport(now=9.2, used_blocks=0, fresh=False))   # a skipped iteration
    assert port.observed_steps == 1
    assert core.stats()["step_time_fit"]["observations"] == 1


def test_step_done_notes_prefix_hits_for_the_next_cache_signal():
    core = make_core("peak", num_blocks=40, agent_window=True)
    port = CorePort(core)
    port.step(StepReport(now=0.0, used_blocks=4))
    port.step_done(16, 16, now=0.0, hit_tokens=8, query_tokens=32)
    assert (port.prefix_hit_tokens, port.prefix_query_tokens) == (8, 32)
    port.step(StepReport(now=0.1, used_blocks=4))           # the window sees them: 8 of 32
    assert core.pending_prefix_hits == (0, 0)


def test_shared_prefix_counting_reports_blocks_in_use_only_when_asked():
    """policy auto discounts a prefix running requests share, and counts instead the
    blocks in use beyond the running requests' own parts: those reach it only where
    the adapter reports shared prefixes (vLLM with prefix caching; not SGLang)."""
    def admissible(counts):
        core = make_core("auto", num_blocks=40, block_size=4)
        port = CorePort(core, counts_shared_prefix=counts)
        s = arrive(port, "a", 8, 4)
        core.admit(s, 0.0)
        # 30 blocks in use, 2 of them the running request's own.
        port.step(StepReport(now=0.0, used_blocks=30, slots=[s], computed=[8], generated=[0]))
        b = arrive(port, "b", 40, 4, now=0.0)      # 11 blocks at its peak
        return core.next_admissible(10, False) == b
    assert not admissible(True) and admissible(False)
