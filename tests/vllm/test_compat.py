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


def test_a_moved_module_fails_naming_it():
    with pytest.raises(compat.VllmCompatError, match=r"vllm.v1.core.sched.gone.Scheduler \("):
        compat.import_names(("vllm.v1.core.sched.gone:Scheduler",))


def test_an_untested_version_with_every_symbol_warns(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        build(model_dir)
    assert "kvadmit is tested on vLLM 0.32.x, 0.33.x; found 0.34.0" in caplog.text
