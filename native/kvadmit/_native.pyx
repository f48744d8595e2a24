# cython: language_level=3
"""kvadmit's compiled core, in one import. Each part is its own module with a
.pxd declaring its C-level API (native/kvadmit/):

- _core: AdmissionCore, the sequencer: a request's path through the parts below;
- _core_view: its base, the parts it holds and every read and stat over them;
- _arrival: the arrival record, one request's numbers as the core takes them;
- _ledger: every request's numbers, by slot, and every state transition;
- _waiting_queue: the queue's order, the bypass scan, shedding's order;
- _decision: may a waiting request start, may an arrival be queued;
- _shortfall: the pause planner (shortfall "pause");
- _step_plan: the step planner: displacement and pauses for one engine step, as
  every engine runs them (prompt_need, the watermark beside a starting request);
- _policies: may a waiting request start? (one Policy subclass per policy);
- _curves: KV curves and their exact peak (the peak rule's arithmetic);
- _length_model: recent output lengths and the adaptive quantile controller;
- _arrival_gate: queue caps, refusals, drain rate and Retry-After;
- _slo_guard and _step_time: TTFT and TPOT guard, the step-time fit;
- _agent_window: the active-agent window (CONCUR);
- _session_hold: clients' kv_hold_s: which sessions' cached KV is evicted first, and when;
- _victims: which running request gives its KV back first;
- _free_queue and _allocator: the KV block pool and prefix cache;
- _requests: Requests, a workload's requests in checked columns;
- _engine_state and _native_engine: NativeEngine, the simulator's continuous-batching
  model (its requests and KV; its step loop).

Engine adapters, the simulator and the benchmarks import everything from here."""

from kvadmit._agent_window import next_agent_window
from kvadmit._allocator import BlockAllocator, bench_native_cycles
from kvadmit._arrival import FIELDS as ARRIVAL_FIELDS
from kvadmit._arrival_gate import REJECT_REASONS, ArrivalResult, Rejection
from kvadmit._core import DECISIONS, AdmissionCore
from kvadmit._curves import peak_blocks
from kvadmit._free_queue import BlockObjectQueue, FreeBlockQueue
from kvadmit._ledger import STATES
from kvadmit._length_model import OutputLengthModel, next_quantile
from kvadmit._native_engine import NativeEngine
from kvadmit._policies import POLICIES
from kvadmit._requests import Requests
from kvadmit._session_hold import SessionHold
from kvadmit._step_plan import StepPlanner, prompt_blocks
from kvadmit._step_time import StepTimeFit
from kvadmit._victims import VICTIMS

COMPILED = True
"""Set only by the compiled module (tests check it is a real extension)."""
