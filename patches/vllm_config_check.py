"""vLLM 0.32, 0.33 and 0.34: kvadmit's settings are checked where vLLM builds its config, in the
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

from kvadmit_patches import Target, require, wrap

TARGET = "vllm.engine.arg_utils.EngineArgs.create_engine_config"
# The same wrapper on each: create_engine_config's signature and result are unchanged
# since 0.32.0 (0.33's and 0.34's bodies build a few more config fields).
SERIES = ("0.32", "0.33", "0.34")
TARGETS = (Target("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self",)),)


def apply(check) -> bool:
    """Installs the wrapper once (`check(vllm_config)` raises on a bad config);
    PatchUnavailable (nothing done) where it cannot apply."""
    require(__name__)
    from vllm.engine.arg_utils import EngineArgs

    def make(original):
        def create_engine_config(self, *args, **kwargs):
            vllm_config = original(self, *args, **kwargs)
            check(vllm_config)
            return vllm_config
        return create_engine_config

    wrap(EngineArgs, "create_engine_config", make)
    return True
