"""The client of bench/gpu_sglang.sh: one configuration's workload against a running
SGLang server (/generate, streaming), then its /metrics; prints one JSON row.

    python bench/gpu_sglang_client.py NAME MODEL PORT N CONCURRENCY TIMEOUT

With DRY_RUN=1 it builds the same workload and prints the row without sending
anything ("dry_run": true, measurements None): SGLang cannot serve on a CPU.
"""
import concurrent.futures as cf
import http.client
import json
import os
import pathlib
import random
import re
import statistics
import sys
import time


def workload(name: str, vocab: int, n: int) -> list[dict]:
    """Deterministic (seed 0): prompts of 64-512 random token ids, max_new_tokens 1024;
    25% run to max_new (ignore_eos), the rest stop at one of vocab/64 stop ids."""
    rng = random.Random(0)
    stop = sorted(rng.sample(range(3, vocab), max(1, vocab // 64)))
    work = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(64, 512))]
        long = rng.random() < 0.25
        sp = {"max_new_tokens": 1024, "temperature": 1.0, "sampling_seed": i}
        if long:
            sp["ignore_eos"] = True
        else:
            sp["stop_token_ids"] = stop
        work.append({"input_ids": prompt, "sampling_params": sp, "stream": True, "rid": f"{name}-{i}"})
    return work


def one(body: dict, port: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    first = last = None
    ntok = 0
    fin = None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        return {"ok": False, "status": resp.status, "body": resp.read()[:300].decode(errors="replace")}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        out = json.loads(line[5:])
        if "error" in out:
            return {"ok": False, "status": out["error"].get("code"), "body": out["error"]["message"]}
        meta = out.get("meta_info", {})
        k = meta.get("completion_tokens", 0)
        now = time.perf_counter()
        if k >= 1 and first is None:
            first = now
        if k > ntok:
            ntok, last = k, now
        fin = meta.get("finish_reason") or fin
    conn.close()
    return {"ok": True, "ttft": (first or time.perf_counter()) - t0, "n": ntok,
            "tpot": (last - first) / (ntok - 1) if ntok > 1 else None, "finish": fin,
            "e2e": time.perf_counter() - t0}


def scrape(port: int) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()

    def total(metric):
        return sum(float(m) for m in re.findall(
            rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return {"retracted": total("sglang:num_retracted_requests_total"),
            "kvadmit_preempted": total("kvadmit:preempted_total"),
            "kvadmit_admitted": total("kvadmit:admitted_total")}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def measure(name: str, work: list[dict], port: int, conc: int, timeout: float) -> dict:
    n = len(work)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(conc) as ex:
        res = list(ex.map(lambda body: one(body, port, timeout), work))
    wall = time.perf_counter() - t0
    ok = [r for r in res if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {"config": name, "requests": n, "ok": len(ok), "failed": len(res) - len(ok),
            "wall_s": round(wall, 2), "output_tokens": sum(r["n"] for r in ok),
            "output_tok_per_s": round(sum(r["n"] for r in ok) / wall, 1),
            "ttft_mean_s": round(statistics.mean(ttft), 3) if ttft else None,
            "ttft_p99_s": round(pct(ttft, 0.99), 3) if ttft else None,
            "tpot_mean_ms": round(1000 * statistics.mean(tpot), 2) if tpot else None,
            "tpot_p99_ms": round(1000 * pct(tpot, 0.99), 2) if tpot else None,
            **scrape(port),
            "first_failure": next((r for r in res if not r["ok"]), None)}


def dry_row(name: str, work: list[dict]) -> dict:
    """The row's shape with nothing measured (no server)."""
    return {"config": name, "requests": len(work), "dry_run": True,
            "prompt_tokens": sum(len(w["input_ids"]) for w in work),
            "ignore_eos": sum(bool(w["sampling_params"].get("ignore_eos")) for w in work),
            **{k: None for k in ("ok", "failed", "wall_s", "output_tokens", "output_tok_per_s",
                                 "ttft_mean_s", "ttft_p99_s", "tpot_mean_ms", "tpot_p99_ms",
                                 "retracted", "kvadmit_preempted", "kvadmit_admitted",
                                 "first_failure")}}


def main(argv: list[str]) -> None:
    name, model, port, n, conc, timeout = (argv[0], argv[1], int(argv[2]), int(argv[3]),
                                           int(argv[4]), float(argv[5]))
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    work = workload(name, vocab, n)
    if os.environ.get("DRY_RUN") == "1":
        row = dry_row(name, work)
    else:
        row = measure(name, work, port, conc, timeout)
    print(json.dumps(row))
    print(f"{name:>8}: retracted={row['retracted']} ok={row['ok']}/{n} "
          f"out_tok/s={row['output_tok_per_s']} TTFT mean/p99={row['ttft_mean_s']}/"
          f"{row['ttft_p99_s']} s TPOT mean/p99={row['tpot_mean_ms']}/{row['tpot_p99_ms']} ms "
          f"wall={row['wall_s']} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
