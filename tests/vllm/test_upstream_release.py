"""vLLM's own scheduler tests at the installed release's tag (its source distribution,
fetched by .ci/run into .upstream/; tests/vllm/upstream_release.py) pass under kvadmit's
pass-through exactly where they pass on stock vLLM, but for the differences kvadmit
makes on purpose, each named below with its reason. CI runs this in the vLLM 0.34
stage; without the fetched tests it is skipped (`python tests/vllm/upstream_release.py
fetch 0.34.0 .upstream` fetches them)."""
import pathlib

import pytest
import vllm

from upstream_release import run

from packaging.version import Version

RELEASE = Version(vllm.__version__).base_version          # '0.34.0' for '0.34.0+cu129'
ROOT = pathlib.Path(__file__).resolve().parents[2] / ".upstream" / f"vllm-{RELEASE}"

# Upstream tests that pass on stock vLLM and not under the pass-through, by release.
KNOWN = {
    "0.34.0": {
        **dict.fromkeys((
            "test_scheduler::test_cache_aware_admission_is_safe_on_a_mamba_spec",
            "test_scheduler::test_cache_aware_admission_keeps_blocked_and_started_requests_in_place",
            "test_scheduler::test_cache_aware_admission_prefers_cached_prefix",
            "test_scheduler::test_cache_aware_admission_protects_resident_prefix_from_eviction[4]"),
            "kvadmit owns the waiting queue's order: --cache-aware-admission-window is off"),
        "test_scheduler::test_evicted_blocks_release_their_auxiliary_outputs_past_capacity":
            "a 64-token prompt on a 4-block pool can never decode: refused (kv_capacity)",
        "test_async_scheduler::test_no_spec_decode_padding_up_to_max_model_len":
            "prompt + max_tokens over max_model_len is refused (context_length); vLLM's API "
            "server cuts max_tokens to the context left before kvadmit sees a request",
    },
}


@pytest.mark.skipif(not (ROOT / "tests").exists(),
                    reason=f"vLLM {RELEASE}'s upstream tests are not fetched")
def test_upstream_scheduler_tests_pass_under_the_pass_through_where_they_pass_on_stock():
    stock, ours = run(ROOT, pass_through=False), run(ROOT, pass_through=True)
    assert stock.keys() == ours.keys()
    passed = {name for name, outcome in stock.items() if outcome == "pass"}
    assert len(passed) > 200, len(passed)           # the files ran (a model missing fails all)
    lost = {name for name in passed if ours[name] != "pass"}
    gained = {name for name, outcome in ours.items() if outcome == "pass"} - passed
    assert lost == set(KNOWN.get(RELEASE, {})), sorted(lost)
    assert not gained, sorted(gained)
