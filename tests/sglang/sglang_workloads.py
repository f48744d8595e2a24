"""The SGLang retraction workloads (tests/sglang/test_sglang_retractions.py,
bench/sglang_retractions.py): 300 requests arriving 0-3 steps apart, prompts of
20-200 tokens, one family of output lengths and max_new_tokens each, run on the
harness's real SGLang scheduling classes."""
import functools
import random

# family: (output lengths, max_new_tokens), as plan_for draws them
FAMILIES = {
    "slack": "lognormal(4, 0.9) <= 600, max(out, 512)",
    "longprompt": "lognormal(4, 0.9) <= 600, max(out, 512), prompts 300-600",
    "geometric": "exponential mean 100 <= 1000, 1024",
    "short": "lognormal(3, 0.5), 256",
    "uniform": "uniform 1-300, 400",
    "bimodal": "70% 5-30, 30% 200-400, 512",
    "narrow": "lognormal(5, 0.3) <= 400, 512",
    "twopoint": "40 or 250, 300",
    "uniwide": "uniform 50-450, 500",
    "mixcap": "lognormal(4, 0.9) <= 600, half honest caps, half 512",
    "honest": "lognormal(4, 0.9) <= 600, max_new = out",
    "fixed": "128, 512",
    "pareto": "10 x pareto(1.3) <= 900, 1024",
    "drift": "lognormal(3 -> 5 over the run, 0.5) <= 700, 768",
    "bigprompt_uni": "uniform 1-200, 256, prompts 100-400",
}

# (kind, seed, pool) of tests/sglang/test_sglang_retractions.py: those that pass, and
# those known to take more steps than stock SGLang
CASES = [("slack", seed, pool) for seed in (1, 2, 3) for pool in (1500, 2000)] + [
    ("longprompt", 1, 1500), ("longprompt", 2, 2000),
    ("geometric", 1, 2000), ("geometric", 3, 1500),
    ("short", 1, 1500), ("short", 2, 2000),
    ("uniform", 1, 1500), ("uniform", 2, 2000), ("bimodal", 1, 1500), ("bimodal", 2, 2000),
    ("narrow", 1, 1500), ("narrow", 2, 2000), ("twopoint", 1, 1500), ("twopoint", 2, 2000),
    ("mixcap", 1, 1500), ("mixcap", 3, 1500),
]
# light-tailed lengths a little below max_new on larger pools, where the default takes
# more steps than stock (bench/sglang_retractions.py has twelve such on 3000 and 4000
# tokens): the accepted trade, no more retractions for at most STEP_ALLOWANCE more steps
STEP_TRADE = [("uniwide", 1, 2000), ("uniform", 2, 3000), ("uniwide", 1, 4000)]
STEP_ALLOWANCE = 1.10


def plan_for(kind, seed, n=300):
    """{step: [(rid, prompt, max_new, out_len)]} of one workload."""
    if kind not in FAMILIES:
        raise ValueError(f"workload kind={kind!r}: one of {sorted(FAMILIES)}")
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
        elif kind == "narrow":
            out, max_new = min(max(1, int(rng.lognormvariate(5.0, 0.3))), 400), 512
        elif kind == "twopoint":
            out, max_new = (40 if rng.random() < 0.5 else 250), 300
        elif kind == "uniwide":
            out, max_new = rng.randint(50, 450), 500
        elif kind == "mixcap":
            out = min(max(1, int(rng.lognormvariate(4.0, 0.9))), 600)
            max_new = out if rng.random() < 0.5 else 512
        elif kind == "fixed":
            out, max_new = 128, 512
        elif kind == "pareto":
            out, max_new = min(int(10 * rng.paretovariate(1.3)), 900), 1024
        elif kind == "drift":
            out = min(max(1, int(rng.lognormvariate(3.0 + 2.0 * i / n, 0.5))), 700)
            max_new = 768
        else:   # bigprompt_uni
            prompt = rng.randint(100, 400)
            out, max_new = rng.randint(1, 200), 256
        plan.setdefault(step, []).append((f"r{i}", prompt, max_new, out))
    return plan


@functools.lru_cache(maxsize=None)
def run(config, kind, seed, pool, schedule_conservativeness=1.0):
    """(retractions, steps, requests finished) of one workload; config None: stock SGLang
    (runs are deterministic, so each is run once per process). Needs kvadmit's hooks
    installed (tests/sglang/conftest.py: install_kvadmit_hooks)."""
    from sglang_harness import Harness, make_req

    h = Harness(config, pool_tokens=pool, schedule_conservativeness=schedule_conservativeness)
    plan = {s: [make_req(rid, p, m, out_len=o) for rid, p, m, o in ws]
            for s, ws in plan_for(kind, seed).items()}
    log = h.run(plan)
    return log.retracted, h.steps, len(h.finished)
