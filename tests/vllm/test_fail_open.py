"""When kvadmit itself fails inside vLLM's engine it fails open (the default) or closed
(`on_internal_error: closed`), docs/trust-and-failure.md, "When kvadmit itself fails".
A fault is injected here, in the test, at a chosen point of kvadmit's code, on vLLM's
real scheduler in-process under load (with two samples of an n = 3 request waiting for
their sibling):

- open: logged once, counted, every request kvadmit held handed to vLLM's own
  scheduling, nothing refused; every request finishes with its whole output;
- closed: logged once, counted; every request held that had not started (the samples
  too) is refused with kvadmit:failed_closed (503) within one step, every new arrival
  at once; every request that had started finishes with its whole output.

Either way every KV block comes back and the engine goes on stepping."""
import logging

import pytest
from helpers import fail_on_call

from kvadmit.protocol import Refusal, samples_marker
from kvadmit.vllm import failure
from kvadmit.vllm.admission import VllmAdmission
from kvadmit.vllm.inprocess import InProcessEngine
from kvadmit.vllm.scheduler import GatedWaitingQueue, Scheduler

POINTS = [("before_step", 6, False), ("choose", 9, False), ("arrive", 5, False),
          ("leave", 3, False), ("choose", 9, True)]
POINT_IDS = ["before-a-step", "inside-vllms-step", "on-arrival", "as-one-leaves",
             "async-inside"]
CLOSED = "kvadmit:failed_closed"


def load(eng, n=24, first=0):
    """n requests on a pool too small for all: kvadmit holds and pauses some.
    Returns request id -> its whole output's length."""
    want = {}
    for i in range(first, first + n):
        out = 8 + (5 * i) % 50
        want[eng.add([3 + i % 50] * (20 + 7 * i % 90), 64, output_tokens=out)] = out
    return want


def waiting_samples(eng, parent="grp"):
    """Two of three samples of one request: they wait for their sibling in kvadmit."""
    return {eng.add([5] * 30, 64, output_tokens=10, request_id=f"{i}_{parent}",
                    extra_args=samples_marker(3, parent)): 10 for i in range(2)}


def engine(model_dir, mode, async_scheduling):
    return InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                           max_num_seqs=16, async_scheduling=async_scheduling,
                           additional_config={"kvadmit": {"on_internal_error": mode}})


@pytest.mark.parametrize("where, n, async_scheduling", POINTS, ids=POINT_IDS)
def test_a_fault_fails_open_and_nothing_is_lost(model_dir, monkeypatch, caplog, where, n,
                                                async_scheduling):
    calls = fail_on_call(monkeypatch, VllmAdmission, where, n)
    eng = engine(model_dir, "open", async_scheduling)
    s = eng.scheduler
    with caplog.at_level(logging.ERROR, logger="kvadmit.vllm"):
        want = waiting_samples(eng) | load(eng)
        log = eng.run(max_steps=5000)
    assert len(calls) >= n, "the fault point was never reached"
    assert s.kvadmit.failed and not s.kvadmit.failed_closed and s.kvadmit.internal_errors == 1
    assert sum("failing open" in r.getMessage() for r in caplog.records) == 1
    assert not isinstance(s.waiting, GatedWaitingQueue)       # vLLM's own queue now
    # every request finished on its own, with its whole output; none refused
    assert set(log.finished) == set(want)
    assert all(reason == "stop" for reason in map(str.lower, log.finished.values())), log.finished
    assert all(len(log.outputs[rid]) == k for rid, k in want.items())
    assert not [r for r in log.stop_reasons.values() if str(r).startswith("kvadmit:")]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1
    # and the engine serves on: vLLM's rule, kvadmit out of the way
    more = load(eng, 6)
    log = eng.run(max_steps=5000)
    assert set(more) <= set(log.finished)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1


def unstarted(s) -> set:
    """Ids of the requests that wait in kvadmit and never started (samples included)."""
    ids = {r.request_id for r in s.waiting if failure.never_started(r)}
    return ids | {r.request_id for members in s.kvadmit.samples_awaiting_siblings.values()
                  for r in members}


def refused_closed(log, rid) -> bool:
    """The request finished refused with failed_closed: a 503, no token sent."""
    if log.stop_reasons.get(rid) != CLOSED:
        return False
    refusal = Refusal.from_output(log.stop_reasons[rid], log.kv_transfer_params.get(rid))
    assert refusal.status == 503 and refusal.retry_after is None, refusal
    assert refusal.client_message().startswith(CLOSED + ": kvadmit failed inside this engine")
    assert str(log.finished[rid]).lower() == "abort" and not log.outputs[rid], rid
    return True


@pytest.mark.parametrize("where, n, async_scheduling", POINTS, ids=POINT_IDS)
def test_a_fault_fails_closed_refusing_the_held_and_new_and_finishing_the_running(
        model_dir, monkeypatch, caplog, where, n, async_scheduling):
    calls = fail_on_call(monkeypatch, VllmAdmission, where, n)
    eng = engine(model_dir, "closed", async_scheduling)
    s = eng.scheduler
    with caplog.at_level(logging.ERROR, logger="kvadmit.vllm"):
        want = waiting_samples(eng) | load(eng)
        log = eng.log
        # The fault may come on an arrival (before any step): then nothing had started.
        failed_at, held = (0, set(want)) if s.kvadmit.failed else (None, set())
        while s.has_requests() and log.steps < 5000:
            before = set() if s.kvadmit.failed else unstarted(s)
            eng.step()
            if failed_at is None and s.kvadmit.failed:
                failed_at, held = log.steps, before
            if failed_at is not None and log.steps == failed_at + 1:
                # within one step: every held request that did not start before the
                # fault is refused, and nothing that never started waits any more
                for rid in held:
                    req = s.requests.get(rid)
                    assert (refused_closed(log, rid) or str(log.finished.get(rid)).lower() == "stop"
                            or (req is not None and not failure.never_started(req))), rid
                assert not unstarted(s) and not [
                    r for r in s.requests.values() if failure.never_started(r)]
    assert len(calls) >= n and failed_at is not None, "the fault point was never reached"
    assert not s.has_requests(), "still busy"
    assert s.kvadmit.failed_closed and s.kvadmit.internal_errors == 1
    assert sum("failing closed" in r.getMessage() for r in caplog.records) == 1
    assert not isinstance(s.waiting, GatedWaitingQueue)       # vLLM's own queue now
    # every request has its answer: refused with failed_closed (it never started), or
    # finished on its own with its whole output
    assert set(log.finished) == set(want)
    refused = {rid for rid in want if refused_closed(log, rid)}
    assert held - refused <= {r for r in want if log.outputs[r]}   # the held: refused or ran
    assert {rid for rid in want if rid.endswith("_grp")} <= refused    # the samples
    for rid in set(want) - refused:
        assert str(log.finished[rid]).lower() == "stop" and len(log.outputs[rid]) == want[rid]
    assert refused, "nothing was held when the fault came"
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1
    # the engine goes on: every new arrival is refused at once, without the core
    more = load(eng, 6, first=100)
    assert len(s.kvadmit.pending_refusals) == 6 and not s.requests
    eng.step()
    assert all(refused_closed(log, rid) for rid in more)
    assert not s.has_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1
