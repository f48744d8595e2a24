"""A tiny random-weight Llama saved locally: a real model for vLLM's CPU engine
without any download (tests, `kvadmit bench vllm` and `kvadmit bench serve` use it).

head_dim must be >= 64 for vLLM's CPU attention: hidden 256 with 4 heads.

Beside the weights it gets a real tokenizer (tokenizer.json + tokenizer_config.json
with a chat template), built here with the `tokenizers` library: a word-level
vocabulary of exactly the model's vocab_size, split on whitespace. Id 0 is <unk>, a
plain word that every unknown word maps to; ids 1-6 are the special tokens (<s> =
bos 1, </s> = eos 2, and four chat-role markers); every other id i is the word
"w{i}". So any id sequence decodes to text that encodes back to the same ids (what
vLLM's `vllm bench serve --dataset-name random` needs: it decodes random ids and
re-encodes them to the length it asked for), text and chat requests work, and text
of unknown words keeps its length in tokens (guidellm's synthetic prompts: English
text cut to a token count). `vllm serve` then needs no --skip-tokenizer-init (which
still works: the weights are unchanged).
"""
from __future__ import annotations

import json
import pathlib

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
DEFAULT_DIR = pathlib.Path.home() / ".cache" / "kvadmit" / "tiny-llama"   # built once, reused
TINY_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
# "<s><|user|> hi <|assistant|> ": role markers are special tokens, content is words.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> "
                 "{{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def word(token_id: int) -> str:
    """The text of a non-special token id."""
    return f"w{token_id}"


def tokenizer_files(vocab_size: int = TINY_LLAMA["vocab_size"]) -> dict[str, str]:
    """{file name: contents} of the tiny model's tokenizer (deterministic)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size}: must be > {len(SPECIAL_TOKENS)} "
                         "(the special tokens)")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # <unk> is a plain word, not a special token: decode(skip_special_tokens=True) keeps
    # it, so text of unknown words (guidellm's synthetic prompts: English from Faker,
    # encoded, cut to length, decoded) keeps its length instead of decoding to ""
    tok.add_special_tokens(list(SPECIAL_TOKENS[1:]))
    # encode(text) starts with bos, as a Llama tokenizer does; decode joins words by spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_TOKEN_ID)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "</s>",
              "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
              "clean_up_tokenization_spaces": False,
              "model_max_length": TINY_LLAMA["max_position_embeddings"],
              "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": tok.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(config, indent=2)}


def build_tokenizer(path: str | pathlib.Path) -> pathlib.Path:
    """Writes the tokenizer files into `path` unless they are already there, the same."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name, text in tokenizer_files().items():
        f = path / name
        if not f.exists() or f.read_text() != text:
            tmp = f.with_suffix(f".tmp{id(text)}")
            tmp.write_text(text)
            tmp.replace(f)                  # atomic: a reader never sees half a file
    return path


def build_tiny_llama(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Writes the model (config.json + safetensors) and its tokenizer to `path` unless
    they are already there."""
    path = pathlib.Path(path)
    marker = path / "kvadmit_tiny.json"
    if not (marker.exists() and json.loads(marker.read_text()) == {"seed": seed, **TINY_LLAMA}):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        cfg = LlamaConfig(**TINY_LLAMA, torch_dtype="float32", bos_token_id=BOS_TOKEN_ID,
                          eos_token_id=EOS_TOKEN_ID)
        LlamaForCausalLM(cfg).save_pretrained(path)
        marker.write_text(json.dumps({"seed": seed, **TINY_LLAMA}))
    return build_tokenizer(path)
