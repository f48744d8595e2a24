"""SGLang plugin entry point: ``register()`` and the hooks it installs.

SGLang (0.5.23) calls ``load_plugins()`` once per process, in the launcher and
first thing in every scheduler subprocess (processes are spawned, so each
rank installs its own hooks). ``load_plugins()`` runs each plugin's
``register()``, then ``HookRegistry.apply_hooks()``; it catches and only logs
an ``Exception`` from a plugin, and only logs a hook target that does not
resolve. kvadmit must not run half-installed, so ``register()`` applies its
hooks itself, checks that every one is in place, and raises
`KvadmitStartupError` (a ``SystemExit``, which ``load_plugins`` does not
swallow) when one is missing or the configuration is bad.

Without a configuration (no ``KVADMIT_CONFIG``, no ``--kvadmit-config``)
``register()`` installs only the command-line hooks, which add the
``--kvadmit-config`` flag and do nothing unless it is given, and the HTTP
server's hooks (`kvadmit.sglang.http`, which acts only on kvadmit's messages;
`kvadmit.sglang.health`, which acts only with a configuration): SGLang behaves
exactly as without kvadmit.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import pkgutil
from typing import Callable, Optional

from kvadmit import ConfigError, __version__ as KVADMIT_VERSION
from kvadmit.protocol import failed_closed
from kvadmit.sglang import adapter as _adapter
from kvadmit.sglang import health as _health
from kvadmit.sglang import http as _http
from kvadmit.sglang import request as _request
from kvadmit.sglang import settings as _settings
from kvadmit.sglang import trust as _trust

logger = logging.getLogger("kvadmit.sglang")

SUPPORTED_SGLANG = "0.5.23"
CLI_FLAG = "--kvadmit-config"

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_ARGS = "sglang.srt.server_args.ServerArgs"
T_ADD_CLI_ARGS = f"{_ARGS}.add_cli_args"
T_FROM_CLI_ARGS = f"{_ARGS}.from_cli_args"
T_SCHED_INIT = f"{_SCHED}.__init__"
T_ADDER_CLASS = f"{_SCHED}.get_prefill_adder_class"
T_QUEUE_LIMIT = f"{_SCHED}._abort_on_queued_limit"
T_STEP = f"{_SCHED}.get_next_batch_to_run"
T_POLL_LOCAL = f"{_SCHED}._poll_timeout_aborts"
T_PROCESS_INPUT = f"{_SCHED}.process_input_requests"
T_INTERNAL_STATE = f"{_SCHED}.get_internal_state"
T_RETRACT_ORDER = "sglang.srt.managers.schedule_batch.ScheduleBatch._get_decode_retraction_order"

# Module-level names the hooks call (not hooked, but required to exist).
REQUIRED_NAMES = (
    "sglang.srt.managers.scheduler._make_abort_req",
    "sglang.srt.managers.schedule_batch.FINISH_ABORT",
    "sglang.srt.managers.schedule_policy.PrefillAdder",
    "sglang.srt.managers.schedule_policy.AddReqResult",
    "sglang.srt.mem_cache.prefill_budget.PrefillBudget",
)


class KvadmitStartupError(SystemExit):
    """kvadmit cannot start as configured (bad configuration, or a hook target
    missing from the installed SGLang).

    It derives from ``SystemExit`` on purpose: SGLang's ``load_plugins()``
    catches ``Exception`` from a plugin's ``register()`` and carries on, which
    would leave a server running without the admission control it was asked
    for. ``SystemExit`` stops the launcher (exit status 1, this message on
    stderr) and a scheduler subprocess (the launcher then reports the dead
    scheduler)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# ----------------------------------------------------------------------
# Command line: --kvadmit-config on ServerArgs' parser
def _parse_flag(text: str) -> str:
    try:
        _settings.load_config(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def after_add_cli_args(result, parser, *args, **kwargs):
    """AFTER ServerArgs.add_cli_args: adds --kvadmit-config (validated by argparse)."""
    if any(CLI_FLAG in action.option_strings for action in parser._actions):
        return result
    parser.add_argument(
        CLI_FLAG, type=_parse_flag, default=None, metavar="JSON",
        help="kvadmit admission control (KV-cache admission, retraction victims, "
             "queue caps), as a JSON object of kvadmit's keys, e.g. "
             "'{\"policy\": \"peak\"}'. Sets KVADMIT_CONFIG for the scheduler "
             "processes. Off when not given.")
    return result


def after_from_cli_args(result, cls, args, *rest, **kwargs):
    """AFTER ServerArgs.from_cli_args: hands --kvadmit-config to the scheduler
    processes through KVADMIT_CONFIG (ServerArgs has no field for it)."""
    text = getattr(args, "kvadmit_config", None)
    if text is None:
        if _settings.config_text_from_env() is not None:       # KVADMIT_CONFIG alone
            _trust.check_server(result)
        return result
    previous = os.environ.get(_settings.ENV_VAR)
    if previous is not None and previous != text:
        logger.warning("kvadmit: %s overrides %s from the environment", CLI_FLAG,
                       _settings.ENV_VAR)
    os.environ[_settings.ENV_VAR] = text
    _trust.check_server(result)
    install_engine_hooks()
    return result


# ----------------------------------------------------------------------
# Scheduler hooks (installed only with a configuration)
def around_scheduler_init(original, self, *args, **kwargs):
    """AROUND Scheduler.__init__: builds the adapter once SGLang's pools exist.
    A bad configuration or an unsupported server raises here, which stops
    start-up (the scheduler process reports it and signals the launcher)."""
    original(self, *args, **kwargs)
    text = _settings.config_text_from_env()
    if text is None:
        self._kvadmit = None
        return
    config = _settings.load_config(text)  # ConfigError names the field
    self._kvadmit = _adapter.SGLangAdmission.for_scheduler(
        self, config, _settings.explicit_keys(text))


def _live(scheduler):
    """The scheduler's kvadmit adapter, None without one or once it failed open."""
    adapter = getattr(scheduler, "_kvadmit", None)
    return None if adapter is None or adapter.failed else adapter


def around_get_prefill_adder_class(original, self, *args, **kwargs):
    """AROUND Scheduler.get_prefill_adder_class: the kvadmit PrefillAdder, with
    the waiting queue put in the core's order first (the admission loop that
    follows iterates it)."""
    adapter = _live(self)
    if adapter is None:
        return original(self, *args, **kwargs)
    try:
        adapter.order_waiting(self.waiting_queue)
    except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
        adapter.fail("ordering the waiting queue")
        return original(self, *args, **kwargs)
    return adapter.adder_class


def around_abort_on_queued_limit(original, self, recv_req, *args, **kwargs):
    """AROUND Scheduler._abort_on_queued_limit: the request's kvadmit fields
    (custom_params["kvadmit"]; a malformed one refuses it), the core's caps,
    SLO feasibility and priority shedding first, then SGLang's own
    --max-queued-requests. Returns True when the incoming request is aborted,
    as the original does."""
    if _closed(self) and not recv_req.output_ids:   # new: refused (a retracted one goes on)
        refuse_failed_closed(self, recv_req)
        return True
    adapter = _live(self)
    if adapter is None:
        return original(self, recv_req, *args, **kwargs)
    try:
        outcome = adapter.on_enqueue(recv_req)
    except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
        adapter.fail("on a request's arrival")
        if adapter.failed_closed:
            close_waiting(self)
            if not recv_req.output_ids:
                refuse_failed_closed(self, recv_req)
                return True
        return original(self, recv_req, *args, **kwargs)
    drop_waiting(self, outcome.shed)
    if outcome.rejection is not None:
        send_rejection(self, recv_req, outcome.rejection)
        return True
    aborted = original(self, recv_req, *args, **kwargs)
    if aborted:
        adapter.forget(recv_req)
    return aborted


def drop_waiting(scheduler, dropped) -> None:
    """Waiting requests the core dropped, [(Req, Refusal)] (shed for an arrival, or
    past their TTL): out of SGLang's queue, released, their clients answered."""
    for victim, rejection in dropped:
        for i, queued in enumerate(scheduler.waiting_queue):
            if queued is victim:
                scheduler.waiting_queue.pop(i)
                break
        scheduler._release_aborted_request(victim)
        coordinator = getattr(scheduler, "beam_coordinator", None)
        if coordinator is not None:
            coordinator.retire_group(victim)
        send_rejection(scheduler, victim, rejection)


def _closed(scheduler) -> bool:
    adapter = getattr(scheduler, "_kvadmit", None)
    return adapter is not None and adapter.failed_closed


def close_waiting(scheduler) -> None:
    """kvadmit failed closed: every request in SGLang's waiting queue that never started
    (no output yet; a retracted one has started and stays) leaves it refused with
    kvadmit:failed_closed (503). Called outside SGLang's admission loop."""
    held = [r for r in scheduler.waiting_queue if not r.output_ids and not r.finished()]
    if held:
        refusal = failed_closed()
        drop_waiting(scheduler, [(r, refusal) for r in held])
        _count_failed_closed(scheduler, len(held))
        logger.warning("kvadmit failed closed: refused %d waiting request(s) (503 "
                       "kvadmit:%s)", len(held), refusal.reason)


def refuse_failed_closed(scheduler, req) -> None:
    send_rejection(scheduler, req, failed_closed())
    _count_failed_closed(scheduler, 1)


def _count_failed_closed(scheduler, n: int) -> None:
    exporter = getattr(getattr(scheduler, "_kvadmit", None), "exporter", None)
    if exporter is not None:
        exporter.count_failed_closed(n)


def send_rejection(scheduler, req, rejection) -> None:
    """SGLang's usual abort output for ``req``, carrying kvadmit's reason."""
    from sglang.srt.managers.scheduler import _make_abort_req

    reason = _request.rejection_finish_reason(rejection)
    scheduler.send_abort_output(_make_abort_req(req, finished_reason=reason), req)
    req.time_stats.trace_ctx.abort(abort_info={"reason": reason["message"]})


def around_get_next_batch_to_run(original, self, *args, **kwargs):
    """AROUND Scheduler.get_next_batch_to_run (once per scheduler step), the step
    sequence every engine runs (the core's `AdmissionCore.step` / `step_done`, through
    kvadmit.port.CorePort.step): the ledger is
    brought up to date with SGLang's batches, then the step's report (its time,
    the KV pool in use) goes to the port; after SGLang has chosen the batch (and
    its retractions) the port notes what it runs and steps the core, at the
    step's time."""
    if _closed(self):
        close_waiting(self)
    adapter = _live(self)
    if adapter is None:
        return original(self, *args, **kwargs)
    try:
        now = adapter.start_step()
        bound = _bind(original, self, args, kwargs)
        adapter.begin_step(bound.get("running_batch"), bound.get("last_batch"),
                           getattr(self, "chunked_req", None), self.waiting_queue, now=now)
        step_plan = adapter.step(self.token_to_kv_pool_allocator.available_size()
                                 + self.tree_cache.evictable_size(), now)
    except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
        adapter.fail("before a step")
        if adapter.failed_closed:
            close_waiting(self)
        return original(self, *args, **kwargs)
    drop_waiting(self, step_plan.dropped)          # stale work: before SGLang admits
    plan = original(self, *args, **kwargs)
    if not adapter.failed:                         # it may fail inside SGLang's step
        try:
            adapter.end_step(now, batch=getattr(plan, "batch_to_run", None))
        except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
            adapter.fail("after a step")
    if adapter.failed_closed:                      # failed in this step: refused in it
        close_waiting(self)
    return plan


def after_poll_timeout_aborts(result, self, *args, **kwargs):
    """AFTER Scheduler._poll_timeout_aborts (rank 0 of a waiting queue, once per
    iteration): when every rank must use rank 0's clock, a `ClockTick` joins the
    aborts SGLang broadcasts to the queue's ranks."""
    adapter = _live(self)
    tick = adapter.make_tick() if adapter is not None else None
    if tick is None:
        return result
    return [*(result or ()), tick]


def around_process_input_requests(original, self, recv_reqs, *args, **kwargs):
    """AROUND Scheduler.process_input_requests (every rank): clock ticks are
    taken out (and applied first, so this iteration's arrivals see them)
    before SGLang dispatches the requests. The caller's list is left as is
    (pipeline stages relay it onward)."""
    if not recv_reqs or not any(isinstance(r, _adapter.ClockTick) for r in recv_reqs):
        return original(self, recv_reqs, *args, **kwargs)
    adapter = _live(self)
    rest = []
    for r in recv_reqs:
        if isinstance(r, _adapter.ClockTick):
            if adapter is not None:
                adapter.on_tick(r)
        else:
            rest.append(r)
    return original(self, rest, *args, **kwargs)


def around_retraction_order(original, reqs, *args, **kwargs):
    """AROUND ScheduleBatch._get_decode_retraction_order (static): the core's
    victim order, victims last (retract_decode pops from the end)."""
    adapter = _adapter.adapter_for_reqs(reqs)
    if adapter is None:
        return original(reqs, *args, **kwargs)
    try:
        return adapter.retraction_order(list(reqs))
    except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
        adapter.fail("ordering retraction victims")
        return original(reqs, *args, **kwargs)


def after_get_internal_state(result, self, *args, **kwargs):
    """AFTER Scheduler.get_internal_state: adds ``kvadmit`` (core.stats()) to
    what ``GET /server_info`` reports per rank."""
    adapter = getattr(self, "_kvadmit", None)
    state = getattr(result, "internal_state", None)
    if adapter is not None and isinstance(state, dict):
        failed = "failed_closed" if adapter.failed_closed else "failed_open"
        state["kvadmit"] = ({failed: True, "internal_errors": adapter.internal_errors}
                            if adapter.failed else adapter.stats())
    return result


def _bind(fn, self, args, kwargs) -> dict:
    try:
        return inspect.signature(fn).bind(self, *args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)


# ----------------------------------------------------------------------
# Registration and verification
def _hook_types():
    from sglang.srt.plugins.hook_registry import HookType

    return HookType


def cli_hooks() -> dict:
    """The hooks of every process: the flag, and the HTTP server's answer to a
    kvadmit refusal (kvadmit.sglang.http; it acts only on kvadmit's messages)."""
    H = _hook_types()
    return {T_ADD_CLI_ARGS: (after_add_cli_args, H.AFTER),
            T_FROM_CLI_ARGS: (after_from_cli_args, H.AFTER), **http_hooks()}


def http_hooks() -> dict:
    """The HTTP server's hooks (its answer to a refusal; who may raise a claim,
    kvadmit.sglang.trust; kvadmit's failed states on /health and /v1/loads,
    kvadmit.sglang.health), where SGLang's OpenAI server imports: in a process without its
    dependencies (torchvision, say) no OpenAI server can run, and there is nothing to
    hook."""
    try:
        importlib.import_module(_http.SERVING_MODULE)
    except ImportError as e:
        logger.info("kvadmit: SGLang's OpenAI server does not import in this process (%s); "
                    "its refusal hook is not installed here", e)
        return {}
    H = _hook_types()
    return {_http.T_HANDLE_REQUEST: (_http.around_handle_request, H.AROUND),
            _trust.T_GENERATE: (_trust.before_generate_request, H.BEFORE),
            _health.T_BUILD_STACK: (_health.after_build_middleware_stack, H.AFTER)}


def engine_hooks() -> dict:
    H = _hook_types()
    return {
        T_SCHED_INIT: (around_scheduler_init, H.AROUND),
        T_ADDER_CLASS: (around_get_prefill_adder_class, H.AROUND),
        T_QUEUE_LIMIT: (around_abort_on_queued_limit, H.AROUND),
        T_STEP: (around_get_next_batch_to_run, H.AROUND),
        T_POLL_LOCAL: (after_poll_timeout_aborts, H.AFTER),
        T_PROCESS_INPUT: (around_process_input_requests, H.AROUND),
        T_RETRACT_ORDER: (around_retraction_order, H.AROUND),
        T_INTERNAL_STATE: (after_get_internal_state, H.AFTER),
    }


def _registered(target: str, hook: Callable) -> bool:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ()))


def _register_all(hooks: dict) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, (hook, kind) in hooks.items():
        if not _registered(target, hook):
            HookRegistry.register(target, hook, kind)


def installed(target: str, hook: Callable) -> Optional[str]:
    """None when ``hook`` wraps ``target`` now; else why not."""
    obj_path, _, attr = target.rpartition(".")
    try:
        obj = pkgutil.resolve_name(obj_path)
    except Exception as e:  # ImportError, AttributeError, ...
        return f"cannot import {obj_path} ({type(e).__name__}: {e})"
    raw = obj.__dict__.get(attr) if isinstance(obj, type) else None
    if raw is None:
        raw = getattr(obj, attr, None)
    if raw is None:
        return f"{obj_path} has no attribute {attr!r}"
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    seen = 0
    while fn is not None and seen < 64:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return None
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return "the target exists but kvadmit's hook is not applied to it"


def verify(hooks: dict) -> None:
    """Raises KvadmitStartupError naming every hook target that is not in place."""
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    problems = []
    for target, (hook, _) in hooks.items():
        why = installed(target, hook)
        if why is not None:
            problems.append(f"{target}: {why}")
    for name in REQUIRED_NAMES:
        try:
            pkgutil.resolve_name(name)
        except Exception as e:
            problems.append(f"{name}: cannot resolve ({type(e).__name__}: {e})")
    if problems:
        raise KvadmitStartupError(
            f"kvadmit {KVADMIT_VERSION} could not install its SGLang hooks "
            f"(installed SGLang {version}; kvadmit supports SGLang {SUPPORTED_SGLANG}):\n  "
            + "\n  ".join(problems))


def _apply_and_verify(hooks: dict) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    _register_all(hooks)
    HookRegistry.apply_hooks()  # idempotent: patched targets are skipped
    verify(hooks)


def install_engine_hooks() -> None:
    """Registers, applies and checks the scheduler hooks in this process."""
    _apply_and_verify(engine_hooks())


def register() -> None:
    """SGLang entry point (group ``sglang.srt.plugins``, name ``kvadmit``)."""
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version != SUPPORTED_SGLANG:
        logger.warning("kvadmit supports SGLang %s; found %s (the hook check decides)",
                       SUPPORTED_SGLANG, version)
    try:
        text = _settings.config_text_from_env()
        _settings.load_config(text)
    except ConfigError as e:
        raise KvadmitStartupError(f"{_settings.ENV_VAR}: {e}") from None
    hooks = cli_hooks()
    if text is not None:
        hooks.update(engine_hooks())
    _apply_and_verify(hooks)
