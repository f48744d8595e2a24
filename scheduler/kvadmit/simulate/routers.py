"""Routers in front of a fleet of simulated engines (kvadmit.simulate.fleet).

A router sees what a real one sees: each instance's published signals as of its
last scrape (`observe`, every scrape interval: stale in between), and its own
bookkeeping, which is fresh: what it sent to each instance since that scrape, and
the requests it has outstanding there (sent, not yet answered; answers are seen
at the fleet's sync ticks). `choose` returns an instance index, or a `Refusal`
(the router answers the client itself, with or without a Retry-After).

    round-robin     each instance in turn
    least-requests  fewest outstanding requests (the router's own count, as Envoy's)
    gie             GIE / llm-d's endpoint picker: an instance is saturated when
                    max(waiting / 5, kv_usage / 0.8) >= 1 on the scraped metrics;
                    the unsaturated ones (all, if none) are scored by queue depth
                    (min-max normalised) plus free KV (1 - usage); the best wins,
                    ties broken at random
    dynamo          Dynamo's KV router: busy when its active blocks (scraped, plus
                    the prompt blocks routed there since) exceed busy_threshold of
                    the pool; the least loaded non-busy one by those blocks; when
                    all are busy, a 529-like refusal without Retry-After
    headroom        kvadmit's signals: the instance with the most KV headroom
                    left (less what was routed there since the scrape) where the
                    request's prompt fits; where it fits nowhere, a refusal with
                    the shortest predicted queueing delay as Retry-After (a
                    prompt larger than every pool goes to the largest, whose
                    engine refuses it for good)
    prefix          prefix affinity (llm-d's prefix-cache scorer): GIE's
                    saturation filter and scores plus twice the share of the
                    request's leading prefix blocks last routed to an instance
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    reason: str
    retry_after_s: float | None      # None: the client backs off by its own rule


@dataclass
class Request:
    """What the router knows of a request: its size and its targets (headers)."""
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    hash_ids: list | None = None


class Router:
    name = ""

    def __init__(self, n: int, block_size: int, num_blocks: list[int], seed: int = 0, **_):
        self.n = n
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.rng = random.Random(seed)
        self.sig: list[dict | None] = [None] * n      # the last scrape
        self.sent_blocks = [0] * n                   # prompt blocks sent since the last scrape
        self.outstanding = [0] * n                   # sent, not answered (as seen at sync ticks)

    # bookkeeping -------------------------------------------------------
    def observe(self, signals: list[dict]) -> None:
        self.sig = signals
        self.sent_blocks = [0] * self.n

    def sent(self, e: int, req: Request) -> None:
        self.sent_blocks[e] += -(-req.prompt_tokens // self.block_size)
        self.outstanding[e] += 1

    def answered(self, e: int, count: int) -> None:
        self.outstanding[e] -= count

    def candidates(self, exclude) -> list[int]:
        """Instances not excluded (the ones that refused this request); all if none is left."""
        c = [e for e in range(self.n) if e not in exclude] if exclude else list(range(self.n))
        return c or list(range(self.n))

    def pick_max(self, cands: list[int], score) -> int:
        """The best-scoring instance; ties at random (GIE's max-score picker)."""
        best, top = None, []
        for e in cands:
            s = score(e)
            if best is None or s > best:
                best, top = s, [e]
            elif s == best:
                top.append(e)
        return top[0] if len(top) == 1 else top[self.rng.randrange(len(top))]

    def choose(self, req: Request, now: float, exclude) -> int | Refusal:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, n, *a, **kw):
        super().__init__(n, *a, **kw)
        self.next = 0

    def choose(self, req, now, exclude):
        for _ in range(self.n):
            e = self.next
            self.next = (self.next + 1) % self.n
            if e not in exclude:
                return e
        e = self.next
        self.next = (self.next + 1) % self.n
        return e


class LeastRequests(Router):
    name = "least-requests"

    def choose(self, req, now, exclude):
        return self.pick_max(self.candidates(exclude), lambda e: -self.outstanding[e])


class Gie(Router):
    name = "gie"
    QUEUE_THRESHOLD = 5.0      # GIE's saturation detector defaults
    KV_THRESHOLD = 0.8

    def saturated(self, e: int) -> bool:
        s = self.sig[e]
        return s is not None and max(s["num_requests_waiting"] / self.QUEUE_THRESHOLD,
                                     s["kv_cache_usage_perc"] / self.KV_THRESHOLD) >= 1.0

    def scores(self, cands: list[int]):
        """GIE's queue scorer (min-max normalised, 1 when all equal) plus its KV
        utilisation scorer (1 - usage), on the scraped metrics."""
        q = {e: (self.sig[e]["num_requests_waiting"] if self.sig[e] else 0) for e in cands}
        lo, hi = min(q.values()), max(q.values())
        kv = {e: (self.sig[e]["kv_cache_usage_perc"] if self.sig[e] else 0.0) for e in cands}
        return lambda e: ((hi - q[e]) / (hi - lo) if hi > lo else 1.0) + (1.0 - kv[e])

    def filtered(self, exclude) -> list[int]:
        cands = self.candidates(exclude)
        return [e for e in cands if not self.saturated(e)] or cands

    def choose(self, req, now, exclude):
        cands = self.filtered(exclude)
        return self.pick_max(cands, self.scores(cands))


class Prefix(Gie):
    name = "prefix"
    PREFIX_WEIGHT = 2.0
    INDEX_LIMIT = 1 << 20          # prefix blocks remembered (least recently routed dropped)

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.where: dict = {}      # prefix block id -> the instance it was last routed to

    def choose(self, req, now, exclude):
        cands = self.filtered(exclude)
        ids = req.hash_ids or []
        # Only the instance the first block went to can hold a leading run of them.
        last = self.where.get(ids[0]) if ids else None
        run = 0
        for h in ids:
            if self.where.get(h) != last:
                break
            run += 1
        base = self.scores(cands)
        total = max(len(ids), 1)
        e = self.pick_max(cands, lambda e: base(e) + self.PREFIX_WEIGHT
                          * (run if e == last else 0) / total)
        for h in ids:
            self.where.pop(h, None)
            self.where[h] = e
        while len(self.where) > self.INDEX_LIMIT:
            self.where.pop(next(iter(self.where)))
        return e


class Dynamo(Router):
    name = "dynamo"

    def __init__(self, *a, busy_threshold: float = 0.9, **kw):
        super().__init__(*a, **kw)
        self.busy_threshold = busy_threshold

    def load_blocks(self, e: int) -> int:
        s = self.sig[e]
        return (s["active_blocks"] if s else 0) + self.sent_blocks[e]

    def choose(self, req, now, exclude):
        cands = self.candidates(exclude)
        free = [e for e in cands if self.load_blocks(e) <= self.busy_threshold * self.num_blocks[e]]
        if not free:
            return Refusal("router_busy", None)
        return self.pick_max(free, lambda e: -self.load_blocks(e))


class Headroom(Router):
    """kvadmit's signals, read for what they mean:

    - `kv_headroom_blocks`: the blocks an instance can still admit without a
      forecast shortfall, after its waiting prompts. A request whose prompt fits
      it starts at once there, without costing anyone a preemption or a pause.
    - `predicted_queue_delay_s`: how long a request arriving now would wait
      before it starts, at the instance's recent admission rate.

    A request goes to the instance with the most headroom left (as a share of its
    pool) where its prompt fits. Where it fits nowhere, it would queue, and a
    queue on an instance whose pool is spoken for is what breaks SLOs: the
    request waits for room, and while a backlog waits, every step of that
    instance carries a full token budget of prefill, which stretches the
    time-per-token of everything it runs. So the router refuses it with a
    Retry-After of the shortest predicted wait (at least one scrape interval:
    before the next scrape it knows nothing new), and the client retries when
    room is expected. Between scrapes the router charges each instance the prompt
    blocks it sent there since."""
    name = "headroom"

    def __init__(self, *a, scrape_interval_s: float = 0.2, **kw):
        super().__init__(*a, **kw)
        self.scrape_interval_s = scrape_interval_s

    def room(self, e: int) -> float:
        s = self.sig[e]
        head = s["kv_headroom_blocks"] if s else self.num_blocks[e]
        return head - self.sent_blocks[e]

    def choose(self, req, now, exclude):
        cands = self.candidates(exclude)
        need = -(-req.prompt_tokens // self.block_size)
        fits = [e for e in cands if self.room(e) >= need]
        if fits:
            return self.pick_max(fits, lambda e: self.room(e) / self.num_blocks[e])
        if all(need > self.num_blocks[e] for e in cands):
            # it fits no pool even empty: no wait helps; the engine refuses it for good
            return self.pick_max(cands, lambda e: self.num_blocks[e])
        wait = min(self.sig[e]["predicted_queue_delay_s"] if self.sig[e] else 0.0 for e in cands)
        return Refusal("router_no_headroom", max(wait, self.scrape_interval_s))


ROUTERS = {r.name: r for r in (RoundRobin, LeastRequests, Gie, Dynamo, Headroom, Prefix)}


def make_router(name: str, n: int, block_size: int, num_blocks: list[int], seed: int = 0,
                busy_threshold: float = 0.9, scrape_interval_s: float = 0.2) -> Router:
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"--router {name!r}: must be one of {', '.join(ROUTERS)}") from None
    return cls(n, block_size, num_blocks, seed=seed, busy_threshold=busy_threshold,
               scrape_interval_s=scrape_interval_s)
