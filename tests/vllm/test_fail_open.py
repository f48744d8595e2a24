"""When kvadmit itself fails inside vLLM's engine, it fails open: logged once, counted,
every request it held handed to vLLM's own scheduling, nothing refused from then on,
the engine goes on (docs/vllm.md, "When kvadmit itself fails"). A fault is injected
here, in the test, at a chosen point of kvadmit's code, on vLLM's real scheduler
in-process under load: every request then finishes with its whole output and every
KV block comes back."""
import logging

import pytest
from helpers import fail_on_call

from kvadmit.vllm.admission import VllmAdmission
from kvadmit.vllm.inprocess import InProcessEngine
from kvadmit.vllm.scheduler import GatedWaitingQueue, Scheduler


def load(eng, n=24):
    """n requests on a pool too small for all: kvadmit holds and pauses some."""
    ids = []
    for i in range(n):
        ids.append(eng.add([3 + i % 50] * (20 + 7 * i % 90), 64, output_tokens=8 + (5 * i) % 50))
    return ids


@pytest.mark.parametrize("where, n, async_scheduling", [
    ("before_step", 6, False), ("choose", 9, False), ("arrive", 5, False), ("leave", 3, False),
    ("choose", 9, True)],
    ids=["before-a-step", "inside-vllms-step", "on-arrival", "as-one-leaves", "async-inside"])
def test_a_fault_fails_open_and_nothing_is_lost(model_dir, monkeypatch, caplog, where, n,
                                                async_scheduling):
    calls = fail_on_call(monkeypatch, VllmAdmission, where, n)
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                          max_num_seqs=16, async_scheduling=async_scheduling,
                          additional_config={"kvadmit": {}})
    s = eng.scheduler
    with caplog.at_level(logging.ERROR, logger="kvadmit.vllm"):
        ids = load(eng)
        log = eng.run(max_steps=5000)
    assert len(calls) >= n, "the fault point was never reached"
    assert s.kvadmit.failed and s.kvadmit.internal_errors == 1
    assert sum("failing open" in r.getMessage() for r in caplog.records) == 1
    assert not isinstance(s.waiting, GatedWaitingQueue)       # vLLM's own queue now
    # every request finished on its own, with its whole output; none refused
    assert set(log.finished) == set(ids)
    assert all(reason == "stop" for reason in map(str.lower, log.finished.values())), log.finished
    assert not [r for r in log.stop_reasons.values() if str(r).startswith("kvadmit:")]
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1
    # and the engine serves on: vLLM's rule, kvadmit out of the way
    more = load(eng, 6)
    log = eng.run(max_steps=5000)
    assert set(more) <= set(log.finished)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 24 - 1
