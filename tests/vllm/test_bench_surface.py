"""The vLLM surface of `kvadmit bench vllm` (what bench/gpu_preemption.sh runs on a GPU)
on the installed vLLM. vLLM 0.33 has only a CUDA wheel, so no model runs here on 0.33
(CI runs this file on 0.32, 0.33 and 0.34); what would break a first GPU run is checked
without one: the engine arguments the bench gives vLLM's `LLM` build a config, and the
bench's scheduler classes (its burst hold and token count over vLLM's and kvadmit's
schedulers, sync and async as on a GPU) run vLLM's real scheduler in-process."""
import pytest

from kvadmit.bench import vllm as bench
from kvadmit.simulate.steptime import CPU_TINY
from kvadmit.vllm.inprocess import InProcessEngine


class _Built(Exception):
    """Raised by the stand-in for vLLM's LLM once the bench has named its arguments."""


def bench_llm_kwargs(monkeypatch, model_dir, kvadmit) -> dict:
    """The keyword arguments `bench.run_one` gives vLLM's LLM (nothing runs)."""
    import vllm
    seen = {}

    def llm(**kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr(vllm, "LLM", llm)
    with pytest.raises(_Built):
        bench.run_one("x", model_dir, [bench.BenchRequest(tuple([5] * 20), 8, 4)],
                      bench.BenchEngine(num_blocks=24, max_model_len=512), kvadmit, True)
    return seen


@pytest.mark.parametrize("kvadmit", [None, {"policy": "adaptive"}], ids=["vllm", "kvadmit"])
def test_the_benchs_engine_arguments_build_a_config(monkeypatch, model_dir, kvadmit):
    from vllm.engine.arg_utils import EngineArgs
    kwargs = bench_llm_kwargs(monkeypatch, model_dir, kvadmit)
    config = EngineArgs(**kwargs).create_engine_config()
    assert config.scheduler_config.scheduler_cls == "kvadmit.bench.vllm.CountingScheduler"
    assert config.cache_config.num_gpu_blocks_override == 24
    assert (config.additional_config or {}).get("kvadmit") == kvadmit


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kvadmit", [None, {"policy": "adaptive"}], ids=["vllm", "kvadmit"])
def test_the_benchs_schedulers_hold_the_burst_and_count(monkeypatch, tmp_path, model_dir,
                                                        kvadmit, async_scheduling):
    """Nothing is scheduled until the whole workload has arrived; then every request
    finishes and the scheduled tokens are counted in the file the bench reads."""
    counts = tmp_path / "counts"
    monkeypatch.setenv(bench.COUNTS_ENV, str(counts))
    monkeypatch.setenv(bench.EXPECT_ENV, "3")
    eng = InProcessEngine(model_dir, scheduler_cls=bench.CountingScheduler, num_blocks=24,
                          max_model_len=512, async_scheduling=async_scheduling,
                          additional_config={"kvadmit": kvadmit} if kvadmit is not None else None)
    flavour = {(False, False): bench.CountingVllmScheduler,
               (False, True): bench.CountingVllmAsyncScheduler,
               (True, False): bench.CountingKvadmitScheduler,
               (True, True): bench.CountingKvadmitAsyncScheduler}
    assert type(eng.scheduler) is flavour[kvadmit is not None, async_scheduling]
    ids = [eng.add([5 + i] * 40, 6) for i in range(2)]
    assert eng.step().total_num_scheduled_tokens == 0          # held: 2 of 3 arrived
    ids.append(eng.add([9] * 40, 6))
    # The modelled time: every step with tokens, priced by the CPU fit on its tokens and
    # its context (each scheduled request's computed tokens after schedule()).
    modelled = 0.0
    while len(eng.log.finished) < len(ids):
        out = eng.step()
        if out.total_num_scheduled_tokens:
            modelled += CPU_TINY.step_s(out.total_num_scheduled_tokens, sum(eng.last_computed.values()))
    log = eng.log
    assert all(len(log.outputs[r]) == 6 for r in ids)
    tokens, _, modelled_s = counts.read_text().split()
    assert int(tokens) == log.scheduled_tokens
    assert float(modelled_s) == pytest.approx(modelled, rel=1e-12)
