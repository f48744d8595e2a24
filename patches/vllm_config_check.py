"""vLLM 0.32 and 0.33: kvadmit's settings are checked where vLLM builds its config, in the
API server (or offline `LLM`) process, before any engine process starts.

vLLM hands `--additional-config` to the engine core untouched; kvadmit's scheduler
reads it there, after the weights load and the KV cache is set up (35-38 s for
the tiny test model on a CPU, minutes for a real one), and the start-up then ends
with vLLM's generic "Engine core initialization failed" 60 lines below kvadmit's
message. This patch wraps `EngineArgs.create_engine_config` so that the config it
returns is handed to a check (kvadmit.vllm.plugin.check_vllm_config) first: a bad
kvadmit setting stops start-up in seconds, with its `ConfigError` as the last
thing printed. The engine-side check stays (kvadmit.vllm.scheduler).

Applied in every vLLM process by the `vllm.general_plugins` entry point `kvadmit`.
"""
from __future__ import annotations

from kvadmit_patches import wrap

TARGET = "vllm.engine.arg_utils.EngineArgs.create_engine_config"
# 0.33.0 variant: the same wrapper; create_engine_config's signature and result are
# unchanged from 0.32.0 (its body builds a few more config fields).
VERSIONS = ("0.32.0", "0.33.0")


def apply(check) -> bool:
    """Installs the wrapper once (`check(vllm_config)` raises on a bad config);
    returns False (and does nothing) on other versions."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    if vllm.__version__ not in VERSIONS:
        return False

    def make(original):
        def create_engine_config(self, *args, **kwargs):
            vllm_config = original(self, *args, **kwargs)
            check(vllm_config)
            return vllm_config
        return create_engine_config

    wrap(EngineArgs, "create_engine_config", make)
    return True
