"""Settings only kvadmit's vLLM scheduler reads.

They go in the same `"kvadmit"` object of vLLM's `--additional-config` as the
core's keys (`kvadmit.config.AdmissionConfig`), but they change how the adapter
sets up vLLM's own objects, not an admission decision: the core's config does not
carry them, and other engines (SGLang's plug-in, the simulator) refuse them with a
ConfigError that names them as vLLM-only (this module registers them with
`kvadmit.config.register_adapter_keys`; the core's config knows no adapter's keys, and
the package imports this module, so every engine knows them). Imports nothing from
vLLM, so that error and `kvadmit config` work without it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvadmit.config import ConfigError, bool_rule, check_fields, key_table, register_adapter_keys


@dataclass(frozen=True)
class VllmSettings:
    native_allocator: bool = field(default=False, metadata=bool_rule(
        "replace vLLM's BlockPool free-block queue with kvadmit's native one (the same block "
        "ids as vLLM's); clients' kv_hold_s needs it"))
    allow_degraded_vllm: bool = field(default=False, metadata=bool_rule(
        "run on a vLLM release kvadmit does not support, or where one of its patches cannot "
        "apply, without what is missing (for example refusals answering HTTP 200 with "
        "finish_reason 'abort'); without it such a release stops start-up naming the "
        "missing pieces"))

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def split(cls, values: Mapping[str, Any]) -> tuple["VllmSettings", dict[str, Any]]:
        """kvadmit's object split into these settings and the rest (the core's keys)."""
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"kvadmit config must be a JSON object / dict, got {type(values).__name__}")
        ours = {k: v for k, v in values.items() if k in VLLM_ONLY_KEYS}
        return cls(**ours), {k: v for k, v in values.items() if k not in VLLM_ONLY_KEYS}

    @classmethod
    def markdown_table(cls) -> str:
        """The vLLM-only key table of docs/configuration.md."""
        return key_table(cls)


VLLM_ONLY_KEYS = frozenset(f.name for f in dataclasses.fields(VllmSettings))
# Other engines (SGLang's plug-in, the simulator) refuse these by name.
register_adapter_keys(VLLM_ONLY_KEYS, "is a vLLM-only setting (kvadmit's vLLM scheduler reads it "
                                      "from --additional-config); this engine does not take it")


def configs_of(additional_config) -> tuple["AdmissionConfig", VllmSettings]:
    """The core's config and the vLLM-only settings in vLLM's `--additional-config`
    (a dict or JSON text; its `"kvadmit"` object, kvadmit.config.section_from)."""
    from kvadmit.config import AdmissionConfig, json_object, section_from

    raw = section_from(additional_config, "--additional-config")
    vllm_settings, core_keys = VllmSettings.split(json_object(raw) if isinstance(raw, str) else raw)
    return AdmissionConfig.from_dict(core_keys), vllm_settings
