"""Sheddable traffic (GIE's negative priority): served after every other request,
the first to give KV back, dropped (reason shed) while a request that is not
sheddable waits for KV, and never the cause of another request's eviction."""
import pytest

from helpers import make_core
from kvadmit import ArrivalRecord, Requests
from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit.protocol import Refusal


def arrive(core, now, prompt=8, max_new=4, **kw):
    res = core.arrive(ArrivalRecord(prompt, max_new, **kw), now=now)
    assert res.accepted, res.rejection
    return res


def start(core, slot, now=0.0):
    core.admit(slot, now)
    return slot


def test_sheddable_requests_wait_behind_every_other_in_every_queue_order():
    for order in ("fcfs", "priority", "deadline"):
        core = make_core("reserve", num_blocks=100, queue_order=order)
        batch = arrive(core, 0.0, sheddable=True, priority=-5).slot
        late = arrive(core, 1.0, priority=7).slot
        assert core.waiting() == [late, batch], order
        assert core.next_admissible(100) == late


def test_while_another_request_waits_for_kv_sheddable_work_is_dropped_and_refused():
    core = make_core("reserve", num_blocks=10, block_size=4)
    start(core, arrive(core, 0.0, prompt=20, max_new=20).slot)       # 10 blocks: the pool
    batch = arrive(core, 0.1, sheddable=True).slot
    assert core.next_admissible(0) == -1                             # protected held? none yet
    assert core.drop_waiting(0.2) == []                              # only sheddable waits
    chat = arrive(core, 0.3).slot
    assert core.next_admissible(0) == -1                             # chat held: saturated
    [(slot, rej)] = core.drop_waiting(0.4)
    assert slot == batch and rej.reason == "shed" and rej.limit == "sheddable"
    assert "sheddable: dropped from the queue while requests that are not sheddable wait" \
        in rej.message
    refusal = Refusal.of(rej)
    assert refusal.retryable and refusal.retry_after_s > 0
    late = core.arrive(ArrivalRecord(8, 4, sheddable=True), now=0.5)
    assert not late.accepted and late.rejection.reason == "shed"
    assert late.rejection.message.startswith("sheddable: refused while")
    assert core.waiting() == [chat] and core.state(batch) == "free"
    assert core.stats()["rejected"]["shed"] == 2


def test_the_saturation_ends_when_no_other_request_waits():
    core = make_core("reserve", num_blocks=10, block_size=4)
    big = start(core, arrive(core, 0.0, prompt=20, max_new=20).slot)
    chat = arrive(core, 0.1).slot
    assert core.next_admissible(0) == -1
    core.finish(big, 1.0)
    assert core.next_admissible(10) == chat
    start(core, chat, 1.0)
    assert arrive(core, 1.1, sheddable=True).accepted     # no one else waits: queued


def test_a_sheddable_request_never_passes_a_held_one_that_is_not():
    core = make_core("reserve", num_blocks=10, block_size=4, head_of_line="bypass",
                     max_bypass=10)
    start(core, arrive(core, 0.0, prompt=16, max_new=8).slot)       # 6 blocks
    arrive(core, 0.1, prompt=16, max_new=8)                          # 6: held
    small_batch = arrive(core, 0.2, sheddable=True).slot             # 3: would fit
    assert core.next_admissible(4) == -1
    small = arrive(core, 0.3).slot                                   # 3, not sheddable
    assert core.next_admissible(4) == small                          # bypass as before
    assert core.state(small_batch) == "waiting"


def test_a_full_queue_sheds_sheddable_work_for_other_arrivals_and_never_the_reverse():
    core = make_core("reserve", num_blocks=100, max_queued_requests=2)
    batch = arrive(core, 0.0, sheddable=True).slot
    arrive(core, 0.1)
    res = arrive(core, 0.2)                    # full: the sheddable one makes room
    [(slot, rej)] = res.shed
    assert slot == batch and rej.reason == "shed"
    assert rej.message.startswith("shed from a full queue: sheddable, for a request that is not")
    refused = core.arrive(ArrivalRecord(8, 4, sheddable=True, priority=-9), now=0.3)
    assert not refused.accepted and refused.rejection.reason == "queue_full"
    # under shed_lower_priority too: a sheddable arrival of a better priority value
    # evicts no request that is not sheddable
    core = make_core("reserve", num_blocks=100, max_queued_requests=1, shed_lower_priority=True)
    arrive(core, 0.0, priority=5)
    refused = core.arrive(ArrivalRecord(8, 4, sheddable=True, priority=-9), now=0.1)
    assert not refused.accepted and refused.rejection.reason == "queue_full"


@pytest.mark.parametrize("victim", ["lifo", "priority", "lcf", "length"])
def test_sheddable_requests_give_kv_back_first(victim):
    core = make_core("reserve", num_blocks=100, victim=victim)
    batch = start(core, arrive(core, 0.0, sheddable=True, priority=-3).slot)
    chat = start(core, arrive(core, 0.1, priority=3).slot)
    assert core.victim_order()[-1] == batch
    assert core.victim_order()[0] == chat


def test_priority_retraction_takes_from_sheddable_and_never_for_it():
    core = make_core("reserve", num_blocks=12, block_size=4, queue_order="priority")
    batch = start(core, arrive(core, 0.0, prompt=24, max_new=8, sheddable=True,
                               priority=-100).slot)                   # 8 blocks
    chat = arrive(core, 0.1, prompt=16, max_new=8, priority=100).slot  # 6: does not fit
    assert core.displaceable(chat) == [batch]
    assert core.next_admissible(4) == chat
    core2 = make_core("reserve", num_blocks=12, block_size=4, queue_order="priority")
    start(core2, arrive(core2, 0.0, prompt=24, max_new=8, priority=100).slot)
    batch2 = arrive(core2, 0.1, prompt=16, max_new=8, sheddable=True, priority=-100).slot
    assert core2.displaceable(batch2) == []
    assert core2.next_admissible(4) == -1


def test_the_native_engine_serves_others_first_and_loses_nothing():
    # 40 interactive requests and 120 sheddable ones on a small pool: every request
    # completes or is refused by name, no interactive one is refused, and every
    # block comes back.
    n_chat, n_batch = 40, 120
    arrivals = sorted([i * 0.05 for i in range(n_chat)] + [i * 0.0166 for i in range(n_batch)])
    sheddable = []
    ci = bi = 0
    for t in arrivals:
        if ci < n_chat and abs(t - ci * 0.05) < 1e-12:
            sheddable.append(False); ci += 1
        else:
            sheddable.append(True); bi += 1
    n = len(arrivals)
    cfg = AdmissionConfig.from_dict({})
    e = NativeEngine(cfg, 60, 16, 2048, 32, 2048, step_a=0.01)
    e.add_requests(Requests(arrivals, [64] * n, [48] * n, [64] * n, sheddable=sheddable))
    e.run()
    r = e.results()
    chat_refused = [r["rejected"][i] for i in range(n) if not sheddable[i] and r["rejected"][i]]
    batch_refused = [r["rejected"][i] for i in range(n) if sheddable[i] and r["rejected"][i]]
    assert chat_refused == []
    assert batch_refused and set(batch_refused) == {"shed"}
    done = [i for i in range(n) if r["rejected"][i] is None]
    assert all(r["output_tokens"][i] == 48 for i in done)
    assert e.totals()["free_blocks_at_end"] == 60


def test_a_predicted_ttft_does_not_count_sheddable_work_ahead():
    def core_with(**kw):
        core = make_core("reserve", num_blocks=10, block_size=4)
        start(core, arrive(core, 0.0, prompt=20, max_new=20).slot)
        if kw:
            arrive(core, 0.1, prompt=32, max_new=4, **kw)
        core.step_done(64, 64, 0.2)
        return core.predict_ttft(16, 0.3)
    alone, behind_batch, behind_chat = core_with(), core_with(sheddable=True), core_with(priority=0)
    assert behind_batch == alone < behind_chat
