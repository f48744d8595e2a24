"""Step-time model T = a + b * (tokens in the batch) + c * (context of the batch).

`a` is what a step costs whatever it holds (reading the weights once, launch and
scheduler overhead), `b` what each scheduled token costs (the matmuls: about
2 * params FLOPs a token), `c` what each context token of the batch costs (its
K and V are read by attention). The GPU presets come from a roofline of the
hardware and the model, with the efficiency factors below; they are estimates,
not measurements. The CPU preset is fitted to vLLM's CPU engine on this
project's tiny model (bench/fit_cpu_step_time.py; the command and data in
bench/results/cpu_step_time.json).
"""
from __future__ import annotations

from dataclasses import dataclass

# Fractions of the datasheet numbers a serving engine reaches (assumptions,
# typical of published vLLM/SGLang measurements).
HBM_EFFICIENCY = 0.8        # achieved / peak memory bandwidth
MFU = 0.5                   # achieved / peak dense bf16 FLOP/s for the token matmuls
STEP_OVERHEAD_S = 0.002     # launches, sampling, scheduler: per step


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float      # aggregate over the GPUs
    bf16_flops: float           # dense, aggregate
    memory_bytes: float         # aggregate


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params                                  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0   # K and V, bf16


H100 = Hardware("H100 SXM", 3.35e12, 989e12, 80e9)
H200 = Hardware("H200 SXM", 4.8e12, 989e12, 141e9)
H100X4 = Hardware("4x H100 SXM (TP4)", 4 * 3.35e12, 4 * 989e12, 4 * 80e9)
H200X2 = Hardware("2x H200 SXM (TP2)", 2 * 4.8e12, 2 * 989e12, 2 * 141e9)
LLAMA_8B = Model("Llama-3.1-8B", 8.03e9, 32, 8, 128)
LLAMA_70B = Model("Llama-3.1-70B", 70.6e9, 80, 8, 128)


@dataclass(frozen=True)
class StepTimeModel:
    """T = a + b * tokens + c * context, in seconds."""
    a: float
    b: float
    c: float
    name: str = "custom"
    num_blocks: int = 0         # the KV pool the preset's hardware holds (0: not given)
    block_size: int = 16
    max_model_len: int = 8192
    note: str = ""

    def __post_init__(self) -> None:
        for k in ("a", "b", "c"):
            v = getattr(self, k)
            if not (v >= 0.0 and v < float("inf")):
                raise ValueError(f"step time {k}={v}: must be a finite number >= 0 (seconds)")
        if self.a + self.b <= 0:
            raise ValueError("step time a + b must be > 0")

    def step_s(self, tokens: int, context: int) -> float:
        return self.a + self.b * tokens + self.c * context

    def as_dict(self) -> dict:
        return {"name": self.name, "a": self.a, "b": self.b, "c": self.c,
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "max_model_len": self.max_model_len, "note": self.note}


def roofline(hw: Hardware, model: Model, gpu_memory_utilization: float = 0.9,
             block_size: int = 16, max_model_len: int = 8192) -> StepTimeModel:
    """The preset for `model` on `hw`:
    a = weight bytes / (HBM bandwidth * HBM_EFFICIENCY) + STEP_OVERHEAD_S
    b = 2 * params / (peak FLOP/s * MFU)
    c = KV bytes per token / (HBM bandwidth * HBM_EFFICIENCY)
    KV pool = (memory * gpu_memory_utilization - weights) / KV bytes per token."""
    bw = hw.hbm_bytes_per_s * HBM_EFFICIENCY
    kv_tokens = (hw.memory_bytes * gpu_memory_utilization - model.weight_bytes) / model.kv_bytes_per_token
    if kv_tokens < max_model_len:
        raise ValueError(f"{model.name} does not fit {hw.name} with a {max_model_len}-token context")
    return StepTimeModel(
        a=model.weight_bytes / bw + STEP_OVERHEAD_S,
        b=2.0 * model.params / (hw.bf16_flops * MFU),
        c=model.kv_bytes_per_token / bw,
        name=f"{model.name} on {hw.name}",
        num_blocks=int(kv_tokens // block_size), block_size=block_size, max_model_len=max_model_len,
        note=f"roofline: HBM x{HBM_EFFICIENCY}, MFU {MFU}, +{STEP_OVERHEAD_S * 1e3:g} ms a step, "
             f"gpu_memory_utilization {gpu_memory_utilization}")


# Fitted to vLLM 0.32 CPU on the tiny random Llama (kvadmit.vllm.tiny_model) on the
# 2-core dev machine: `python bench/fit_cpu_step_time.py`, 383 steps, R^2 0.984,
# mean relative error 14% (16% on decode-only steps, whose cost follows the number
# of requests more than their context; bench/results/cpu_step_time.json).
CPU_TINY = StepTimeModel(a=1.883e-3, b=33.30e-6, c=545.4e-9, name="vLLM CPU, tiny Llama (fitted)",
                         num_blocks=33, block_size=32, max_model_len=1024,
                         note="least squares on the real CPU engine's step times")

PRESETS: dict[str, StepTimeModel] = {
    "h100-8b": roofline(H100, LLAMA_8B),
    "h200-8b": roofline(H200, LLAMA_8B),
    "h100x4-70b": roofline(H100X4, LLAMA_70B),
    "h200x2-70b": roofline(H200X2, LLAMA_70B),
    "cpu-tiny": CPU_TINY,
}


def get_preset(name: str) -> StepTimeModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"step-time preset {name!r}: must be one of {sorted(PRESETS)}") from None
