"""The noisy neighbour (issue 22): a batch flow offers 10x its fair share of the KV
pool while an interactive flow runs at its usual rate. Does the interactive flow keep
its goodput, and does the batch flow still fill the pool?

On the native engine (the simulator's compiled engine, kvadmit's core inside), one
pool, one step-time model, the same requests in every run:

- interactive: Poisson arrivals for `--seconds`, prompts mean 600, outputs mean 150
  (lognormal), SLO TTFT `--ttft` s and TPOT `--tpot` s, at `--interactive-load` x the
  engine's capacity for such requests;
- batch: Poisson arrivals over the same seconds, prompts mean 3000, outputs mean 500,
  at 10 x its share: `--batch-offer` (10) x its share of the engine's capacity for
  such requests (two flows of weight 1: half the pool each; `--weights` sets them).

Runs: the interactive requests alone, the batch requests alone, and both together
under (a) FCFS, no flows (kvadmit's default `{}`); (b) vLLM-style priority, the
interactive ones priority 0 and batch 1 with queue_order priority, under vLLM's own
rule (overcommit, LIFO victim, displacing as kvadmit's adapter does under
`--scheduling-policy priority`; with --model-dir, on vLLM's FCFS scheduler with
queue_order priority), under SGLang's rule
(the predict policy, its retraction order; the simulator has no model of SGLang's
preemption threshold) and under kvadmit's default policy; (c) flows: interactive flow 1, batch flow 2, both priority 0,
weight 1 (the default), under kvadmit's default policy, with head_of_line strict,
and under vLLM's rule. The interactive
flow's goodput (share of its requests served within both targets) is compared with
alone, the pool's utilisation while both offer load (mean used blocks / pool over the
arrival window, from the engine's timeline) with batch alone.

    python bench/noisy_neighbour.py
    python bench/noisy_neighbour.py --seeds 0 1 2 3 4 5 --interactive-load 0.5 --weights 1 3
    python bench/noisy_neighbour.py --max-model-len 4096 --model-dir DIR --out noisy_neighbour_vllm

The second runs vLLM 0.32's own V1 scheduler in-process instead (fake model outputs on
the same virtual step clock; DIR: the tiny test model, `kvadmit.vllm.tiny_model`),
for the runs it can: alone, FCFS, vLLM's rule with priority (kvadmit's adapter on
vLLM's FCFS scheduler, queue_order priority), flows.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys

from _common import mean_rows, print_table, save

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, native_engine
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.record import Totals
from kvadmit.simulate.run import capacity_rps
from kvadmit.simulate.steptime import get_preset
from kvadmit.simulate.workload import Workload, _arrivals, _lognormal_int

CHAT, BATCH = 1, 2      # flow ids (the config's keys "1", "2": digits are that integer)
VLLM_RUNS = ("interactive alone (kvadmit default)", "batch alone (kvadmit default)",
             "FCFS, no flows (kvadmit default {})",
             "vLLM priority (overcommit, LIFO, queue_order priority)",
             "flows, weight 1:1 (kvadmit default + flows)",
             "flows, weight 1:1, under vLLM's rule (overcommit, LIFO)")


def requests(name: str, n: int, rate: float, seed: int, prompt_mean: float, output_mean: float,
             max_model_len: int, cap: int = 2048) -> Workload:
    rng = random.Random(seed)
    arr = _arrivals(rng, n, rate, 1.0)
    prompt, out, mx = [], [], []
    for _ in range(n):
        p = _lognormal_int(rng, prompt_mean, 0.8, 1, max_model_len - 1)
        c = max(1, min(cap, max_model_len - p))
        prompt.append(p)
        out.append(_lognormal_int(rng, output_mean, 0.9, 1, c))
        mx.append(c)
    return Workload(name=name, arrival_s=arr, prompt_tokens=prompt, output_tokens=out,
                    max_tokens=mx)


def merge(a: Workload, b: Workload, **cols) -> tuple[Workload, list[int]]:
    """a and b in one arrival order, and each merged row's source (0: a, 1: b); `cols`
    maps a column name to its (a value, b value)."""
    rows = sorted([(t, 0, i) for i, t in enumerate(a.arrival_s)] +
                  [(t, 1, i) for i, t in enumerate(b.arrival_s)])
    src = [w for _, w, _ in rows]
    pick = [(a, b)[w] for w in src]
    idx = [i for _, _, i in rows]
    w = Workload(name=f"{a.name}+{b.name}", arrival_s=[t for t, _, _ in rows],
                 prompt_tokens=[p.prompt_tokens[i] for p, i in zip(pick, idx)],
                 output_tokens=[p.output_tokens[i] for p, i in zip(pick, idx)],
                 max_tokens=[p.max_tokens[i] for p, i in zip(pick, idx)],
                 **{k: [v[s] for s in src] for k, v in cols.items()})
    return w, src


def run(w: Workload, config: AdmissionConfig, shape: EngineShape, step, window_s: float,
        model_dir: str | None = None):
    if model_dir is not None:      # vLLM's own scheduler in-process (kvadmit.simulate.vllm_engine)
        from kvadmit.simulate.vllm_engine import run_vllm
        raw = run_vllm(w, config, shape, step, model_dir, sample_interval_s=0.05)
        tl = raw.timeline
        used = [u for t, u in zip(tl["t"], tl["used_blocks"]) if t <= window_s]
        assert raw.totals.finished + raw.totals.rejected == len(w), "a request was lost"
        return raw.per_request, raw.totals, sum(used) / len(used) / shape.num_blocks, \
            raw.extra.get("flows", {})
    eng = native_engine(w, config, shape, step, sample_interval_s=0.05)
    eng.add_requests(w.requests(hash_ids=False))
    eng.run()
    tl = eng.timeline()
    used = [u for t, u in zip(tl["t"], tl["used_blocks"]) if t <= window_s]
    totals = eng.totals()
    assert totals["free_blocks_at_end"] == shape.num_blocks, "a KV block did not come back"
    assert totals["finished"] + totals["rejected"] == len(w), "a request was lost"
    return eng.results(), Totals.from_engine(totals), sum(used) / len(used) / shape.num_blocks, \
        eng.core.flow_stats()


def subset(per_request: dict, keep: list[bool]) -> dict:
    return {k: [x for x, k2 in zip(v, keep) if k2] for k, v in per_request.items()}


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    path = save(args.out, measure(args))
    print(f"saved {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="arrival window")
    ap.add_argument("--interactive-load", type=float, default=0.3)
    ap.add_argument("--batch-offer", type=float, default=10.0, help="x the batch flow's share")
    ap.add_argument("--interactive-lengths", type=float, nargs=2, default=[600, 150],
                    metavar=("PROMPT", "OUTPUT"), help="interactive prompt and output means")
    ap.add_argument("--batch-lengths", type=float, nargs=2, default=[3000, 500],
                    metavar=("PROMPT", "OUTPUT"), help="batch prompt and output means")
    ap.add_argument("--weights", type=float, nargs=2, default=[1.0, 1.0],
                    metavar=("INTERACTIVE", "BATCH"),
                    help="the flows' weights (the batch flow's share: its weight over both)")
    ap.add_argument("--ttft", type=float, default=1.0)
    ap.add_argument("--tpot", type=float, default=0.1)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--preset", default="h100-8b")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="the context (vLLM's tiny test model: at most 4096)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                    help="one run of every configuration per seed (its own requests)")
    ap.add_argument("--out", default="noisy_neighbour", help="bench/results/<out>.json")
    ap.add_argument("--model-dir", default=None,
                    help="run on vLLM's own scheduler in-process (kvadmit.simulate.vllm_engine, "
                         "fake model outputs) with this model directory, instead of the native "
                         "engine: the runs of VLLM_RUNS only")
    return ap


def measure(args) -> dict:
    """Every run of every seed, and their mean (what main saves)."""
    step = get_preset(args.preset)
    shape = EngineShape(num_blocks=args.num_blocks, block_size=16, max_model_len=args.max_model_len,
                        max_num_seqs=256, max_num_batched_tokens=8192)
    per_seed = [one_seed(args, shape, step, seed) for seed in args.seeds]
    mean = mean_rows([p["rows"] for p in per_seed], [k for _, k, _ in COLUMNS])
    print(f"\nmean over seeds {args.seeds}:")
    table(mean)
    return {"args": vars(args), "shape": dataclasses.asdict(shape), "step_time": step.name,
            "mean": mean, "seeds": per_seed}


COLUMNS = (("interactive goodput", "interactive_goodput", ".3f"),
           ("vs alone", "goodput_vs_alone", ".1%"),
           ("interactive TTFT p99 (s)", "interactive_ttft_p99_s", ".2f"),
           ("pool utilisation", "util", ".3f"), ("vs batch only", "util_vs_batch_only", ".1%"),
           ("batch finished", "batch_finished", ".0f"), ("preemptions", "preemptions", ".0f"))


def table(rows) -> None:
    print_table(rows, COLUMNS)


def one_seed(args, shape, step, seed: int) -> dict:
    (pi, oi), (pb, ob) = args.interactive_lengths, args.batch_lengths
    probe_i = requests("interactive", 2000, 1.0, seed + 100, pi, oi, shape.max_model_len)
    probe_b = requests("batch", 2000, 1.0, seed + 200, pb, ob, shape.max_model_len)
    cap_i = capacity_rps(probe_i, shape, step)
    cap_b = capacity_rps(probe_b, shape, step)
    rate_i = args.interactive_load * cap_i
    wi, wb = getattr(args, "weights", (1.0, 1.0))
    rate_b = args.batch_offer * wb / (wi + wb) * cap_b
    inter = requests("interactive", max(2, round(rate_i * args.seconds)), rate_i, seed + 1,
                     pi, oi, shape.max_model_len)
    batch = requests("batch", max(2, round(rate_b * args.seconds)), rate_b, seed + 2,
                     pb, ob, shape.max_model_len)
    slo = Slo(args.ttft, args.tpot)
    print(f"capacity: interactive {cap_i:.2f} req/s, batch {cap_b:.2f} req/s; offered: "
          f"interactive {rate_i:.2f} req/s ({len(inter)}), batch {rate_b:.2f} req/s "
          f"({len(batch)}) over {args.seconds:g} s; pool {shape.num_blocks} x 16 tokens, "
          f"{step.name}")

    base = AdmissionConfig()
    vllm_rule = {"policy": "overcommit", "victim": "lifo"}
    flows_cfg = {"flows": {str(CHAT): {"weight": wi}, str(BATCH): {"weight": wb}}}
    ratio = f"{wi:g}:{wb:g}"
    both_plain, src = merge(inter, batch)
    both_prio, _ = merge(inter, batch, priority=(0, 1))
    both_flows, _ = merge(inter, batch, flow=(CHAT, BATCH))
    is_inter = [s == 0 for s in src]
    runs = [
        ("interactive alone (kvadmit default)", inter, base, None),
        ("batch alone (kvadmit default)", batch, base, None),
        ("FCFS, no flows (kvadmit default {})", both_plain, base, is_inter),
        ("vLLM priority (overcommit, LIFO, queue_order priority)", both_prio,
         AdmissionConfig.from_dict({**vllm_rule, "queue_order": "priority"}), is_inter),
        ("SGLang-style priority (predict, length victim, queue_order priority)", both_prio,
         AdmissionConfig.from_dict({"policy": "predict", "victim": "length",
                                    "queue_order": "priority"}), is_inter),
        ("priority (kvadmit default + queue_order priority)", both_prio,
         AdmissionConfig.from_dict({"queue_order": "priority"}), is_inter),
        (f"flows, weight {ratio} (kvadmit default + flows)", both_flows,
         AdmissionConfig.from_dict(flows_cfg), is_inter),
        (f"flows, weight {ratio}, head_of_line strict", both_flows,
         AdmissionConfig.from_dict({**flows_cfg, "head_of_line": "strict"}), is_inter),
        (f"flows, weight {ratio}, under vLLM's rule (overcommit, LIFO)", both_flows,
         AdmissionConfig.from_dict({**flows_cfg, **vllm_rule}), is_inter),
    ]
    rows = []
    alone_goodput = batch_util = None
    for label, w, config, keep in runs:
        if args.model_dir is not None and label.replace(ratio, "1:1") not in VLLM_RUNS:
            continue
        per, totals, util, fstats = run(w, config, shape, step, args.seconds, args.model_dir)
        if keep is None:
            s_i = summarize(per, totals, slo)
            row = {"run": label, "util": util, "preemptions": totals.preemptions,
                   "steps": totals.steps}
            if w is inter:
                alone_goodput = s_i["goodput"]
                row.update(interactive_goodput=s_i["goodput"],
                           interactive_ttft_p99_s=s_i["ttft_p99_s"])
            else:
                batch_util = util
                row.update(batch_finished=s_i["finished"])
        else:
            s_i = summarize(subset(per, keep), totals, slo)
            s_b = summarize(subset(per, [not k for k in keep]), totals, slo)
            row = {"run": label, "util": util, "preemptions": totals.preemptions,
                   "steps": totals.steps, "interactive_goodput": s_i["goodput"],
                   "interactive_ttft_p99_s": s_i["ttft_p99_s"],
                   "interactive_tpot_p99_s": s_i["tpot_p99_s"],
                   "batch_finished": s_b["finished"]}
            if fstats:
                row["kv_share"] = {str(k): round(v["kv_share"], 4) for k, v in fstats.items()}
                row["flow_stats"] = {str(k): v for k, v in fstats.items()}
        rows.append(row)
    for row in rows:
        if "interactive_goodput" in row and alone_goodput:
            row["goodput_vs_alone"] = row["interactive_goodput"] / alone_goodput
        row["util_vs_batch_only"] = row["util"] / batch_util if batch_util else None
    print(f"seed {seed}:")
    table(rows)
    return {"seed": seed, "capacity_rps": {"interactive": cap_i, "batch": cap_b},
            "offered_rps": {"interactive": rate_i, "batch": rate_b},
            "requests": {"interactive": len(inter), "batch": len(batch)}, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
