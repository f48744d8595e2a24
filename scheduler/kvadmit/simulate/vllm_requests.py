"""The requests a `VllmEngine` (`kvadmit.simulate.vllm_engine`) was given, and the
token ids they stand for.

Prompt tokens: with prefix caching and a workload with prefix-block ids, equal
ids give equal token blocks (a pseudo-random sequence seeded by the id), so
vLLM's content hashes hit exactly where the native engine's id hashes do; the
fake model emits the same id-derived tokens as outputs where the ids cover the
output (agent sessions: the next turn's prompt repeats this turn's output).
Everything else is pseudo-random per request (seeded, deterministic).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from kvadmit.request_fields import COLUMN_FIELDS

_SALT_BLOCK = 0x6B766164          # seeds for a prefix id's tokens: [id, _SALT_BLOCK]
_SALT_REQUEST = 0x72657175        # seeds for a request's own tokens: [seed, index, _SALT_REQUEST]


@functools.lru_cache(maxsize=8192)
def _block_tokens(block_id: int, n: int, vocab: int) -> tuple[int, ...]:
    """The tokens of prefix-block id `block_id`: n values in [3, vocab) (never EOS=2)."""
    seed = [abs(block_id), 1 if block_id < 0 else 0, _SALT_BLOCK]
    return tuple(np.random.default_rng(seed).integers(3, vocab, n).tolist())


def _own_tokens(seed: int, index: int, n: int, vocab: int) -> list[int]:
    if n <= 0:
        return []
    return np.random.default_rng([seed, index, _SALT_REQUEST]).integers(3, vocab, n).tolist()


class RequestTable:
    """The requests a `VllmEngine` was given, by index in the order added. Their
    tokens (`tokens_of`): ``seed`` picks the pseudo-random ones, ``hash_block_tokens``
    is the tokens a prefix-block id stands for (0: ids are not used), ``vocab`` the
    model's vocabulary."""

    def __init__(self, seed: int, hash_block_tokens: int, vocab: int):
        self.seed, self.hbt, self.vocab = seed, hash_block_tokens, vocab
        self.arrival: list[float] = []
        self.prompt: list[int] = []
        self.out: list[int] = []
        self.maxtok: list[int] = []
        self.prio: list[int] = []
        self.hashed: list[int] = []
        self.parent: list[int] = []
        self.delay: list[float] = []
        self.ids: list = []              # per request: its prefix-block ids (None: none given)
        self.extra: list[dict] = []      # per request: kvadmit's request fields
        self.last_open = -math.inf       # the latest fixed arrival

    def __len__(self) -> int:
        return len(self.prompt)

    def hash_ids_of(self, i: int):
        return self.ids[i]

    def fields(self, i: int) -> dict:
        return self.extra[i]

    def append(self, row: dict) -> None:
        """One of `Requests.row`'s rows. Its record columns that are request fields
        (SLO targets, session, TTL, flow, class...) reach kvadmit as such where given
        (not the default: none sent)."""
        fields = {f.name: row[f.column] for f in COLUMN_FIELDS if f.is_given(row[f.column])}
        if row["parent"] < 0:
            self.last_open = row["arrival_s"]
        for col, v in ((self.arrival, row["arrival_s"]), (self.prompt, row["prompt_tokens"]),
                       (self.out, row["output_tokens"]), (self.maxtok, row["max_new_tokens"]),
                       (self.prio, row["priority"]), (self.hashed, row["hashed_tokens"]),
                       (self.parent, row["parent"]), (self.delay, row["delay_s"]),
                       (self.ids, row["hash_ids"]), (self.extra, fields)):
            col.append(v)

    def tokens_of(self, i: int) -> tuple[list[int], list[int] | None]:
        """Request i's prompt tokens, and the output tokens the fake model emits
        (None: pseudo-random) where its prefix-block ids cover the output."""
        p, o = self.prompt[i], self.out[i]
        ids = self.hash_ids_of(i)
        if not self.hbt or ids is None:
            return _own_tokens(self.seed, i, p, self.vocab), None
        h = max(0, min(self.hashed[i], len(ids) * self.hbt, p + o))
        toks: list[int] = []
        for k in range(-(-h // self.hbt)):
            toks.extend(_block_tokens(int(ids[k]), self.hbt, self.vocab))
        del toks[h:]
        toks.extend(_own_tokens(self.seed, i, p + o - h, self.vocab))
        return toks[:p], toks[p:]
