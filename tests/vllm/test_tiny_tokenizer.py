"""The tiny model's tokenizer (kvadmit.vllm.tiny_model) on vLLM's tokenizer loader and
its own benchmark datasets (no engine runs here)."""
import json
import pathlib

import pytest

from kvadmit.vllm.tiny_model import (BOS_TOKEN_ID, EOS_TOKEN_ID, SPECIAL_TOKENS, TINY_LLAMA,
                                     build_tokenizer)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from vllm.tokenizers import get_tokenizer
    return get_tokenizer(model_dir)


def test_the_tokenizer_matches_the_model(model_dir, tokenizer):
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    assert tokenizer.vocab_size == len(tokenizer) == config["vocab_size"] == TINY_LLAMA["vocab_size"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"],
                                                                config["eos_token_id"])
    assert (BOS_TOKEN_ID, EOS_TOKEN_ID) == (1, 2)
    assert sorted(tokenizer.all_special_ids) == list(range(1, len(SPECIAL_TOKENS)))
    assert tokenizer("w7 w1023").input_ids == [BOS_TOKEN_ID, 7, 1023]
    assert tokenizer("hello w9").input_ids == [BOS_TOKEN_ID, 0, 9]      # an unknown word: <unk>


def test_unknown_words_keep_their_length():
    """<unk> is a plain word: text of unknown words, cut to n tokens and decoded
    without special tokens (as guidellm builds its synthetic prompts), is n tokens."""
    from vllm.tokenizers import get_tokenizer
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok = get_tokenizer(str(build_tokenizer(d)))
        ids = tok.encode("It was the best of times, it was the worst of times.")
        text = tok.decode(ids[:8], skip_special_tokens=True)
        assert text == " ".join(["<unk>"] * 7)
        assert len(tok.encode(text)) == 8


def test_every_id_sequence_round_trips(tokenizer):
    import random
    rng = random.Random(0)
    for n in (1, 5, 300):
        ids = [rng.randrange(0, TINY_LLAMA["vocab_size"]) for _ in range(n)]
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_vllms_random_dataset_gets_the_lengths_it_asks_for(tokenizer):
    """What `vllm bench serve --dataset-name random` does: random ids, decoded and
    re-encoded, at exactly the length asked (no token mismatch)."""
    from vllm.benchmarks.datasets.datasets import RandomDataset
    reqs = RandomDataset(random_seed=0).sample(tokenizer, 20, input_len=64, output_len=8,
                                               range_ratio=0.5)
    assert len(reqs) == 20 and len({r.prompt_len for r in reqs}) > 1
    for r in reqs:
        assert len(tokenizer(r.prompt).input_ids) == r.prompt_len + 1     # + bos
        assert r.expected_output_len >= 4


def test_the_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "w10"}, {"role": "user", "content": "w11 w12"}],
        add_generation_prompt=True, tokenize=False)
    assert text == "<s><|system|> w10 <|user|> w11 w12 <|assistant|> "
    assert tokenizer(text, add_special_tokens=False).input_ids == [1, 3, 10, 4, 11, 12, 5]


def test_build_tokenizer_leaves_same_files_alone(tmp_path):
    build_tokenizer(tmp_path)
    stamps = {f.name: f.stat().st_mtime_ns for f in tmp_path.iterdir()}
    build_tokenizer(tmp_path)
    assert {f.name: f.stat().st_mtime_ns for f in tmp_path.iterdir()} == stamps
    (tmp_path / "tokenizer.json").write_text("{}")
    build_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
