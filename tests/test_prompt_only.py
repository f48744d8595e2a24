"""A prompt-only request (a pooling or embedding request: max_new_tokens 0) in the
core: counted on its prompt alone, so a prompt of max_model_len tokens is admitted under
every policy and finishes; a negative cap is refused."""
import pytest

from helpers import make_core
from kvadmit import POLICIES, ArrivalRecord

BLOCK = 4
PROMPT = 40        # = max_model_len


@pytest.mark.parametrize("policy", POLICIES)
def test_a_prompt_only_request_of_the_whole_context_is_admitted_and_finishes(policy):
    core = make_core(policy, num_blocks=2 * PROMPT // BLOCK, block_size=BLOCK,
                     max_model_len=PROMPT)
    res = core.arrive(ArrivalRecord(PROMPT, 0), now=0.0)
    assert res.accepted, res.rejection
    assert core.next_admissible(2 * PROMPT // BLOCK) == res.slot
    core.admit(res.slot, 0.0)
    core.update(res.slot, PROMPT, 0)
    core.finish(res.slot, 0.1)
    assert core.state(res.slot) == "free" and sum(core.stats()["rejected"].values()) == 0
    # one output token more does not fit the context
    refused = core.arrive(ArrivalRecord(PROMPT, 1), now=0.2)
    assert not refused.accepted and refused.rejection.reason == "context_length"


def test_a_negative_output_cap_is_refused_naming_it():
    with pytest.raises(ValueError, match="max_new_tokens=-1: must be >= 0"):
        ArrivalRecord(4, -1)


def admitted_after(core, pool_blocks):
    """How many of 200 waiting generate requests with an output cap never seen before
    the core admits into an idle pool of `pool_blocks`, one after another."""
    slots = [core.arrive(ArrivalRecord(16, 500), now=100.0).slot for _ in range(200)]
    n, free = 0, pool_blocks
    while True:
        s = core.next_admissible(free)
        if s is None or s < 0:
            return n
        core.admit(s, 100.0)
        n += 1
        free -= 16 // BLOCK
        assert s in slots


def finish(core, prompt, max_new, generated, now):
    s = core.arrive(ArrivalRecord(prompt, max_new), now=now).slot
    core.admit(s, now)
    core.update(s, prompt + max(generated - 1, 0), generated)
    core.finish(s, now + 0.01)


@pytest.mark.parametrize("policy", ["auto", "adaptive"])
def test_prompt_only_finishes_do_not_move_the_output_length_model(policy):
    """Prompt-only requests generate nothing, and reach their cap of 0: counted as
    finishes they would pull the length model to 0 and make every cap look honest."""
    counts = []
    for prompt_only in (0, 100):
        core = make_core(policy, num_blocks=8192, block_size=BLOCK, max_model_len=2048)
        for i in range(20):
            finish(core, 16, 400, 200, float(i))
        for i in range(prompt_only):
            finish(core, 16, 0, 0, 20.0 + i * 0.01)
        counts.append(admitted_after(core, 1024))
    # (counted as finishes, the 100 prompt-only ones gave auto 63 and adaptive 200 here)
    assert counts[0] == counts[1] < 200, counts
