"""When kvadmit's own code raises inside vLLM's engine: it fails open or closed, as the
config's ``on_internal_error`` says (docs/trust-and-failure.md, "When kvadmit itself
fails"). Either way the engine process lives on and its running requests finish under
vLLM's own scheduling; kvadmit's core is not called again.

- open (the default): every request kvadmit held goes to vLLM's own waiting queue, and
  vLLM schedules alone from then on, refusing nothing;
- closed: every request kvadmit held that had not started (waiting, or a sample of an
  ``n > 1`` request waiting for its siblings) is refused with ``kvadmit:failed_closed``
  (503, `kvadmit.protocol.failed_closed`), and so is every new arrival, until the
  engine restarts. A preempted request has started (its client may hold tokens): it
  goes back to vLLM's queue and finishes, as a running one does.

The scheduler mixin (kvadmit.vllm.scheduler) calls `record` from every except block
(through `VllmAdmission.fail`) and `refuse_held` when it hands the queue back, outside
vLLM's schedule(): before the next step, or in the same step's update_from_output, so
a held request's refusal goes out within one step of the error.
"""
from __future__ import annotations

import logging
import multiprocessing

from kvadmit.protocol import FAILED_CLOSED, failed_closed
from kvadmit.vllm import compat

RequestStatus = compat.import_names(compat.SCHEDULER_IMPORTS).RequestStatus

logger = logging.getLogger("kvadmit.vllm")


def record(admission, where: str) -> None:
    """One internal error (call it from the except block): counted; the first is logged
    with its traceback, and under ``closed`` raises the `kvadmit_failed_closed` gauge."""
    admission.internal_errors += 1
    closed = admission.failed_closed
    metrics = admission.metrics
    if metrics is not None:
        metrics.internal_errors.inc()
        if closed:
            metrics.failed_closed.set(1)
    if admission.internal_errors > 1:
        return
    # the process names the engine core: vLLM's launcher calls a data-parallel rank's
    # "EngineCore_DP<rank>", and kvadmit's log lines lack vLLM's own prefix
    engine = multiprocessing.current_process().name
    if closed:
        logger.exception("kvadmit: internal error %s in %s; failing closed (on_internal_error: "
                         "closed): every waiting request kvadmit held and every new one is "
                         "refused (503 kvadmit:%s) until the engine is restarted; running "
                         "requests finish under vLLM's own scheduling", where, engine,
                         FAILED_CLOSED)
    else:
        logger.exception("kvadmit: internal error %s in %s; failing open: vLLM's own "
                         "scheduling from now on, every request kvadmit held handed to it",
                         where, engine)


def never_started(request) -> bool:
    """A waiting request that never ran: no token computed or generated, not preempted."""
    return (request.status != RequestStatus.PREEMPTED and request.num_output_tokens == 0
            and request.num_computed_tokens == 0)


def refuse(admission, request, log: bool = True) -> None:
    """Finishes ``request`` (not, or no longer, in the scheduler) with the failed_closed
    refusal, counted as `kvadmit_rejected_total{reason="failed_closed"}`."""
    admission.refuse(request, failed_closed(), log=log)
    if admission.metrics is not None:
        admission.metrics.rejected.labels(FAILED_CLOSED).inc()


def refuse_held(sched, held: list, samples: list) -> None:
    """Failed closed, as the queue goes back to vLLM (outside its schedule()): ``held``
    (the requests of kvadmit's waiting queue, now in vLLM's) that never started leave
    the scheduler refused; so do ``samples`` (never in it). The others stay queued."""
    admission = sched.kvadmit
    refused = [r for r in held if never_started(r)]
    if refused:
        sched.finish_requests([r.request_id for r in refused], RequestStatus.FINISHED_ABORTED)
    for r in refused + samples:
        refuse(admission, r, log=False)
    if refused or samples:
        logger.warning("kvadmit failed closed: refused %d waiting request(s) and %d sample(s) "
                       "waiting for their siblings (503 kvadmit:%s); %d preempted request(s) "
                       "stay queued", len(refused), len(samples), FAILED_CLOSED,
                       len(held) - len(refused))
