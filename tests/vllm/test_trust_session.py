"""vLLM's own session id (`session_id`, X-Session-ID) is kvadmit's session only for a
trusted request: the API server marks a screened request (kvadmit.trust.UNTRUSTED_KEY
in vllm_xargs, patches/vllm_slo_headers.py), and the adapter then leaves vLLM's
session id out of its arrival record (a kvadmit session field is judged on its own by
the API server). On vLLM's real scheduler in-process, with the agent window on."""
from kvadmit.request_fields import session_int
from kvadmit.trust import UNTRUSTED_KEY
from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine


def test_an_untrusted_requests_vllm_session_id_is_not_its_kvadmit_session(model_dir):
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                          additional_config={"kvadmit": {"agent_window": True}})
    core = eng.scheduler.kvadmit.port.core
    eng.add([4] * 40, 4, session_id="A", extra_args={UNTRUSTED_KEY: True})
    eng.add([5] * 40, 4, session_id="B", extra_args={UNTRUSTED_KEY: True, "kvadmit_session": "C"})
    eng.step()
    assert not core.session_active(session_int("A")) and not core.session_active(session_int("B"))
    assert core.session_active(session_int("C"))
    eng.add([3] * 40, 4, session_id="A")
    eng.step()
    assert core.session_active(session_int("A"))
    log = eng.run()
    assert len(log.finished) == 3
