"""`kvadmit bench serve`'s recompute figures: the counting schedulers (exact, on vLLM's
real scheduler in-process), the derivation from a server's counters, the summary and
the table. The run on `vllm serve` is tests/vllm/test_bench_serve.py's sweep."""
import random
from types import SimpleNamespace

import pytest

from kvadmit.bench.serve import configs, points, recompute, report
from kvadmit.vllm.inprocess import InProcessEngine
from kvadmit.vllm.plugin import _names_kvadmit


def test_recounted_counts_positions_below_the_frontier_once():
    reqs = {"a": SimpleNamespace(num_computed_tokens=64),
            "b": SimpleNamespace(num_computed_tokens=40)}
    frontier = {"a": 100, "b": 30, "gone": 50}
    # a: 0-64 again (all below 100); b: 20-40, of which 20-30 again; gone: dropped
    assert recompute.recounted(frontier, {"a": 64, "b": 20}, reqs) == 64 + 10
    assert frontier == {"a": 100}
    reqs["a"].num_computed_tokens = 128          # 64-128: 64-100 again, then past it
    assert recompute.recounted(frontier, {"a": 64}, reqs) == 36 and frontier == {}
    assert recompute.recounted({"a": 100}, {}, reqs) == 0      # not scheduled this step


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("cls, kvadmit", [(recompute.VllmScheduler, None),
                                          (recompute.KvadmitScheduler, {"policy": "overcommit"})])
def test_the_counting_schedulers_count_exactly_what_is_scheduled_again(
        model_dir, cls, kvadmit, async_scheduling):
    """An overloaded pool on vLLM's real scheduler: every request's prompt once and all
    but its last output token, and the rest of what was scheduled is exactly what the
    scheduler counted as recomputed (and added to its Prometheus counter)."""
    from prometheus_client import REGISTRY
    eng = InProcessEngine(model_dir, scheduler_cls=cls, num_blocks=24, max_model_len=512,
                          async_scheduling=async_scheduling,
                          additional_config={"kvadmit": kvadmit} if kvadmit else None)
    counter0 = REGISTRY.get_sample_value(f"{recompute.METRIC}_total") or 0.0
    rng = random.Random(0)
    needed = 0
    for _ in range(48):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(16, 128))]
        max_tokens = rng.randint(16, 200)
        eng.add(prompt, max_tokens)
        needed += len(prompt) + max_tokens - 1
    log = eng.run()
    s = eng.scheduler
    assert _names_kvadmit(type(s)) == (kvadmit is not None)    # vLLM's own stays vLLM's
    assert log.preemptions > 10 and s.recomputed > 0
    assert s.recomputed == log.scheduled_tokens - needed
    assert REGISTRY.get_sample_value(f"{recompute.METRIC}_total") - counter0 == s.recomputed
    assert s.bench_frontier == {}


def test_the_bench_runs_each_config_with_its_scheduler_counting():
    for text, want in [("vllm-default", "kvadmit.bench.serve.recompute.VllmScheduler"),
                       ("vllm-queued=7", "kvadmit.bench.serve.recompute.VllmScheduler"),
                       ("kvadmit-default", "kvadmit.bench.serve.recompute.KvadmitScheduler"),
                       ("kvadmit-delay=1", "kvadmit.bench.serve.recompute.KvadmitScheduler")]:
        c = configs.parse_config(text, 1, 1.0)
        ours = configs.counting(c)
        assert (ours.label, ours.doc, ours.kind) == (c.label, c.doc, c.kind)
        i = c.flags.index("--scheduler-cls") + 1
        assert ours.flags == (*c.flags[:i], want, *c.flags[i + 1:])
        # kvadmit's checks and API-server middleware follow the scheduler's owner
        assert _names_kvadmit(want) == (c.kind == "kvadmit")


# A real `vllm serve` (vllm-default, tests/vllm/test_bench_serve.py's sweep, 49 blocks):
# its counters before and after the point at twice the capacity, which preempted once.
BEFORE = {"vllm:prompt_tokens_total": 4098.0, "vllm:prompt_tokens_cached_total": 0.0,
          "vllm:num_preemptions_total": 0.0, "kvadmit_bench_recomputed_tokens_total": 0.0}
AFTER = {"vllm:prompt_tokens_total": 6147.0, "vllm:prompt_tokens_cached_total": 0.0,
         "vllm:num_preemptions_total": 1.0, "kvadmit_bench_recomputed_tokens_total": 511.0}


def test_recompute_counts_from_a_servers_counters():
    """fresh = prompt - cached (vLLM's, once per request: 2049, the tokens sent),
    recomputed = the bench's counter, share = recomputed / (fresh + recomputed)."""
    assert points.recompute_counts(BEFORE, AFTER) == {
        "prefill_tokens": 2049 + 511, "recomputed_tokens": 511,
        "recompute_share": 511 / 2560}
    assert points.recompute_counts(AFTER, AFTER) == {
        "prefill_tokens": 0, "recomputed_tokens": 0, "recompute_share": None}
    cached = dict(AFTER, **{"vllm:prompt_tokens_cached_total": 1000.0})
    assert points.recompute_counts(BEFORE, cached)["prefill_tokens"] == 1049 + 511
    plain = {k: v for k, v in AFTER.items() if not k.startswith("kvadmit_bench")}
    assert points.recompute_counts(BEFORE, plain) == {
        "prefill_tokens": None, "recomputed_tokens": None, "recompute_share": None}


def test_the_summary_and_the_table_carry_the_median_share(capsys):
    def row(config, share, recomputed, preemptions):
        return dict(config=config, load=2.0, rate_rps=5.0, goodput=1.0, ttft_p50_ms=1.0,
                    ttft_p99_ms=2.0, tpot_p50_ms=1.0, tpot_p99_ms=2.0, output_tok_per_s=10.0,
                    preemptions=preemptions, failed=0, recomputed_tokens=recomputed,
                    recompute_share=share, refused_by_reason={}, failed_by_status={})
    rows = [row("vllm-default", 0.1, 100, 1), row("vllm-default", 0.3, 400, 3),
            row("vllm-default", 0.2, 250, 2), row("old", None, None, 0)]
    by = {s["config"]: s for s in report.summarize(rows)}
    s = by["vllm-default"]
    assert (s["recompute_share"], s["recompute_share_min"], s["recompute_share_max"]) == \
        (0.2, 0.1, 0.3)
    assert s["recomputed_tokens"] == 250
    assert "recompute_share" not in by["old"]
    assert report.goal_figures(list(by.values()))["recompute_share"] == {
        "old": {"2": None}, "vllm-default": {"2": 0.2}}
    report.print_table(list(by.values()), "t", ["vllm-default", "old"])
    lines = capsys.readouterr().out.splitlines()
    assert "recompute %" in lines[2]
    assert "20.0 10.0-30.0" in lines[3] and lines[3].startswith("vllm-default")
    assert lines[4].startswith("old") and " - " in lines[4]
