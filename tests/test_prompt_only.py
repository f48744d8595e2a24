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
