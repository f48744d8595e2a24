"""The policies `kvadmit simulate` compares, by name.

Baselines are other engines' admission rules expressed in the core's terms, so
every row runs on the same engine model and only the decision differs. With
`--engine vllm`, `vllm-default` is vLLM's own Scheduler class, not the core.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from kvadmit.config import AdmissionConfig


@dataclass(frozen=True)
class PolicySpec:
    name: str
    settings: dict                 # AdmissionConfig keys
    doc: str
    kvadmit: bool = True           # takes the user's --config (caps etc.)
    oracle: bool = False           # max_tokens := the true output length
    vllm_own: bool = False         # --engine vllm: vLLM's own scheduler class
    engine: dict = field(default_factory=dict)   # EngineShape fields: vLLM's own knobs
    # vLLM engine arguments the native engine model does not model: --engine vllm only
    vllm_args: dict = field(default_factory=dict)

    def shape(self, base):
        """The engine shape this policy runs on: `base` with its engine knobs set."""
        return dataclasses.replace(base, **self.engine) if self.engine else base

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
    PolicySpec("auto", {"policy": "auto"},
               "kvadmit auto, the default (no configuration): learned lengths, honest caps "
               "detected, shared prefixes counted once, pause instead of preempt, bypass"),
    PolicySpec("oracle", {"policy": "peak"},
               "clairvoyant limit: peak with every request's true output length as max_tokens",
               oracle=True),
)}

# vLLM's own knobs, the settings a vLLM user reaches for before kvadmit: its scheduler
# (overcommit, LIFO) on an engine with --watermark / --max-num-active-seqs (both engines),
# or, on vLLM's own scheduler only (--engine vllm), 0.33's --prefill-schedule-interval
# and 0.34's --cache-aware-admission-window (which needs prefix caching).
VLLM_KNOBS = {
    "vllm-watermark": ("watermark", float,
                       "vLLM with --watermark {}: admissions keep that share of the pool free"),
    "vllm-active": ("max_num_active_seqs", int,
                    "vLLM with --max-num-active-seqs {}: at most that many running requests"),
    "vllm-prefill-interval": ("prefill_schedule_interval", int,
                              "vLLM with --prefill-schedule-interval {}: prefill only every "
                              "that many steps"),
    "vllm-cache-window": ("cache_aware_admission_window", int,
                          "vLLM 0.34 with --cache-aware-admission-window {}: within that many "
                          "waiting requests, cached-prefix ones go first once KV use passes 0.5"),
}
# The knobs the native engine model does not model (EngineShape has no field for them).
VLLM_ONLY_KNOBS = ("vllm-prefill-interval", "vllm-cache-window")

DEFAULT_POLICIES = list(BUILTIN)


def sglang_conservativeness(value: str) -> PolicySpec:
    """`sglang-conservativeness=F`: SGLang's rule with --schedule-conservativeness F (its
    initial new_token_ratio is min(0.7 F, 1); floor and decay follow from it)."""
    try:
        f = float(value)
    except ValueError:
        raise ValueError(f"policy sglang-conservativeness={value}: must be a number") from None
    if not f > 0:
        raise ValueError(f"policy sglang-conservativeness={value}: must be > 0")
    return PolicySpec(f"sglang-conservativeness={value}",
                      {"policy": "predict", "victim": "length", "predict_init_ratio": min(0.7 * f, 1.0)},
                      f"SGLang 0.5.23 with --schedule-conservativeness {value}", kvadmit=False)


def vllm_knob(name: str, value: str) -> PolicySpec:
    """`vllm-watermark=F`, `vllm-active=N`, `vllm-prefill-interval=N`,
    `vllm-cache-window=N`: vLLM's own scheduler with that engine flag."""
    key, kind, doc = VLLM_KNOBS[name]
    try:
        v = kind(value)
    except ValueError:
        raise ValueError(f"policy {name}={value}: {key} must be a{'n integer' if kind is int else ' number'}") from None
    if kind is float and not 0.0 <= v < 1.0:
        raise ValueError(f"policy {name}={value}: {key} must be in [0, 1) (vLLM's range)")
    if kind is int and v < 1:
        raise ValueError(f"policy {name}={value}: {key} must be >= 1")
    knob = {key: v}
    return PolicySpec(f"{name}={value}", {"policy": "overcommit", "victim": "lifo"}, doc.format(value),
                      kvadmit=False, vllm_own=True,
                      **({"vllm_args": knob} if name in VLLM_ONLY_KNOBS else {"engine": knob}))


def parse_policy(text: str) -> PolicySpec:
    """A built-in name, or NAME=JSON with AdmissionConfig keys (a kvadmit variant)."""
    if text in BUILTIN:
        return BUILTIN[text]
    name, sep, js = text.partition("=")
    if sep and name in VLLM_KNOBS:
        return vllm_knob(name, js)
    if sep and name == "sglang-conservativeness":
        return sglang_conservativeness(js)
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
