"""kvadmit's vLLM patches on the installed vLLM (CI: 0.32.0, and 0.33.0 and 0.34.0 in
the second and third environments, where no server can run): each applies, wraps its target, and meets the
vLLM objects it works with (its RequestOutput, GracefulHTTPError and error response,
the API server's middleware set-up, EngineArgs). `vllm serve` itself is tested on 0.32
(tests/vllm/test_serve.py)."""
import pytest
import vllm

from kvadmit import ConfigError
from kvadmit.protocol import Refusal
from kvadmit.vllm.plugin import check_vllm_config
import kvadmit_patches
from kvadmit.vllm import compat
from kvadmit_patches import (vllm_config_check, vllm_get_load, vllm_http_status, vllm_orca,
                             vllm_retry_after, vllm_slo_headers)


@pytest.mark.parametrize("patch, owner, name", [
    (vllm_http_status, "vllm.v1.engine.async_llm:AsyncLLM", "generate"),
    (vllm_http_status, "vllm.v1.engine.parallel_sampling:ParentRequest",
     "_get_child_sampling_params"),
    (vllm_http_status, "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion",
     "create_completion"),
    (vllm_http_status, "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat",
     "create_chat_completion"),
    (vllm_retry_after, "vllm.entrypoints.launchers.app", "init_entrypoints_middleware"),
    (vllm_get_load, "vllm.entrypoints.launchers.app", "init_entrypoints_middleware"),
    (vllm_slo_headers, "vllm.entrypoints.launchers.app", "init_entrypoints_middleware"),
    (vllm_config_check, "vllm.engine.arg_utils:EngineArgs", "create_engine_config"),
    (vllm_orca, "vllm.entrypoints.serve.utils.orca_metrics", "get_named_metrics_from_prometheus"),
    (vllm_orca, "vllm.entrypoints.serve.utils.orca_metrics", "create_orca_header"),
], ids=["generate", "child-params", "stream-completion", "stream-chat", "middleware", "get-load",
        "slo-headers", "config-check", "orca-named",
        "orca-header"])
def test_every_patch_applies_to_the_installed_vllm(patch, owner, name):
    import importlib
    assert compat.series(vllm.__version__) in patch.SERIES
    assert kvadmit_patches.problems(patch) == []
    assert patch.apply(check_vllm_config) if patch is vllm_config_check else patch.apply()
    module, _, cls = owner.partition(":")
    target = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
    marks, fn = [], getattr(target, name)
    while fn is not None:                 # several patches may wrap one target
        marks.append(getattr(fn, "__kvadmit_patch__", None))
        fn = getattr(fn, "__wrapped__", None)
    assert any(m and m.startswith(patch.__name__ + ".") for m in marks), marks


def refused_output(refusal: Refusal):
    """vLLM's RequestOutput for a request the engine refused, as the API server gets it."""
    from vllm.outputs import CompletionOutput, RequestOutput
    completion = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                  logprobs=None, finish_reason="abort",
                                  stop_reason=refusal.stop_reason)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[5, 6], prompt_logprobs=None,
                         outputs=[completion], finished=True,
                         kv_transfer_params=refusal.to_params())


def refusals():
    """A refusal of every reason: the retryable ones with each overload status."""
    from kvadmit.protocol import REASONS
    for reason, info in REASONS.items():
        if info.retryable is not False:
            for status in (503, 429):
                yield pytest.param(reason, 2.2, status, id=f"{reason}-{status}")
        if info.retryable is not True:
            yield pytest.param(reason, None, 400, id=f"{reason}-final")


@pytest.mark.parametrize("reason, retry_after_s, status", list(refusals()))
def test_a_refused_output_becomes_vllms_error_response(reason, retry_after_s, status):
    """The refusal in a real RequestOutput, raised as the patch raises it, answered by
    vLLM's own create_error_response: the status, and the message with the hint that
    the Retry-After middleware turns into the header."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    # a final refusal keeps the default overload status (it answers 400 whatever it is)
    refusal = (Refusal(reason, "the limit and its numbers", retry_after_s, status)
               if retry_after_s is not None else
               Refusal(reason, "the limit and its numbers", retry_after_s))
    found = vllm_http_status.refusal_of(refused_output(refusal))
    assert found == refusal
    response = create_error_response(vllm_http_status.error_for(found))
    assert response.error.code == status
    assert response.error.message == refusal.client_message()
    hint = vllm_retry_after.HINT.search(response.model_dump_json().encode())
    assert (hint.group(1) if hint else None) == (b"3" if status != 400 else None)


def test_the_api_servers_middleware_set_up_adds_retry_after():
    """vLLM's own middleware set-up, patched, on a FastAPI app with vLLM's defaults."""
    import importlib

    from fastapi import FastAPI

    import vllm.entrypoints.launchers.app as app_module
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # `vllm serve`'s parser: entrypoints/launchers/cli_args.py in 0.32, common/ since 0.33.
    cli = "launchers" if compat.series(vllm.__version__) == "0.32" else "common"
    make_arg_parser = importlib.import_module(f"vllm.entrypoints.{cli}.cli_args").make_arg_parser

    assert vllm_retry_after.apply()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    app = FastAPI()
    app_module.init_entrypoints_middleware(args, app, ("generate",))
    assert vllm_retry_after.RetryAfterMiddleware in [m.cls for m in app.user_middleware]


def test_a_bad_kvadmit_setting_stops_the_config_build(model_dir):
    """Where vLLM builds its config (the API server, before any engine process)."""
    from vllm.engine.arg_utils import EngineArgs
    assert vllm_config_check.apply(check_vllm_config)
    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                      max_model_len=512, scheduler_cls="kvadmit.vllm.Scheduler",
                      additional_config={"kvadmit": {"policy": "peek"}})
    with pytest.raises(ConfigError, match="policy"):
        args.create_engine_config()


def test_samples_of_a_parallel_request_are_marked():
    """n > 1: each child's sampling parameters carry the marker the scheduler groups by."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from kvadmit.protocol import SAMPLES_KEY
    assert vllm_http_status.apply()
    fields = {f: None for f in EngineCoreRequest.__struct_fields__}
    fields.update(request_id="p", prompt_token_ids=[5, 6], sampling_params=SamplingParams(n=3),
                  arrival_time=0.0, priority=0, data_parallel_rank=None, external_req_id="p")
    parent = ParentRequest(EngineCoreRequest(**{k: v for k, v in fields.items()
                                                if k in EngineCoreRequest.__struct_fields__}))
    params = parent._get_child_sampling_params(1)
    assert params.n == 1 and params.extra_args[SAMPLES_KEY] == "3/p"



@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
def test_orca_header_carries_kvadmits_signals_and_utilization(fmt):
    """vLLM's own create_orca_header, patched: kvadmit's named metrics pass through and
    application_utilization is the admission pressure; vLLM's own metrics stay."""
    import json
    from vllm.entrypoints.serve.utils import orca_metrics as orca
    assert vllm_orca.apply()
    named = [("kv_cache_usage_perc", 0.25), ("kvadmit_kv_headroom_blocks", 12.0),
             ("kvadmit_admission_pressure", 0.75)]
    value = orca.create_orca_header(fmt, named)["endpoint-load-metrics"]
    if fmt == "TEXT":
        assert value.startswith("TEXT ") and "named_metrics.kvadmit_kv_headroom_blocks=12.0" in value
        assert value.endswith("application_utilization=0.75")
        assert "named_metrics.kv_cache_usage_perc=0.25" in value
    else:
        report = json.loads(value[len("JSON "):])
        assert report["application_utilization"] == 0.75
        assert report["named_metrics"]["kvadmit_kv_headroom_blocks"] == 12.0
        assert report["named_metrics"]["kv_cache_usage_perc"] == 0.25
    # Without kvadmit's series (no multiprocess mode) the header is vLLM's own.
    plain = orca.create_orca_header(fmt, [("kv_cache_usage_perc", 0.25)])["endpoint-load-metrics"]
    assert "application_utilization" not in plain


def test_the_plugin_applies_every_patch_and_logs_each_one_that_cannot(monkeypatch, caplog):
    """vLLM loads the plug-in in every process, kvadmit's scheduler or not: it applies
    what it can and logs the rest, naming what is lost (start-up itself stops later,
    where kvadmit is the scheduler: tests/vllm/test_compat.py)."""
    import logging

    from kvadmit.vllm.plugin import register
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        register()
    assert "not applied" not in caplog.text
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        register()
    lines = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    # every patch but Retry-After, which needs the HTTP status patch's refusals
    assert len(lines) == len(compat.PATCHES) - 1, lines
    assert ("kvadmit: patch vllm_http_status not applied, so refused requests answer HTTP 200 "
            "with finish_reason 'abort' (and carry no Retry-After): vLLM 0.35.0 is not a "
            "series it supports (0.32.x, 0.33.x, 0.34.x)") in lines
