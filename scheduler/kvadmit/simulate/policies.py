"""The policies `kvadmit simulate` compares, by name.

Baselines are other engines' admission rules expressed in the core's terms, so
every row runs on the same engine model and only the decision differs. With
`--engine vllm`, `vllm-default` is vLLM's own Scheduler class, not the core.
"""
from __future__ import annotations

import json

from dataclasses import dataclass

from kvadmit.config import AdmissionConfig


@dataclass(frozen=True)
class PolicySpec:
    name: str
    settings: dict                 # AdmissionConfig keys
    doc: str
    kvadmit: bool = True           # takes the user's --config (caps etc.)
    oracle: bool = False           # max_tokens := the true output length
    vllm_own: bool = False         # --engine vllm: vLLM's own scheduler class

    def config(self, base: AdmissionConfig) -> AdmissionConfig:
        if self.kvadmit:
            return base.replace(**self.settings)
        return AdmissionConfig.from_dict(self.settings)


BUILTIN: dict[str, PolicySpec] = {p.name: p for p in (
    PolicySpec("vllm-default", {"policy": "overcommit", "victim": "lifo"},
               "vLLM V1: admit while the step's blocks fit; when the pool runs dry, "
               "preempt the latest admitted (recompute)", kvadmit=False, vllm_own=True),
    PolicySpec("sglang", {"policy": "predict", "victim": "length"},
               "SGLang 0.5.23: admit on the decaying new_token_ratio estimate of running "
               "requests' growth; retract fewest-output, longest-prompt first", kvadmit=False),
    PolicySpec("trtllm-no-evict", {"policy": "reserve"},
               "TensorRT-LLM GUARANTEED_NO_EVICT: admit only if prompt + max_tokens of "
               "every running request fits", kvadmit=False),
    PolicySpec("trtllm-max-util", {"policy": "overcommit", "victim": "lifo"},
               "TensorRT-LLM MAX_UTILIZATION: pack while the step fits, pause (evict, "
               "recompute) the latest started: the same rule as vLLM's", kvadmit=False),
    PolicySpec("peak", {"policy": "peak"},
               "kvadmit peak: admit if the running set's exact worst-case KV peak fits"),
    PolicySpec("adaptive", {"policy": "adaptive"},
               "kvadmit adaptive: peak over learned output-length quantiles, tuned online"),
    PolicySpec("oracle", {"policy": "peak"},
               "clairvoyant limit: peak with every request's true output length as max_tokens",
               oracle=True),
)}

DEFAULT_POLICIES = list(BUILTIN)


def parse_policy(text: str) -> PolicySpec:
    """A built-in name, or NAME=JSON with AdmissionConfig keys (a kvadmit variant)."""
    if text in BUILTIN:
        return BUILTIN[text]
    name, sep, js = text.partition("=")
    if not sep:
        raise ValueError(f"policy {text!r}: not one of {sorted(BUILTIN)} and not NAME=JSON")
    try:
        settings = json.loads(js)
    except json.JSONDecodeError as e:
        raise ValueError(f"policy {name!r}: JSON settings do not parse ({e.msg})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"policy {name!r}: settings must be a JSON object")
    AdmissionConfig.from_dict(settings)          # names the bad key now, not mid-run
    return PolicySpec(name, settings, f"custom: {js}")
