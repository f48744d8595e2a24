"""The noisy neighbour (issue 22) on `vllm serve`: a batch flow offering about 10x its
share of the server beside an interactive flow at its usual rate, over HTTP.

A `vllm serve` of the tiny local model (`kvadmit.vllm.tiny_model`, its tokenizer,
a pool of `--num-blocks` blocks of 32 tokens) per config and phase, started with
kvadmit's launcher (`python -m kvadmit.vllm.serve`, which starts vLLM's CPU build),
one at a time. Three phases, `--seconds` of Poisson arrivals each, the same requests
in every config: the interactive requests alone, the batch requests alone, both
together. Each phase runs on a fresh server after the same warm-up, as separate runs
would (with `--shared-server`, one server runs the three in turn: kvadmit's length
quantile, raised by batch alone's preemptions, then carried into both). A request
stops at its real length (the bench's stop-at logits processor, `kvadmit_stop_at`
with `min_tokens` one less) under a slack `max_tokens` cap, as in `kvadmit bench
serve`. When a phase's arrival window ends,
the batch requests still in flight are cancelled (the client closes them: vLLM
aborts them); the interactive ones run to the end.

Measured per phase: the interactive flow's goodput (the share of its requests that
got a 200 and met both `--ttft` and `--tpot`, streamed: TTFT to the first token,
TPOT over the rest), its TTFT p50/p99, the batch requests finished inside the
window, and the pool utilisation: the mean of `vllm:kv_cache_usage_perc` sampled
every 0.5 s during the window. The interactive requests are streamed, the batch ones
not (their finish is all that is measured, and the API server has less to do). The goal's figures: the interactive goodput in
`both` over `interactive alone`, and the utilisation in `both` over `batch alone`,
each on the same server.

Configs:
  vllm-default      vLLM's own scheduler, FCFS
  vllm-priority     vLLM's own scheduler, --scheduling-policy priority; interactive
                    requests priority 0, batch 1 (vLLM: lower value first)
  kvadmit-default   kvadmit's empty config {}, no flows (FCFS)
  kvadmit-flows     kvadmit's default plus flows "1" and "2", weight 1 each; each
                    request names its flow in GIE's x-gateway-inference-fairness-id
  kvadmit-priority  kvadmit's default under --scheduling-policy priority (priorities
                    as for vllm-priority)

Run each config on its own, through the engine lock, then print the table:

    flock /tmp/kvadmit-engine.lock python bench/noisy_neighbour_serve.py --configs vllm-default
    ...
    python bench/noisy_neighbour_serve.py --report

(On a machine of 2 to 4 cores add `--engine-cpus 0`: below.)

Results: bench/results/noisy_neighbour_serve/<config>.json, the table in
bench/results/noisy_neighbour_serve.json.

The interactive requests are sent from the bench's process, the batch ones from a
process of their own (two tenants' clients). `--engine-cpus 0` binds the server's
engine core and worker to CPU 0 and leaves the other CPUs to the API server and the
clients: on a 2-core machine vLLM's CPU build binds its worker to one core and its
engine core, which spins (sched_yield) while it waits for the worker, shares the
other with the API server and the clients; there the clients' event loops stalled
for up to 7 s at a time and the interactive requests reached the API server seconds
late (measured with `--split-ttft`'s api part), which the goal's figure then
charged to the scheduler. On a GPU host the engine's busy loop has a core of its own.

`--split-ttft` also times each interactive request inside the server (a hook,
bench/ttft_split/sitecustomize.py, on the server's PYTHONPATH, on vLLM's own Scheduler
methods, which kvadmit's calls): each phase then has `ttft_split`, its TTFT in four
parts (front_in: client to the engine core's add_request; queue: to the step that
starts it; engine: to the step that emits its first token; front_out: to the client),
p50 / p90 / max; front_in is itself split in two, api (the client's send to the API
server's arrival time of the request) and engine_in (from there to add_request).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import sys
import tempfile
import time

from kvadmit.simulate.metrics import percentile
from kvadmit.simulate.workload import _lognormal_int
from kvadmit.bench.serve.configs import KVADMIT_SCHEDULER, VLLM_SCHEDULER, ServeConfig
from kvadmit.bench.serve.points import wait_idle
from kvadmit.bench.serve.server import Engine, Server, scrape_metrics

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
OUT_DIR = RESULTS / "noisy_neighbour_serve"
FLOW_HEADER = "x-gateway-inference-fairness-id"
CHAT, BATCH = 1, 2
FLOWS = {"flows": {str(CHAT): {"weight": 1}, str(BATCH): {"weight": 1}}}
PHASES = ("interactive alone", "batch alone", "both")


def configs() -> dict[str, tuple[ServeConfig, bool, bool]]:
    """name -> (server config, requests carry a priority, requests carry a flow)."""
    vllm = ("--scheduler-cls", VLLM_SCHEDULER)
    prio = ("--scheduling-policy", "priority")

    def kv(settings):
        return ("--scheduler-cls", KVADMIT_SCHEDULER, "--additional-config",
                json.dumps({"kvadmit": settings}))
    return {
        "vllm-default": (ServeConfig("vllm-default", vllm, "vLLM's own scheduler, FCFS", "vllm"),
                         False, False),
        "vllm-priority": (ServeConfig("vllm-priority", (*vllm, *prio),
                                      "vLLM's own scheduler, --scheduling-policy priority", "vllm"),
                          True, False),
        "kvadmit-default": (ServeConfig("kvadmit-default", kv({}), "kvadmit {} (FCFS, no flows)",
                                        "kvadmit"), False, False),
        "kvadmit-flows": (ServeConfig("kvadmit-flows", kv(FLOWS),
                                      "kvadmit default + flows 1:1 (GIE fairness header)",
                                      "kvadmit"), False, True),
        "kvadmit-priority": (ServeConfig("kvadmit-priority", (*kv({}), *prio),
                                         "kvadmit default, --scheduling-policy priority", "kvadmit"),
                             True, False),
    }


def make_requests(kind: str, rate: float, seconds: float, seed: int, prompt_mean: float,
                  output_mean: float, cap: int, max_model_len: int) -> list[dict]:
    """Poisson arrivals over `seconds`; lognormal prompt and output lengths; each with
    the slack cap `cap` as max_tokens (the prompt clipped so that it fits)."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        p = _lognormal_int(rng, prompt_mean, 0.8, 4, max_model_len - cap)
        n = _lognormal_int(rng, output_mean, 0.9, 2, cap)
        out.append({"kind": kind, "arrival_s": t, "prompt": [rng.randrange(3, 990) for _ in range(p)],
                    "output_tokens": n, "max_tokens": cap})
        t += rng.expovariate(rate)
    return out


import httpx  # noqa: E402


async def send(client, base: str, model: str, req: dict, t0: float, priority: bool, flow: bool,
               ttft_samples: list, rec: dict) -> None:
    """One streamed completion at its arrival time; fills `rec`."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + req["arrival_s"] - loop.time()))
    n = req["output_tokens"]
    is_chat = req["kind"] == "interactive"
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "min_tokens": n - 1, "temperature": 0, "vllm_xargs": {"kvadmit_stop_at": n}}
    if is_chat:        # streamed, for its TTFT; a batch request is not (less front-end work)
        body.update(stream=True, stream_options={"include_usage": True})
    if priority:
        body["priority"] = 0 if is_chat else 1
    headers = {FLOW_HEADER: str(CHAT if is_chat else BATCH)} if flow else {}
    start = loop.time()
    rec.update(kind=req["kind"], sent_s=start - t0, status=None, ttft_s=None, tpot_s=None,
               tokens=0, sent_wall=time.time(), key=req["prompt"][:8])
    first = last = None
    try:
        if not is_chat:
            r = await client.post(base + "/v1/completions", json=body, headers=headers)
            rec["status"] = r.status_code
            if r.status_code == 200:
                rec["tokens"] = r.json()["usage"]["completion_tokens"]
                rec["finish_s"] = loop.time() - t0
            else:
                rec["error"] = r.text[:300]
            return
        async with client.stream("POST", base + "/v1/completions", json=body,
                                 headers=headers) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["error"] = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data.strip() == "[DONE]":
                    break
                j = json.loads(data)
                if j.get("choices"):
                    now = loop.time()
                    if first is None:
                        first = now
                        rec["first_wall"] = time.time()
                    last = now
                if j.get("usage"):
                    rec["tokens"] = j["usage"]["completion_tokens"]
                if j.get("error"):
                    rec["error"] = str(j["error"])[:300]
        if first is not None:
            rec["ttft_s"] = first - start
            rec["tpot_s"] = (last - first) / (rec["tokens"] - 1) if rec["tokens"] > 1 else 0.0
            rec["finish_s"] = last - t0
    except asyncio.CancelledError:
        rec["cancelled"] = True
        raise
    except httpx.HTTPError as e:       # a connection the server dropped: counted, not fatal
        rec["status"] = "connection"
        rec["error"] = repr(e)[:300]


async def sample_usage(base: str, until: float, out: list) -> None:
    import httpx
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=10) as c:
        while loop.time() < until:
            try:
                text = (await c.get(base + "/metrics")).text
                v = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                     if ln.startswith("vllm:kv_cache_usage_perc")]
                if v:
                    out.append(sum(v))
            except Exception:      # a slow scrape under load: skip this sample
                pass
            await asyncio.sleep(0.5)


async def run_phase(base: str, model: str, reqs: list[dict], seconds: float, priority: bool,
                    flow: bool, progress, start_wall: float, sample: bool = True) -> dict:
    """Sends `reqs` at their arrival times from `start_wall` (wall clock) on, samples
    the pool's usage over the window (`sample`), then cancels the batch requests
    still in flight."""
    import httpx
    loop = asyncio.get_running_loop()
    # no keep-alive: a fresh connection per request (no race with the server closing
    # an idle one)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    recs = [dict() for _ in reqs]
    usage: list[float] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = loop.time() + max(0.0, start_wall - time.time())
        tasks = [asyncio.create_task(send(client, base, model, r, t0, priority, flow, [], rec))
                 for r, rec in zip(reqs, recs)]
        sampler = asyncio.create_task(sample_usage(base, t0 + seconds, usage)) if sample else None
        while loop.time() < t0 + seconds:
            await asyncio.sleep(min(5.0, max(0.0, t0 + seconds - loop.time())))
            done = sum(1 for t in tasks if t.done())
            progress(f"  t={loop.time() - t0:5.1f} s: {done}/{len(tasks)} requests done")
        if sampler is not None:
            await sampler
        cancelled = 0
        for t, r in zip(tasks, reqs):
            if r["kind"] == "batch" and not t.done():
                t.cancel()
                cancelled += 1
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for res in results:
            if isinstance(res, Exception) and not isinstance(res, asyncio.CancelledError):
                raise res
    return {"records": recs, "usage_samples": usage, "cancelled_batch": cancelled,
            "wall_s": loop.time() - t0}


def _batch_client(conn, base, model, reqs, seconds, priority, flow, start_wall) -> None:
    """The batch flow's client, in a process of its own (run_clients)."""
    def progress(msg):
        print(f"[batch client] {msg}", flush=True)
    conn.send(asyncio.run(run_phase(base, model, reqs, seconds, priority, flow, progress,
                                    start_wall, sample=False)))
    conn.close()


def run_clients(base: str, model: str, reqs: list[dict], seconds: float, priority: bool,
                flow: bool, progress) -> dict:
    """One phase: the interactive requests sent from this process (which also samples
    the pool), the batch ones from a process of their own, as two tenants' clients
    are: the batch flow's few hundred connections in flight are not handled on the
    interactive client's event loop."""
    import multiprocessing as mp

    chat = [r for r in reqs if r["kind"] != "batch"]
    batch = [r for r in reqs if r["kind"] == "batch"]
    start_wall = time.time() + (3.0 if batch else 0.5)   # the child's imports first
    child = None
    if batch:
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_batch_client, daemon=True, args=(
            child_end, base, model, batch, seconds, priority, flow, start_wall))
        child.start()
        child_end.close()
    res = asyncio.run(run_phase(base, model, chat, seconds, priority, flow,
                                progress, start_wall))
    if child is not None:
        other = parent_end.recv()
        child.join(60)
        res["records"] = res["records"] + other["records"]
        res["cancelled_batch"] = other["cancelled_batch"]
        res["wall_s"] = max(res["wall_s"], other["wall_s"])
    return res


def summarize(phase: dict, seconds: float, ttft: float, tpot: float) -> dict:
    recs = phase["records"]
    chat = [r for r in recs if r.get("kind") == "interactive"]
    batch = [r for r in recs if r.get("kind") == "batch"]
    good = [r for r in chat if r.get("status") == 200 and r.get("ttft_s") is not None
            and r["ttft_s"] <= ttft and r["tpot_s"] <= tpot]
    tt = sorted(r["ttft_s"] for r in chat if r.get("ttft_s") is not None)

    def pct(q):
        return tt[min(len(tt) - 1, int(q * len(tt)))] if tt else None
    failed = {}
    for r in recs:
        if r.get("status") not in (200, None):
            failed[str(r["status"])] = failed.get(str(r["status"]), 0) + 1
    u = phase["usage_samples"]
    done_batch = [r for r in batch if r.get("finish_s") is not None and r["finish_s"] <= seconds]
    return {
        "interactive_requests": len(chat), "interactive_good": len(good),
        "interactive_goodput": len(good) / len(chat) if chat else None,
        "interactive_ttft_p50_s": pct(0.5), "interactive_ttft_p99_s": pct(0.99),
        "interactive_unserved": sum(1 for r in chat if r.get("ttft_s") is None),
        "batch_requests": len(batch), "batch_finished_in_window": len(done_batch),
        "batch_tokens_in_window": sum(r["tokens"] for r in done_batch),
        "batch_cancelled": phase["cancelled_batch"], "failed_by_status": failed,
        "util": sum(u) / len(u) if u else None, "util_samples": len(u),
    }


SPLIT_HOOK = pathlib.Path(__file__).resolve().parent / "ttft_split"


def engine_events(directory: str) -> tuple[dict, dict, dict]:
    """What bench/ttft_split's hook wrote: arrivals by prompt key (lists of (time,
    id)), and each request id's first scheduled and first output time."""
    adds, sched, first = {}, {}, {}
    for path in pathlib.Path(directory).glob("engine.*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["ev"] == "add":
                adds.setdefault(tuple(e["key"]), []).append((e["t"], e["id"], e.get("arrival")))
            elif e["ev"] == "sched":
                for r in e["new"]:
                    sched.setdefault(r, e["t"])
            else:
                for r in e["first"]:
                    first.setdefault(r, e["t"])
    return adds, sched, first


def split_ttft(records: list[dict], directory: str) -> dict:
    """The interactive requests' TTFT in four parts (p50 / p90 / max, seconds):
    front_in, the client's send to the engine core's add_request (HTTP, the API
    server, the engine's input queue), itself in two: api, the send to the API
    server's arrival time of it (the client's own sending, HTTP, the API server
    before vLLM's input processing), and engine_in, from there to add_request;
    queue, add_request to the step that starts it (the scheduler's waiting queue,
    kvadmit's holds); engine, add_request to the
    step that emits its first token; front_out, that step to the client's first
    token. A request matches the first arrival with its first 8 prompt tokens after
    its send."""
    adds, sched, first = engine_events(directory)
    parts = {"front_in": [], "api": [], "engine_in": [], "queue": [], "engine": [],
             "front_out": []}
    for r in records:
        if r.get("kind") != "interactive" or r.get("first_wall") is None:
            continue
        cands = [a for a in adds.get(tuple(r["key"]), ()) if a[0] >= r["sent_wall"] - 0.01]
        if not cands:
            continue
        t_add, rid, arrival = min(cands)
        parts["front_in"].append(t_add - r["sent_wall"])
        if arrival is not None:
            parts["api"].append(arrival - r["sent_wall"])
            parts["engine_in"].append(t_add - arrival)
        if rid in sched:
            parts["queue"].append(sched[rid] - t_add)
        if rid in first:
            parts["engine"].append(first[rid] - t_add)
            parts["front_out"].append(r["first_wall"] - first[rid])

    def q(v):
        v = sorted(v)
        return {"p50": percentile(v, 50), "p90": percentile(v, 90), "max": v[-1]} if v else None
    return {k: q(v) for k, v in parts.items()} | {"matched": len(parts["front_in"])}


def run_config(args, name: str) -> dict:
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
    cfg, priority, flow = configs()[name]
    model = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    engine = Engine(num_blocks=args.num_blocks + 1, block_size=32, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    log = pathlib.Path(tempfile.gettempdir()) / f"kvadmit-nn-serve-{name}.log"
    log.write_text("")
    split_dir, env = None, {}
    if args.split_ttft:       # the server's processes load bench/ttft_split/sitecustomize.py
        split_dir = tempfile.mkdtemp(prefix="kvadmit-ttft-split-")
        env = {"KVADMIT_TTFT_SPLIT_DIR": split_dir, "PYTHONPATH": os.pathsep.join(
            [str(SPLIT_HOOK)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    server = Server(cfg, model, engine, log, env=env, engine_cpus=tuple(args.engine_cpus))
    chat = make_requests("interactive", args.interactive_rps, args.seconds, args.seed + 1,
                         args.interactive_lengths[0], args.interactive_lengths[1], 128,
                         args.max_model_len)
    batch = make_requests("batch", args.batch_rps, args.seconds, args.seed + 2,
                          args.batch_lengths[0], args.batch_lengths[1], 512, args.max_model_len)
    both = sorted(chat + batch, key=lambda r: r["arrival_s"])
    t_start = time.time()

    def progress(msg):
        print(f"[{name} {time.time() - t_start:6.1f} s] {msg}", flush=True)
    out = {"config": name, "doc": cfg.doc, "flags": list(server.command()[3:]), "phases": {},
           "server_per_phase": not args.shared_server}

    def up():
        progress(f"starting {' '.join(server.command())} (log {log})")
        server.start()
        server.wait_ready(300)
        if server.bound:
            progress(f"engine processes on CPUs {args.engine_cpus}: {server.bound}")
        progress("up; warm-up")
        run_clients(server.base, model, make_requests(
            "interactive", 4.0, 2.0, 999, 64, 8, 128, args.max_model_len), 2.0, priority, flow,
            lambda m: None)

    try:
        for i, (phase, reqs) in enumerate(zip(PHASES, (chat, batch, both))):
            if i == 0 or not args.shared_server:
                # A phase on a server of its own, as the goal's runs are: what a phase
                # taught kvadmit (its length quantile, raised by the batch flow's
                # preemptions) must not carry into the next one.
                server.stop()
                up()
            wait_idle(server)
            before = scrape_metrics(server.base)
            progress(f"phase {phase}: {len(reqs)} requests over {args.seconds:g} s")
            res = run_clients(server.base, model, reqs, args.seconds, priority, flow, progress)
            after = wait_idle(server)
            s = summarize(res, args.seconds, args.ttft, args.tpot)
            if split_dir is not None:
                s["ttft_split"] = split_ttft(res["records"], split_dir)
            if s.get("ttft_split", {}).get("matched"):
                progress("  TTFT split (p50 / p90 / max s): " + "; ".join(
                    f"{k} {v['p50']:.3f} / {v['p90']:.3f} / {v['max']:.3f}"
                    for k, v in s["ttft_split"].items() if isinstance(v, dict)))
            s["preemptions"] = int(round(after.get("vllm:num_preemptions_total", 0)
                                         - before.get("vllm:num_preemptions_total", 0)))
            s["wall_s"] = res["wall_s"]
            if "kvadmit_displacements_total" in after:   # of the preemptions, kvadmit's displacements
                s["displacements"] = int(round(after["kvadmit_displacements_total"]
                                               - before.get("kvadmit_displacements_total", 0)))
            # kvadmit's holds in the phase, by reason ((request, step) pairs at the queue head)
            s["kvadmit_held"] = {k.split('"')[1]: int(round(v - before.get(k, 0)))
                                 for k, v in after.items()
                                 if k.startswith("kvadmit_held_total{") and v - before.get(k, 0)}
            # the length quantile kvadmit's default predicts by, at the phase's start
            # and end (its controller raises it after preemptions; with --shared-server
            # the next phase starts where this one ended)
            if "kvadmit_length_quantile" in after:
                s["kvadmit_quantile"] = [before.get("kvadmit_length_quantile"),
                                         after["kvadmit_length_quantile"]]
            out["phases"][phase] = s
            progress(f"phase {phase}: interactive goodput {s['interactive_goodput']}, util "
                     f"{s['util']}, batch finished {s['batch_finished_in_window']}, "
                     f"preemptions {s['preemptions']}, failed {s['failed_by_status']}")
    finally:
        server.stop()
        if split_dir is not None:
            shutil.rmtree(split_dir, ignore_errors=True)
    ph = out["phases"]
    if ph["interactive alone"]["interactive_goodput"]:
        out["goodput_vs_alone"] = (ph["both"]["interactive_goodput"]
                                   / ph["interactive alone"]["interactive_goodput"])
    fin = ph["batch alone"]["batch_finished_in_window"]
    if fin:      # the batch flow's offer over its share (half the batch-alone throughput)
        out["batch_offer_x_share"] = args.batch_rps / (0.5 * fin / args.seconds)
    if ph["batch alone"]["util"]:
        out["util_vs_batch_only"] = ph["both"]["util"] / ph["batch alone"]["util"]
    out["args"] = {k: v for k, v in vars(args).items() if k != "configs"}
    out["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                      "python": platform.python_version()}
    out["wall_s"] = time.time() - t_start
    path = OUT_DIR / f"{name}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(out, indent=1))
    progress(f"saved {path}")
    return out


def report(tag: str = "") -> int:
    rows = []
    for name in configs():
        p = OUT_DIR / f"{name}{'-' + tag if tag else ''}.json"
        if p.exists():
            rows.append(json.loads(p.read_text()))
    if not rows:
        print(f"no results in {OUT_DIR}")
        return 1
    a = rows[0]["args"]
    print(f"interactive {a['interactive_rps']} req/s, batch {a['batch_rps']} req/s, "
          f"{a['seconds']} s each phase; SLO TTFT {a['ttft']} s, TPOT {a['tpot']} s; "
          f"pool {a['num_blocks']} x 32 tokens")
    for r in rows:
        if {k: v for k, v in r["args"].items() if k not in ("report", "tag")} != \
                {k: v for k, v in a.items() if k not in ("report", "tag")}:
            print(f"note: {r['config']} ran with other arguments: {r['args']}")
        fin = r["phases"]["batch alone"]["batch_finished_in_window"]
        if fin:
            r["batch_offer_x_share"] = r["args"]["batch_rps"] / (0.5 * fin / r["args"]["seconds"])
            print(f"{r['config']}: batch offered {r['batch_offer_x_share']:.1f} x its share "
                  f"(half the batch requests' throughput alone, {fin / r['args']['seconds']:.2f} req/s)")
    print("| config | interactive goodput alone | with batch | vs alone | interactive TTFT p50 / p99 (s) "
          "| pool utilisation batch alone | with both | vs batch only | batch finished alone / with "
          "| preemptions (both) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ph = r["phases"]
        i, b, x = ph["interactive alone"], ph["batch alone"], ph["both"]
        print(f"| {r['config']} | {i['interactive_goodput']:.3f} | {x['interactive_goodput']:.3f} "
              f"| {r.get('goodput_vs_alone', float('nan')):.1%} "
              f"| {x['interactive_ttft_p50_s']:.2f} / {x['interactive_ttft_p99_s']:.2f} "
              f"| {b['util']:.3f} | {x['util']:.3f} | {r.get('util_vs_batch_only', float('nan')):.1%} "
              f"| {b['batch_finished_in_window']} / {x['batch_finished_in_window']} "
              f"| {x['preemptions']} |")
    out = RESULTS / f"noisy_neighbour_serve{'_' + tag if tag else ''}.json"
    out.write_text(json.dumps(
        [{k: r[k] for k in ("config", "doc", "goodput_vs_alone", "util_vs_batch_only",
                            "batch_offer_x_share", "phases",
                            "args", "machine") if k in r} for r in rows], indent=1))
    print(f"saved {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=list(configs()), default=[])
    ap.add_argument("--report", action="store_true", help="print the table of the saved runs")
    ap.add_argument("--seconds", type=float, default=20.0, help="each phase's arrival window")
    ap.add_argument("--interactive-rps", type=float, default=4.0)
    ap.add_argument("--batch-rps", type=float, default=12.0)
    ap.add_argument("--interactive-lengths", type=float, nargs=2, default=[64, 32])
    ap.add_argument("--batch-lengths", type=float, nargs=2, default=[384, 320])
    ap.add_argument("--ttft", type=float, default=1.0, help="interactive SLO: TTFT (s)")
    ap.add_argument("--tpot", type=float, default=0.1, help="interactive SLO: TPOT (s)")
    ap.add_argument("--num-blocks", type=int, default=48, help="usable KV blocks of 32 tokens")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--engine-cpus", type=int, nargs="*", default=[],
                    help="bind the server's engine processes (engine core, worker) to these "
                         "CPUs, leaving the others to the API server and the clients")
    ap.add_argument("--shared-server", action="store_true",
                    help="run the three phases on one server, one after another (before "
                         "2026-12-03 20:58 UTC the bench's only way): what kvadmit learns in "
                         "batch alone then carries into both")
    ap.add_argument("--tag", default="", help="a suffix for the result files (another workload)")
    ap.add_argument("--split-ttft", action="store_true",
                    help="time each interactive request's way in the server too (a hook, "
                         "bench/ttft_split, on the server's PYTHONPATH): each phase gets "
                         "ttft_split, its TTFT in four parts")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # stop the server on a kill
    if args.report:
        return report(args.tag)
    if not args.configs:
        ap.error("give --configs (one or more) or --report")
    for name in args.configs:
        run_config(args, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
