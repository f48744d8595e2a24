"""kvadmit for SGLang 0.5.23, through SGLang's own plugin framework (no fork).

Entry point: group ``sglang.srt.plugins``, name ``kvadmit``, value
``kvadmit.sglang:register``. Configure with ``--kvadmit-config '<JSON>'`` on
``sglang serve`` / ``python -m sglang.launch_server``, or ``KVADMIT_CONFIG``
(same JSON) in the environment. Without either, SGLang behaves as if kvadmit
were not installed. See `kvadmit.sglang.plugin` for the hooks. Per-request
settings (SLO targets, deadline, agent session) ride SGLang's
``custom_params`` under ``"kvadmit"`` (`parse_request_params`; the fields
are `kvadmit.request_fields`, as for vLLM).

Importing this package does not import SGLang.
"""
from kvadmit.sglang.adapter import ClockTick, SGLangAdmission
from kvadmit.sglang.plugin import (
    CLI_FLAG,
    SUPPORTED_SGLANG,
    KvadmitStartupError,
    cli_hooks,
    engine_hooks,
    install_engine_hooks,
    register,
    verify,
)
from kvadmit.sglang.request import PARAMS_KEY, parse_request_params, rejection_finish_reason
from kvadmit.sglang.settings import ENV_VAR

__all__ = [
    "CLI_FLAG", "ENV_VAR", "PARAMS_KEY", "ClockTick", "KvadmitStartupError", "SGLangAdmission",
    "SUPPORTED_SGLANG", "cli_hooks", "engine_hooks", "install_engine_hooks",
    "parse_request_params", "register", "rejection_finish_reason", "verify",
]
