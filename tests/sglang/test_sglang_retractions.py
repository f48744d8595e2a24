"""kvadmit's default ``{}`` on SGLang (no pause: a short prediction costs a
retraction) against stock SGLang 0.5.23's own admission rule, on SGLang's real
scheduling classes (tests/sglang/sglang_harness.py): on every workload here it
retracts no more requests than stock SGLang, in no more steps.

Workloads: 300 requests arriving 0-3 steps apart, prompts of 20-200 tokens, on
pools of 1500 and 2000 tokens. Output lengths and max_new_tokens:
  slack       lognormal(4, 0.9) capped at 600, max_new max(out, 512) (issue 22's probe)
  longprompt  the same outputs, prompts of 300-600 tokens
  geometric   exponential, mean 100, capped at 1000, max_new 1024
  short       lognormal(3, 0.5), max_new 256
  honest      lognormal(4, 0.9) capped at 600, max_new = the output length
Two more are known to fail (xfail, strict): outputs uniform on 1-300 with max_new
400, and bimodal (70% of 5-30 tokens, 30% of 200-400, max_new 512): there the
default still retracts a few requests where stock SGLang retracts none or fewer.
"""
import random

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402


def plan_for(kind, seed, n=300):
    """{step: [(rid, prompt, max_new, out_len)]} of one workload."""
    rng = random.Random(seed)
    plan, step = {}, 0
    for i in range(n):
        step += rng.randint(0, 3)
        prompt = rng.randint(20, 200)
        if kind in ("slack", "honest", "longprompt"):
            out = min(max(1, int(rng.lognormvariate(4.0, 0.9))), 600)
            max_new = out if kind == "honest" else max(out, 512)
            if kind == "longprompt":
                prompt = rng.randint(300, 600)
        elif kind == "geometric":
            out = min(max(1, int(rng.expovariate(1 / 100))), 1000)
            max_new = 1024
        elif kind == "short":
            out, max_new = max(1, int(rng.lognormvariate(3.0, 0.5))), 256
        elif kind == "uniform":
            out, max_new = rng.randint(1, 300), 400
        elif kind == "bimodal":
            out = rng.randint(5, 30) if rng.random() < 0.7 else rng.randint(200, 400)
            max_new = 512
        else:
            raise ValueError(kind)
        plan.setdefault(step, []).append((f"r{i}", prompt, max_new, out))
    return plan


def run(config, kind, seed, pool):
    """(retractions, steps, requests finished) of one workload."""
    from sglang_harness import Harness, make_req

    h = Harness(config, pool_tokens=pool)
    plan = {s: [make_req(rid, p, m, out_len=o) for rid, p, m, o in ws]
            for s, ws in plan_for(kind, seed).items()}
    log = h.run(plan)
    return log.retracted, h.steps, len(h.finished)


CASES = [("slack", seed, pool) for seed in (1, 2, 3) for pool in (1500, 2000)] + [
    ("longprompt", 1, 1500), ("longprompt", 2, 2000),
    ("geometric", 1, 2000), ("geometric", 3, 1500),
    ("short", 1, 1500), ("short", 2, 2000),
]
KNOWN_FAILING = [("uniform", 1, 1500), ("bimodal", 1, 1500)]


def check(kind, seed, pool):
    stock = run(None, kind, seed, pool)
    ours = run(AdmissionConfig.from_dict({}), kind, seed, pool)
    print(f"{kind} seed {seed} pool {pool}: stock retracted {stock[0]} in {stock[1]} steps, "
          f"kvadmit {{}} retracted {ours[0]} in {ours[1]} steps")
    assert stock[2] == ours[2] == 300
    assert ours[0] <= stock[0], (kind, seed, pool, stock, ours)
    assert ours[1] <= stock[1], (kind, seed, pool, stock, ours)


@pytest.mark.parametrize("kind,seed,pool", CASES)
def test_no_more_retractions_nor_steps_than_stock(kvadmit_hooks, kind, seed, pool):
    check(kind, seed, pool)


@pytest.mark.parametrize("kind,seed,pool", KNOWN_FAILING)
@pytest.mark.xfail(strict=True, reason="light-tailed and bimodal outputs: several running "
                   "requests overrun their predictions at once (issue 22, item 5, open)")
def test_known_failing(kvadmit_hooks, kind, seed, pool):
    check(kind, seed, pool)


@pytest.mark.parametrize("seed,pool", [(1, 1500), (2, 2000), (3, 1500)])
def test_honest_caps_never_retract(kvadmit_hooks, seed, pool):
    """With honest max_new_tokens the default retracts nothing (stock SGLang does), in
    fewer steps."""
    stock = run(None, "honest", seed, pool)
    ours = run(AdmissionConfig.from_dict({}), "honest", seed, pool)
    assert ours[0] == 0 and ours[2] == 300
    assert stock[0] > 0            # SGLang's own rule does retract here
    assert ours[1] <= stock[1]
