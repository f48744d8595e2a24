"""The stepped-engine contract (kvadmit.simulate.stepped.SteppedEngine) without vLLM:
the native engine implements it, the one-engine driver (`replay`) gives what `run`
gives, and the fleet drives its instances through the contract and nothing else
(an engine that exposes only the contract's calls gives the very same fleet run).
vLLM's engine on the same contract: tests/simulate/test_vllm_engine.py."""
import inspect

import pytest

from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, native_engine
from kvadmit.simulate.fleet import FleetSetup, run_fleet
from kvadmit.simulate.metrics import Slo
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.stepped import SteppedEngine, first_arrival, replay
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import synthetic

STEP = StepTimeModel(0.01, 1e-5, 1e-8)
SHAPE = EngineShape(num_blocks=72, block_size=16, max_model_len=1024, max_num_seqs=32,
                    max_num_batched_tokens=512)
CONTRACT = ("clock", "start", "add_requests", "advance", "drain", "take_rejections",
            "signals", "results", "totals")


class OnlyTheContract:
    """A stepped engine that is the contract and nothing more: every call goes to a
    native engine, and every call is logged (a driver that used anything else would
    fail with AttributeError)."""
    __slots__ = ("_e", "calls")

    def __init__(self, engine):
        self._e, self.calls = engine, []

    @property
    def clock(self):
        return self._e.clock

    def _call(self, name, *args, **kw):
        self.calls.append(name)
        return getattr(self._e, name)(*args, **kw)

    def start(self, t0):
        return self._call("start", t0)

    def add_requests(self, *args, **kw):
        return self._call("add_requests", *args, **kw)

    def advance(self, until):
        return self._call("advance", until)

    def drain(self):
        return self._call("drain")

    def take_rejections(self):
        return self._call("take_rejections")

    def signals(self):
        return self._call("signals")

    def results(self):
        return self._call("results")

    def totals(self):
        return self._call("totals")


def workload(n=160, seed=3):
    return synthetic(n, rate=12.0, seed=seed, prompt_mean=200, output_mean=60,
                     max_tokens_cap=256, max_model_len=1024)


def test_the_contract_is_what_both_engines_offer():
    e = NativeEngine(AdmissionConfig(), 16, 16, 256, 8, 256, step_a=0.01)
    assert isinstance(e, SteppedEngine) and isinstance(OnlyTheContract(e), SteppedEngine)
    members = {name for name, _ in inspect.getmembers(SteppedEngine) if not name.startswith("_")}
    assert members == set(CONTRACT)
    from kvadmit.simulate import vllm_engine    # imports without vLLM: it is built lazily
    for name in CONTRACT:
        assert hasattr(vllm_engine.VllmEngine, name), name


def test_the_one_engine_driver_gives_what_run_gives():
    w = workload()
    cfg = AdmissionConfig(max_queued_requests=6)
    ref = native_engine(w, cfg, SHAPE, STEP)
    e = native_engine(w, cfg, SHAPE, STEP)
    for eng in (ref, e):
        eng.add_requests(w.requests())
    ref.run()
    replay(e, first_arrival(w.arrival_s))
    assert e.results() == ref.results()
    assert e.totals() == ref.totals()
    assert e.take_rejections() == ref.take_rejections()
    assert e.core.stats() == ref.core.stats()
    assert ref.totals()["rejected"] > 0               # the refusals were compared


def test_first_arrival_is_the_first_open_loop_one():
    assert first_arrival([3.0, 1.0, 2.0], [-1, 0, -1]) == 2.0
    with pytest.raises(ValueError, match="no request has a fixed arrival time"):
        first_arrival([1.0], [0])


@pytest.mark.parametrize("router", ["round-robin", "headroom"])
def test_the_fleet_drives_its_engines_through_the_contract_only(router):
    w = workload(seed=5)
    setup = FleetSetup(tuple(parse_policy(p) for p in ("auto", "vllm-default", "peak")), router,
                       scrape_interval_s=0.2)
    base, slo = AdmissionConfig(), Slo(2.0, 0.1)
    wrapped = []

    def make_engine(policy, shape):
        wrapped.append(OnlyTheContract(native_engine(w, policy.config(base), shape, STEP)))
        return wrapped[-1]

    ref = run_fleet(w, setup, SHAPE, STEP, base, slo)
    got = run_fleet(w, setup, SHAPE, STEP, base, slo, make_engine=make_engine)
    assert got.per_request == ref.per_request
    assert got.totals == ref.totals and got.counts == ref.counts
    assert got.placed == ref.placed and got.attempts == ref.attempts
    assert got.instances == ref.instances
    for eng in wrapped:
        assert eng.calls[0] == "start" and "drain" in eng.calls
        assert {"advance", "add_requests", "signals", "take_rejections"} <= set(eng.calls)
