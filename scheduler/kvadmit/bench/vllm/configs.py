"""The engine every configuration runs on, and the configurations: vLLM's own scheduler
(and its knobs), kvadmit's policies, NAME=JSON; parsed from `--configs`. Imports no vLLM."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvadmit._native import POLICIES
from kvadmit.simulate.scorecard import WATERMARKS


@dataclass(frozen=True)
class BenchEngine:
    """The engine every configuration runs on (vLLM's argument names)."""
    num_blocks: int = 33            # vLLM's num_gpu_blocks_override: one of them is its null block
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 2048   # None: vLLM's default (4096 on its CPU build)
    dtype: str = "float32"

    def sim_shape(self):
        """The simulator's EngineShape of this engine (it counts usable blocks only)."""
        from kvadmit.simulate import EngineShape
        if self.max_num_batched_tokens is None:
            raise ValueError("the simulator needs the engine's max_num_batched_tokens")
        return EngineShape(num_blocks=self.num_blocks - 1, block_size=self.block_size,
                           max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens)


CONFIGS = {"vllm-default": None, **{p: {"policy": p} for p in POLICIES},
           # adaptive with every knob for throughput: a fixed optimistic quantile (no
           # raising), unlimited bypass, and pausing instead of preempting on a shortfall.
           "adaptive+pause": {"policy": "adaptive", "shortfall": "pause", "adaptive_quantile": 0.4,
                              "adaptive_max_quantile": 0.4, "adaptive_min_samples": 1,
                              "head_of_line": "bypass", "max_bypass": 1000, "bypass_lookahead": 256},
           # the empty config: what `--scheduler-cls kvadmit.vllm.Scheduler` alone gives
           "kvadmit-default": {}}
CONFIG_DOCS = {"vllm-default": "vLLM 0.32's own scheduler, no admission flags",
               **{p: f"kvadmit, policy {p!r}" for p in POLICIES},
               "adaptive+pause": "kvadmit adaptive at a fixed 0.4 quantile, bypass, pause on a shortfall",
               "kvadmit-default": "kvadmit with the empty config {}: AdmissionConfig()'s defaults (policy auto)"}

# vLLM's --max-num-queued-reqs: a bench-only name (the simulator models the engine
# core, where this cap does not act). vLLM checks it in AsyncLLM.check_admission (its
# API server) only; LLM.generate, which this bench drives, never does.
QUEUED_KNOB = "vllm-queued"
QUEUED_DOC = ("vLLM with --max-num-queued-reqs {}: checked only by vLLM's API server "
              "(AsyncLLM), never by offline LLM.generate, so it runs as vllm-default here")
# vLLM engine arguments that act outside the engine core (the simulator has no field for them)
FRONT_END_ONLY = ("max_num_queued_reqs",)
DEFAULT_CONFIG = "kvadmit-default"   # the empty config's row


@dataclass(frozen=True)
class BenchConfig:
    """One row: which scheduler runs, with which of vLLM's own engine arguments."""
    label: str
    kvadmit: dict | None        # additional_config["kvadmit"]; None: vLLM's own scheduler
    engine_args: dict           # vLLM EngineArgs fields: its own knobs (watermark, ...)
    doc: str

    def sim(self, shape):
        """(AdmissionConfig, EngineShape) for the simulator's native engine: vLLM's rule
        (overcommit, LIFO victim) with its knobs in the shape, or kvadmit's config."""
        from kvadmit.config import AdmissionConfig
        from kvadmit.vllm.settings import VllmSettings
        # vLLM-only settings (native_allocator) change no decision: the simulator has none.
        config = (AdmissionConfig(policy="overcommit", victim="lifo") if self.kvadmit is None
                  else AdmissionConfig.from_dict(VllmSettings.split(self.kvadmit)[1]))
        knobs = {k: v for k, v in self.engine_args.items() if k not in FRONT_END_ONLY}
        return config, dataclasses.replace(shape, **knobs)


def _vllm_only_keys(value: str) -> dict:
    """The vLLM-only keys of a NAME=JSON config's JSON, checked ({} if it is not an object)."""
    from kvadmit.vllm.settings import VLLM_ONLY_KEYS, VllmSettings
    try:
        settings = json.loads(value)
    except json.JSONDecodeError:
        return {}                        # parse_policy names the JSON error
    if not isinstance(settings, dict):
        return {}
    VllmSettings.split(settings)         # a bad vLLM-only value is an error now
    return {k: v for k, v in settings.items() if k in VLLM_ONLY_KEYS}


def parse_config(text: str) -> BenchConfig:
    """A bench name (CONFIGS), `vllm-watermark=F`, `vllm-active=N`, `vllm-queued=N`,
    a simulator baseline, or NAME=JSON with kvadmit's AdmissionConfig keys and the
    vLLM-only ones (kvadmit.vllm.settings)."""
    from kvadmit.simulate.policies import parse_policy
    if text in CONFIGS:
        return BenchConfig(text, CONFIGS[text], {}, CONFIG_DOCS[text])
    name, sep, value = text.partition("=")
    if sep and name == QUEUED_KNOB:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"config {text}: max_num_queued_reqs must be an integer >= 1")
        return BenchConfig(text, None, {"max_num_queued_reqs": n}, QUEUED_DOC.format(n))
    # NAME=JSON may hold vLLM-only keys (native_allocator): the simulator's parser,
    # which checks the rest, does not take them.
    vllm_only = _vllm_only_keys(value) if sep else {}
    if vllm_only:
        text = f"{name}={json.dumps({k: v for k, v in json.loads(value).items() if k not in vllm_only})}"
    # vllm-watermark=F and vllm-active=N: the simulator's names, checks and engine
    # fields (EngineShape's knob fields carry vLLM's EngineArgs names).
    spec = parse_policy(text)
    if spec.oracle:
        raise ValueError(f"config {text}: the oracle needs true lengths as caps: use --caps real "
                         f"with peak instead")
    return BenchConfig(spec.name, None if spec.vllm_own else {**spec.settings, **vllm_only},
                       dict(spec.engine), f"custom: {value}" if vllm_only else spec.doc)


def split_configs(args: list[str]) -> list[str]:
    """`--configs` values: names separated by spaces or commas; a comma inside a NAME=JSON
    object (braces, brackets, strings) belongs to the JSON."""
    out = []
    for arg in args:
        depth, in_str, escaped, cur = 0, False, False, []
        for ch in arg:
            if in_str:
                escaped = not escaped and ch == "\\"
                in_str = escaped or ch != '"'
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
            elif ch == "," and depth == 0:
                out.append("".join(cur).strip())
                cur = []
                continue
            cur.append(ch)
        out.append("".join(cur).strip())
    return [c for c in out if c]


def default_configs() -> list[str]:
    """Without --configs: vLLM's default and its watermarks, then every kvadmit config
    (the policy the empty config defaults to only once, as kvadmit-default)."""
    from kvadmit.config import AdmissionConfig
    same_as_default = {"policy": AdmissionConfig().policy}
    return (["vllm-default"] + [f"vllm-watermark={w:g}" for w in WATERMARKS] +
            [c for c, kv in CONFIGS.items() if c != "vllm-default" and kv != same_as_default])
