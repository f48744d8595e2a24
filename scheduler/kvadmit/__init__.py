"""kvadmit: engine-side KV-cache admission control for LLM serving.

The decisions live in the compiled core: one extension module per part
(``kvadmit._core``, ``kvadmit._policies``, ...; docs/architecture.md), all
re-exported by ``kvadmit._native``; this package adds the configuration,
engine adapters, simulator and command line.
"""
try:
    from kvadmit import _native
except ImportError as e:  # no pure-Python fallback: the core must be compiled
    raise ImportError(
        "kvadmit's compiled core (kvadmit._native) is missing or failed to load: "
        f"{e}. Install kvadmit with `pip install .` (needs a C++ compiler) so the "
        "Cython extension is built."
    ) from e

from kvadmit._native import (
    DECISIONS,
    POLICIES,
    REJECT_REASONS,
    VICTIMS,
    AdmissionCore,
    ArrivalResult,
    BlockAllocator,
    BlockObjectQueue,
    FreeBlockQueue,
    OutputLengthModel,
    Rejection,
    Requests,
    StepPlanner,
    next_quantile,
    peak_blocks,
    prompt_blocks,
)
from kvadmit.arrival import ArrivalRecord
from kvadmit.config import AdmissionConfig, ConfigError

# The engine adapters' own settings register their keys with kvadmit.config (which knows
# none of them), so every engine's config error names a vLLM-only key as one. No engine import.
from kvadmit.vllm import settings as _vllm_settings  # noqa: E402,F401

__version__ = "0.1.0"

__all__ = [
    "AdmissionConfig", "AdmissionCore", "ArrivalRecord", "ArrivalResult", "BlockAllocator",
    "BlockObjectQueue", "ConfigError", "DECISIONS", "FreeBlockQueue", "OutputLengthModel",
    "POLICIES", "REJECT_REASONS", "Rejection", "Requests", "StepPlanner", "VICTIMS",
    "next_quantile", "peak_blocks", "prompt_blocks",
]
