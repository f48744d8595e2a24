"""kvadmit's PrefillAdder and PrefillBudget: SGLang's own classes with the admission
asked of the kvadmit core and SGLang's future-reservation terms taken out.

Imports SGLang: `kvadmit.sglang.adapter` imports this module only when it builds an
adapter for a live server, so `import kvadmit.sglang` works without SGLang.
"""
from __future__ import annotations

from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.prefill_budget import PrefillBudget


class _NoReqStates(list):
    """Stands in for PrefillAdder.req_states: SGLang's ignore_eos look-ahead
    (a future-memory rule) is replaced by the core's, so nothing is recorded."""

    def append(self, item):  # noqa: D401 - list API
        pass

    def insert(self, index, item):
        pass


class KvadmitPrefillBudget(PrefillBudget):
    """SGLang's token budget with the future-reservation terms taken out.

    SGLang's own rule (remaining = available + evictable - sum of running
    ``min(max_new - generated, clip) * new_token_ratio``, and a new request
    charged its clipped max_new) is replaced by the kvadmit core's policy,
    which has already said 'admit' when this is reached. What stays is the
    physical check: the prefill itself (plus SGLang's page overhead) must
    fit in the free + evictable tokens now, and a prompt chunked over several
    steps must find its later chunks' room then (`hold_for_chunked`; with
    mixed chunked prefill, also the running requests' decodes meanwhile)."""

    mixed_decode_tokens = 0   # running requests decoding in each prefill step (mixed mode)
    chunk_size = None         # SGLang's chunked prefill size (None: no chunking)
    joining = 0               # requests of this batch that finish their prefill in it

    def mixed_decode_room(self, rest) -> int:
        """Mixed chunked prefill: `rest` prompt tokens left for later steps are
        prefilled over further steps, and in each of them every running request
        (those running now and those joining from this batch) decodes a token
        (SGLang's mixed step, which never retracts). Its last chunk must still find
        room then: SGLang continues a chunked request even when the pool is empty,
        so room the decodes took would be an out-of-memory error in the scheduler."""
        if not self.mixed_decode_tokens or not self.chunk_size or rest <= 0:
            return 0
        decoders = self.mixed_decode_tokens + self.joining
        later_steps = -(-rest // max(self.chunk_size - decoders, 1))
        return decoders * later_steps

    def check_prefill(self, *, extend_input_len, total_tokens, max_new_tokens, input_tokens,
                      swa_host_hit_length, chunk_limit, auxiliary_swa_host_hit_length=0):
        # Prompt tokens left for later steps when this one is chunked now.
        rest = extend_input_len - max(chunk_limit, 0) if chunk_limit is not None else 0
        return super().check_prefill(
            extend_input_len=extend_input_len,
            total_tokens=total_tokens - max_new_tokens + self.mixed_decode_room(rest),
            max_new_tokens=0,
            input_tokens=input_tokens,
            swa_host_hit_length=swa_host_hit_length,
            chunk_limit=chunk_limit,
            auxiliary_swa_host_hit_length=auxiliary_swa_host_hit_length,
        )

    def reserve(self, extend_input_len, max_new_tokens, **kwargs):
        super().reserve(extend_input_len, 0, **kwargs)

    def hold_for_chunked(self, req) -> None:
        """A request stays chunked after this step: what its later chunks take, and
        what the running requests' mixed decodes take meanwhile, is kept out of
        this step's other admissions."""
        rest = len(req.full_untruncated_fill_ids) - req.extend_end
        if rest <= 0:
            return
        held = rest + self.mixed_decode_room(rest)
        self.total_offset += held
        self.current_offset += held

class KvadmitPrefillAdder(PrefillAdder):
    """SGLang's PrefillAdder whose admission asks the kvadmit core.

    For each waiting request SGLang offers (in the core's order, see
    `SGLangAdmission.order_waiting`) the core answers with
    ``next_admissible(free_blocks)``: this request (SGLang then does the
    mechanics: prefix lock, chunking, token budgets, and the core commits
    with ``admit``), nothing (NO_TOKEN: the batch is full for now), or a
    later request (head_of_line='bypass': this one is skipped)."""

    kvadmit: "SGLangAdmission" = None  # kvadmit.sglang.adapter's: set on the per-scheduler subclass

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        old = self.memory_budget
        if type(old) is not PrefillBudget:
            raise RuntimeError(
                f"kvadmit supports SGLang's full-attention token budget (PrefillBudget); "
                f"this server uses {type(old).__name__}")
        self.memory_budget = KvadmitPrefillBudget(
            self.token_to_kv_pool_allocator, self.tree_cache,
            num_mixed_decode_tokens=old.current_offset)
        self.memory_budget.mixed_decode_tokens = old.current_offset
        if self.rem_chunk_tokens is not None:
            self.memory_budget.chunk_size = self.rem_chunk_tokens + old.current_offset
        self.req_states = _NoReqStates()

    def add_one_req(self, req, has_chunked_req, truncation_align_size):
        adapter = self.kvadmit
        if adapter.failed_closed and not req.output_ids:
            return AddReqResult.OTHER   # failed closed: nothing new starts (the step refuses it)
        slot = None if adapter.failed else adapter.slot_for(req)
        if slot is None:  # not tracked (cannot happen via SGLang's queue), or failed open
            return super().add_one_req(req, has_chunked_req, truncation_align_size)
        try:
            verdict = self._verdict(req, slot)
        except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
            adapter.fail("choosing a waiting request")
            if adapter.failed_closed and not req.output_ids:
                return AddReqResult.OTHER
            return super().add_one_req(req, has_chunked_req, truncation_align_size)
        if verdict is not None:
            return verdict
        before = len(self.can_run_list)
        prefix = int(req.prefix_len)
        # Those admitted before it in this batch decode from the next step on.
        self.memory_budget.joining = before - (self.new_chunked_req is not None)
        res = super().add_one_req(req, has_chunked_req, truncation_align_size)
        if len(self.can_run_list) > before and self.can_run_list[-1] is req:
            try:
                adapter.on_admitted(slot, req, prefix)
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                adapter.fail("starting a waiting request")
            if self.new_chunked_req is req:
                self.memory_budget.hold_for_chunked(req)
        return res

    def _verdict(self, req, slot):
        """The core's answer for ``req`` now: None (SGLang may add it), or the
        AddReqResult that stops or skips it."""
        adapter = self.kvadmit
        with self._lock_node(req.last_node):
            free_tokens = int(self.memory_budget.remaining_current)
        adapter.prepare_decision(slot, req)
        free_blocks = max(free_tokens, 0) // adapter.page_size
        nxt = adapter.port.next_admissible(free_blocks)
        if nxt == slot:
            return None
        if nxt >= 0:
            # bypass, or this one's session is outside the agent window: a later
            # request goes first
            return AddReqResult.CONTINUE
        if adapter.port.decide(slot, free_blocks) in ("hold_blocks", "hold_capacity"):
            # memory: the batch is full for now, unless running requests it may take
            # KV from give it theirs now (priority preemption, flows)
            return None if self.displace_for(req, slot, need_row=False) else AddReqResult.NO_TOKEN
        # Held by the TPOT guard or the agent window: stop this step without marking
        # the batch full (a finishing request is not the only thing that lifts these
        # holds: the step-time fit and the window do too), so the next step scans again.
        return AddReqResult.OTHER

    def add_chunked_req(self, req):
        still_chunked = super().add_chunked_req(req)
        if still_chunked is not None and req in self.can_run_list:
            self.memory_budget.joining = 0
            self.memory_budget.hold_for_chunked(req)
        return still_chunked

    def add_one_req_ignore_eos(self, req):
        self.req_states = _NoReqStates()
        return super().add_one_req_ignore_eos(req)

    def preempt_to_schedule(self, req):
        """SGLang asks this when the batch has no request slot left for ``req``
        (with --enable-priority-scheduling and its preemption on): evict running
        requests for it if the core lets it displace them (`displace_for`, which
        takes at least one here, for the slot)."""
        if self.kvadmit.failed:
            if self.kvadmit.failed_closed and not req.output_ids:
                return False            # failed closed: it will not start
            return super().preempt_to_schedule(req)
        try:
            slot = self.kvadmit.slot_for(req)
            if slot is None or self.kvadmit.port.state(slot) != "waiting":
                return False
            self.kvadmit.prepare_decision(slot, req)
            return self.displace_for(req, slot, need_row=True)
        except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
            self.kvadmit.fail("displacing running requests for a waiting one")
            return False

    def displace_for(self, req, slot: int, need_row: bool) -> bool:
        """Priority preemption and flow displacement, SGLang's way (it cannot
        pause): the waiting request ``slot`` takes KV now from running requests less
        important than it by more than SGLang's
        --priority-scheduling-preemption-threshold, or, under flows, from those of
        flows over their share (the core's `displaceable`, first victim first). Only
        if the core admits it with all of those gone (their blocks counted free) is
        any evicted; then they are evicted one by one until the core admits it
        (``need_row``: at least one, SGLang's batch has no slot for it). Evicted
        requests are released as SGLang's own preemption does and go back to the
        waiting queue after this batch (``preempt_list``); the core counts each as
        preempted. True: ``req`` may be admitted now."""
        adapter = self.kvadmit
        port = adapter.port
        if not (adapter.priority_preemption or port.flows_on):
            return False
        # SGLang's priority preemption off: flow displacement alone
        victims = port.displaceable(slot, flows_only=not adapter.priority_preemption)
        if not victims:
            return False
        by_slot = {}
        for r in self.running_batch.reqs:
            s = adapter.slot_for(r)
            if s is not None and r not in self.preempt_list and not r.finished():
                by_slot[s] = r
        victims = [s for s in victims if s in by_slot]
        if not victims:
            return False
        page = adapter.page_size

        def free_blocks():
            return max(int(self.memory_budget.remaining_current), 0) // page

        held = sum(-(-int(by_slot[s].kv.kv_committed_len) // page) for s in victims)
        if port.decide(slot, free_blocks() + held) != "admit":
            return False   # not even all of them would make room: evict none
        taken = 0
        for s in victims:
            if taken >= need_row and port.decide(slot, free_blocks()) == "admit":
                break
            self._evict(by_slot[s], s)
            taken += 1
        return port.decide(slot, free_blocks()) == "admit"

    def _evict(self, req, slot: int) -> None:
        """Releases running ``req`` as SGLang's preempt_to_schedule does and tells the
        core (its progress first: the release resets it)."""
        adapter = self.kvadmit
        adapter.displaced(slot, req)
        batch = self.running_batch
        i = next(i for i, r in enumerate(batch.reqs) if r is req)
        batch.release_req(i, len(batch.reqs) - 1)
        batch.filter_batch(keep_indices=[j for j in range(len(batch.reqs)) if j != i])
        self.preempt_list.append(req)
