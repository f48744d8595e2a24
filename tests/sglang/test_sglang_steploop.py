"""Step loop over a workload with SGLang's real scheduling classes: retractions per policy."""
import random

import pytest

pytest.importorskip("sglang")

from kvadmit import AdmissionConfig  # noqa: E402


def workload(n=48, seed=1):
    """Prompts 20-160 tokens, max_new 256-384; most requests stop early (EOS),
    a quarter run to max_new, so SGLang's decaying new_token_ratio over-admits."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        max_new = rng.choice([256, 384])
        long = rng.random() < 0.25
        out.append((f"w{i}", rng.randint(20, 160), max_new,
                    max_new if long else rng.randint(8, 64)))
    return out


def run_policy(policy, pool=2048, **cfg):
    from sglang_harness import Harness, make_req

    h = Harness(None if policy is None else AdmissionConfig.from_dict({"policy": policy, **cfg}),
                pool_tokens=pool)
    for rid, prompt, max_new, out_len in workload():
        assert h.submit(make_req(rid, prompt, max_new, out_len=out_len))
    log = h.run()
    return h, log


@pytest.mark.parametrize("policy", [None, "reserve", "peak", "predict", "adaptive", "overcommit"])
def test_steploop_runs(kvadmit_hooks, policy):
    h, log = run_policy(policy)
    print(policy, log)
