"""Trace loaders: real excerpts load; malformed lines fail with file and line."""
import pathlib

import pytest

from kvadmit.traces import TraceError, load_trace, max_tokens_for, scale_rate

DATA = pathlib.Path(__file__).parent / "data"


def test_azure_excerpt():
    reqs = load_trace(DATA / "azure2023_conv_head200.csv")
    assert len(reqs) == 200
    first, second = reqs[0], reqs[1]
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900
    assert second.arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert len(load_trace(DATA / "azure2023_conv_head200.csv", limit=10)) == 10


def test_mooncake_excerpt_keeps_prefix_hashes():
    reqs = load_trace(DATA / "mooncake_conversation_head50.jsonl")
    assert len(reqs) == 50
    assert reqs[0].prompt_tokens == 6758 and reqs[0].output_tokens == 500
    assert reqs[0].hash_ids[:3] == (0, 1, 2) and reqs[1].hash_ids[0] == 0  # shared first block


@pytest.mark.parametrize("text,needle", [
    ("TIMESTAMP,ContextTokens\n", "line 1: header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,374,44\n2023-11-16 18:15:47,x,4\n",
     "line 3: ContextTokens='x' is not an integer"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374,0\n",
     "line 2: GeneratedTokens='0' must be >= 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,4\n", "line 2: TIMESTAMP='yesterday'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374\n", "line 2: expected 3 fields"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n2023-11-16 18:15:45,1,1\n",
     "line 3: TIMESTAMP goes back in time"),
])
def test_azure_malformed(tmp_path, text, needle):
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(TraceError, match=needle):
        load_trace(p)


@pytest.mark.parametrize("line,needle", [
    ("{nope", "line 2: not JSON"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 2}', "line 2: missing field 'hash_ids'"),
    ('{"timestamp": 5, "input_length": 3, "output_length": 2, "hash_ids": ["a"]}', "hash_ids must be"),
    ('{"timestamp": -1, "input_length": 3, "output_length": 2, "hash_ids": []}', "timestamp=-1"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 2, "hash_ids": []}', "input_length=0"),
    ("", "line 2: empty line"),
])
def test_mooncake_malformed(tmp_path, line, needle):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=needle):
        load_trace(p)


def test_rate_scaling_and_max_tokens_rules():
    reqs = load_trace(DATA / "azure2023_conv_head200.csv", limit=3)
    fast = scale_rate(reqs, 2.0)
    assert fast[1].arrival_s == pytest.approx(reqs[1].arrival_s / 2)
    r = reqs[0]  # 374 prompt, 44 generated
    assert max_tokens_for(r, "cap", 2048, 4096) == 2048
    assert max_tokens_for(r, "context", 2048, 1000) == 1000 - 374
    assert max_tokens_for(r, "cap", 10, 4096) == 44      # never below the real output
    with pytest.raises(ValueError, match="rate factor=0"):
        scale_rate(reqs, 0)


def test_unknown_format(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("x")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(p)
