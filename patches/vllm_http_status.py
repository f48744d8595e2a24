"""vLLM 0.32, 0.33 and 0.34: a kvadmit refusal becomes an HTTP error before the response starts.

The engine's scheduler (kvadmit.vllm) refuses a request by finishing it with
finish_reason "abort", stop_reason "kvadmit:<reason>" and the refusal (message,
Retry-After hint) in the output's kv_transfer_params. Through `vllm serve` that
would be a 200 response with finish_reason "abort". This patch wraps
`AsyncLLM.generate` so that such an output raises a `GracefulHTTPError` instead,
which vLLM's OpenAI server turns into an error response with the status, message
and Retry-After that `kvadmit.protocol` defines for both engines (the configured
`overload_status`, 429 by default or 503, with Retry-After when retrying can help,
400 otherwise). A parallel-sampling request (n > 1) is one unit: any refused sample
refuses the request (the engine refuses all of its samples together).

A streaming response would have started (HTTP 200) before the engine's first
output, so a refusal could only be an error event inside the stream. The patch
therefore also wraps the completion and chat-completion handlers: for a streaming
request the handler waits for the stream's first event before it returns (and
vLLM's route starts the response). A kvadmit refusal always comes as a request's
first output (it is refused on arrival or while it waits, before any token), so
a refused stream is answered as the same request without streaming is: the same
status, body and Retry-After. An admitted stream is unchanged; its headers go out
with its first event instead of before it, which is when a streaming client sees
its first token anyway. A refusal that ever came later still reaches the client
as vLLM's error event, and the server logs it as one line (vLLM logs any other
error in a stream with its traceback). `KVADMIT_STREAM_REFUSAL=event` in the API
server's environment keeps the earlier behaviour (headers at once, a refusal as an
error event in a 200 stream), for clients that need the headers before the queue
wait ends.

It also marks the samples of a parallel-sampling request for the engine: vLLM
fans one request out into n engine requests ("<i>_<parent id>") that each say
n = 1, so the child's sampling parameters get `kvadmit.protocol.SAMPLES_KEY`
("<n>/<parent id>") in extra_args, from which the scheduler groups them.

Applied in every vLLM process by the `vllm.general_plugins` entry point
`kvadmit` (kvadmit.vllm.plugin); outputs without a kvadmit stop_reason pass
through untouched, so it changes nothing unless kvadmit refused the request.
"""
from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import os

from kvadmit.protocol import Refusal
from kvadmit_patches import Target, require, wrap

TARGET = "vllm.v1.engine.async_llm.AsyncLLM.generate"
# The handlers whose streams start only once their first event is known.
STREAM_HANDLERS = (
    ("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion", "create_completion"),
    ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
     "create_chat_completion"),
)
# The same wrappers on each. Against 0.32.0, 0.33.0's AsyncLLM.generate also handles
# GenerationError and, on an error raised inside it, aborts the n > 1 siblings; a
# refusal raised here, after it yields, does not reach that handler (the engine refuses
# all samples of such a request together). 0.34.0 adds a pre-rendered SSE path to the
# completion handler that yields only inside its output loop, so a stream's first event
# still comes with the engine's first output. ParentRequest._get_child_sampling_params,
# vLLM's GracefulHTTPError and its mapping to a response (create_error_response) and
# the serving loggers below are unchanged.
SERIES = ("0.32", "0.33", "0.34")
TARGETS = (
    Target("vllm.v1.engine.async_llm:AsyncLLM.generate", ("self",), async_gen=True),
    Target("vllm.v1.engine.parallel_sampling:ParentRequest._get_child_sampling_params",
           ("self", "index")),
    Target("vllm.exceptions:GracefulHTTPError", ("message", "http_status")),
    *(Target(f"{module}:{cls}.{method}", ("self", "request")) for module, cls, method in
      STREAM_HANDLERS),
    *(Target(f"{module}:{cls}.create_error_response") for module, cls, _ in STREAM_HANDLERS),
)
# "status" (the default): a refused stream is an HTTP error; "event": vLLM's error event.
STREAM_REFUSAL_ENV = "KVADMIT_STREAM_REFUSAL"
# vLLM's loggers that log an error inside a response stream with its traceback.
STREAM_LOGGERS = ("vllm.entrypoints.openai.completion.serving",
                  "vllm.entrypoints.openai.chat_completion.serving")


def refusal_of(output) -> Refusal | None:
    """The kvadmit refusal among a RequestOutput's completions, or None."""
    for completion in getattr(output, "outputs", None) or ():
        if completion.finish_reason == "abort":
            refusal = Refusal.from_output(completion.stop_reason,
                                          getattr(output, "kv_transfer_params", None))
            if refusal is not None:
                return refusal
    return None


_ERROR_CLASS = None


def error_for(refusal: Refusal):
    """The exception vLLM's server answers with the refusal's status and message
    (patches/vllm_retry_after.py turns the message's hint into Retry-After)."""
    global _ERROR_CLASS
    if _ERROR_CLASS is None:
        from vllm.exceptions import GracefulHTTPError

        class KvadmitRefusalError(GracefulHTTPError):
            """A kvadmit refusal on its way to the client."""

            def __init__(self, refusal: Refusal):
                super().__init__(refusal.client_message(), refusal.status)
                self.refusal = refusal

        _ERROR_CLASS = KvadmitRefusalError
    return _ERROR_CLASS(refusal)


class OneLineRefusals(logging.Filter):
    """Logs a kvadmit refusal raised inside a response stream as one line (an
    expected answer under overload, not a server error) instead of a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        refusal = getattr(exc, "refusal", None)
        if isinstance(refusal, Refusal):
            record.msg, record.args = "%s", (refusal.log_line("a streaming request"),)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_ONE_LINE = OneLineRefusals()

# The refusals `generate` raised while a handler primes its stream: a list shared by
# reference, so the tasks vLLM starts for a multi-prompt request (each a copy of the
# handler's context) append to the handler's own list.
_REFUSED: contextvars.ContextVar[list] = contextvars.ContextVar("kvadmit_refused")


async def _chain(first, rest):
    """The stream again: its primed first event, then the others."""
    yield first
    async for event in rest:
        yield event


async def first_event_or_refusal(stream):
    """Waits for a handler's stream's first event. Returns (the stream again, None),
    or (None, the refusal) when kvadmit refused the request. The stream is closed,
    which aborts the request in vLLM, on a refusal and when the wait is cancelled (the
    client went away while its request waited)."""
    refused: list = []
    token = _REFUSED.set(refused)
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return stream, None                     # nothing to send: an empty stream
    except BaseException:
        await stream.aclose()
        raise
    finally:
        _REFUSED.reset(token)
    if refused:
        await stream.aclose()
        return None, refused[0]
    return _chain(first, stream), None


def apply() -> bool:
    """Installs the wrappers once; PatchUnavailable (nothing done) where it cannot
    apply."""
    require(__name__)
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from kvadmit.protocol import samples_marker

    def make_generate(original):
        async def generate(self, *args, **kwargs):
            async for output in original(self, *args, **kwargs):
                refusal = refusal_of(output)
                if refusal is not None:
                    refused = _REFUSED.get(None)
                    if refused is not None:
                        refused.append(refusal)
                    raise error_for(refusal)
                yield output
        return generate

    def make_handler(original):
        async def handler(self, request, *args, **kwargs):
            result = await original(self, request, *args, **kwargs)
            if not inspect.isasyncgen(result):
                return result                       # a response or an error: unchanged
            stream, refusal = await first_event_or_refusal(result)
            if refusal is not None:
                return self.create_error_response(error_for(refusal))
            return stream
        return handler

    def make_child_params(original):
        def _get_child_sampling_params(self, index):
            params = original(self, index)
            if self.n > 1:
                extra = dict(params.extra_args or {})
                extra.update(samples_marker(self.n, self.request_id))
                params.extra_args = extra
            return params
        return _get_child_sampling_params

    wrap(AsyncLLM, "generate", make_generate)
    mode = os.environ.get(STREAM_REFUSAL_ENV, "status")
    if mode not in ("status", "event"):
        raise ValueError(f"{STREAM_REFUSAL_ENV}={mode!r}: must be status or event")
    if mode == "status":
        for module_name, class_name, method in STREAM_HANDLERS:
            wrap(getattr(importlib.import_module(module_name), class_name), method, make_handler)
    wrap(ParentRequest, "_get_child_sampling_params", make_child_params)
    for name in STREAM_LOGGERS:
        logger = logging.getLogger(name)
        if _ONE_LINE not in logger.filters:
            logger.addFilter(_ONE_LINE)
    return True
