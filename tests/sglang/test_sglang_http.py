"""SGLang's OpenAI server answering a kvadmit refusal (kvadmit.sglang.http), on SGLang's
real serving classes and Starlette responses. SGLang cannot serve without CUDA, so
no HTTP server runs here: the hook is driven with the exact responses SGLang's
handlers build for a request its scheduler aborted with kvadmit's finish reason (a
stream whose first event is `create_streaming_error_response(message, status name,
status)`, serving_completions.py / serving_chat.py; the non-streaming path's
`create_error_response(message, str(status), status)` from its HTTPException)."""
import asyncio
import json

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from fastapi.responses import StreamingResponse  # noqa: E402
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion  # noqa: E402

from kvadmit.protocol import Refusal  # noqa: E402
from kvadmit.sglang.request import rejection_finish_reason  # noqa: E402
from kvadmit.sglang.http import around_handle_request, refusal_in_event  # noqa: E402

SERVING = object.__new__(OpenAIServingCompletion)   # its response builders use no state


def stream_of(*chunks):
    async def gen():
        for c in chunks:
            yield c
    return StreamingResponse(gen(), media_type="text/event-stream")


def aborted_stream(refusal: Refusal) -> StreamingResponse:
    """What SGLang's stream generator yields for the abort kvadmit sends."""
    reason = rejection_finish_reason(refusal)
    code = reason["status_code"]
    error = SERVING.create_streaming_error_response(reason["message"], code.name, code.value)
    return stream_of(f"data: {error}\n\n", "data: [DONE]\n\n")


def non_streaming(refusal: Refusal):
    """What SGLang's handle_request answers without streaming (its HTTPException or
    ValueError path)."""
    reason = rejection_finish_reason(refusal)
    status = int(reason["status_code"])
    if status == 400:
        return SERVING.create_error_response(reason["message"], "BadRequest", 400)
    return SERVING.create_error_response(reason["message"], str(status), status)


def hooked(response):
    """The hook's answer, and a stream's events read in the same event loop."""
    async def original(self, *args, **kwargs):
        return response

    async def run():
        answer = await around_handle_request(original, SERVING, "request", "raw")
        if isinstance(answer, StreamingResponse):
            return answer, [c async for c in answer.body_iterator]
        return answer, None
    return asyncio.run(run())


@pytest.mark.parametrize("refusal, status", [
    (Refusal("queue_full", "queue full: 3 waiting", 2.2, 503), 503),
    (Refusal("slo_infeasible", "predicted TTFT 9 s over 1 s", 4.0), 429),   # the default
    (Refusal("context_length", "prompt 900 + max_tokens 200 over 1024", None), 400),
])
def test_a_refused_stream_is_the_non_streaming_error_with_retry_after(refusal, status):
    (streamed, _), (plain, _) = hooked(aborted_stream(refusal)), hooked(non_streaming(refusal))
    for response in (streamed, plain):
        assert response.status_code == status and not isinstance(response, StreamingResponse)
        body = json.loads(response.body)
        assert body["message"] == refusal.client_message()
        assert response.headers.get("retry-after") == (
            str(refusal.retry_after) if refusal.retryable else None)
        # the hint as a number in the body too, for a client behind a router that drops headers
        assert body.get("retry_after_s") == (refusal.retry_after if refusal.retryable else None)
        assert response.headers["content-length"] == str(len(response.body))
    assert streamed.body == plain.body


def test_an_admitted_stream_passes_unchanged():
    chunks = ['data: {"choices": [{"text": "a"}]}\n\n', 'data: {"choices": [{"text": "b"}]}\n\n',
              "data: [DONE]\n\n"]
    response, events = hooked(stream_of(*chunks))
    assert isinstance(response, StreamingResponse) and events == chunks


def test_other_errors_are_left_to_sglang():
    other = SERVING.create_streaming_error_response("Generation aborted.", "INTERNAL_SERVER_ERROR", 500)
    response, events = hooked(stream_of(f"data: {other}\n\n", "data: [DONE]\n\n"))
    assert isinstance(response, StreamingResponse) and len(events) == 2
    assert refusal_in_event(f"data: {other}\n\n") is None
    plain, _ = hooked(SERVING.create_error_response("The engine is busy (retry after 3 s)", "503", 503))
    assert "retry-after" not in plain.headers


def test_the_hook_is_left_out_where_the_openai_server_does_not_import(monkeypatch):
    """A process without the server's dependencies (here: the module made unimportable)
    keeps the flag's hooks and starts; the HTTP hook is there where the server imports."""
    import sys

    from kvadmit.sglang import http, plugin
    assert http.T_HANDLE_REQUEST in plugin.cli_hooks()
    monkeypatch.setitem(sys.modules, http.SERVING_MODULE, None)
    hooks = plugin.cli_hooks()
    assert http.T_HANDLE_REQUEST not in hooks and len(hooks) == 2
