"""Clients' kv_hold_s on vLLM's real scheduler (in-process, kvadmit's native free
queue): a session that says it is done has its cached blocks evicted before those of a
session that is coming back (kvadmit.vllm.session_kv)."""
from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine

BS = 32


def _engine(model_dir, kvadmit):
    return InProcessEngine(model_dir, scheduler_cls=Scheduler, additional_config={"kvadmit": kvadmit},
                           max_model_len=512, num_blocks=16, block_size=BS,
                           enable_prefix_caching=True)


def _b_returning_hits(model_dir, hint: dict | None, kvadmit: dict) -> tuple[int, object]:
    """Session b's first turn ends, then session a's (with `hint`); a stranger takes
    all but 4 of the free blocks; b's next turn starts: its prefix hit tokens."""
    eng = _engine(model_dir, kvadmit)
    b, a = [11 + i % 900 for i in range(4 * BS)], [500 + i % 400 for i in range(4 * BS)]
    eng.add(b, 8, session_id="b")
    eng.run()
    eng.add(a, 8, session_id="a", extra_args={"kvadmit": hint} if hint else None)
    eng.run()
    eng.add([3 + i % 700 for i in range(10 * BS)], 8)            # 11 of the 15 usable blocks
    eng.run()
    before = eng.log.prefix_hit_tokens
    eng.add(b + [7] * 8 + [40] * 40, 8, session_id="b")
    eng.run()
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1      # every block came back
    if hasattr(pool.free_block_queue, "native"):
        pool.free_block_queue.native.check_invariants()
    return eng.log.prefix_hit_tokens - before, eng.scheduler.kvadmit


def test_a_done_session_is_evicted_first_with_the_native_queue(model_dir):
    native = {"native_allocator": True}
    hits_done, adm = _b_returning_hits(model_dir, {"kv_hold_s": 0}, native)
    hits_lru, _ = _b_returning_hits(model_dir, None, native)
    assert hits_done == 4 * BS                 # b's whole prompt history survived the stranger
    assert hits_lru <= BS                      # LRU took b's (freed first) instead
    assert adm.session_kv.demoted_blocks == 4 and adm.session_kv.hold.stats()["released"] == 1


def test_without_the_native_queue_the_hint_is_not_used(model_dir, caplog):
    hits, adm = _b_returning_hits(model_dir, {"kv_hold_s": 0}, {})
    assert adm.session_kv is None and hits <= BS
    assert "kv_hold_s; it takes native_allocator" in caplog.text


def test_only_the_session_s_own_blocks_move(model_dir):
    """Session y's first request finds session x's 2-block prefix cached; when y says it
    is done, only its own 2 blocks go to the head of the free queue,
    ahead of every block vLLM has not used yet; the shared prefix keeps its LRU place."""
    eng = _engine(model_dir, {"native_allocator": True})
    shared = [11 + i % 900 for i in range(2 * BS)]
    eng.add(shared + [300 + i for i in range(2 * BS)], 8, session_id="x")
    eng.run()
    eng.add(shared + [600 + i for i in range(2 * BS)], 8, session_id="y",
            extra_args={"kvadmit_kv_hold_s": 0})
    eng.run()
    session_kv = eng.scheduler.kvadmit.session_kv
    assert session_kv.demoted_blocks == 2
    head = eng.scheduler.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()[:3]
    assert [b.block_hash is not None for b in head] == [True, True, False]
    # the two at the head are y's own (blocks 3 and 2 of its prompt), not the shared ones
    x_blocks = {b.block_hash for b in eng.scheduler.kv_cache_manager.block_pool.blocks
                if b.block_hash is not None} - {b.block_hash for b in head}
    assert len(x_blocks) == 4                 # x's 2 own + the 2 shared, all still cached
