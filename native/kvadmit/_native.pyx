# cython: language_level=3
"""kvadmit's compiled core: request ledger, admission policies, caps and victim
selection (core.pxi), and the native engine model (sim.pxi). The parts it
builds on are their own modules (each with a .pxd declaring its C-level API):
kvadmit._free_queue, _allocator, _curves, _length_model, _step_time and
_agent_window. Engine adapters, the simulator and the benchmarks import
everything from here."""

from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport ceil, isfinite, INFINITY
from libc.stdlib cimport llabs
from libc.stdint cimport int32_t, int64_t, uint64_t, INT64_MAX
from libcpp.algorithm cimport sort
from libcpp.deque cimport deque
from libcpp.map cimport map as cmap
from libcpp.pair cimport pair
from libcpp.queue cimport priority_queue
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._allocator cimport BlockAllocator
from kvadmit._arrival_gate cimport (ArrivalGate, ArrivalResult, Rejection, R_INVALID,
                                    R_KV_CAPACITY, R_QUEUE_FULL)
from kvadmit._curves cimport cdiv
from kvadmit._ledger cimport Ledger, ST_FREE, ST_RUNNING, ST_WAITING
from kvadmit._length_model cimport OutputLengthModel
from kvadmit._policies cimport Policy, make_policy
from kvadmit._slo_guard cimport SloGuard
from kvadmit._step_time cimport StepTimeFit
from kvadmit._victims cimport victim_order, victim_slot

# Re-exported: Python code and tests import the whole core from kvadmit._native.
from kvadmit._agent_window import next_agent_window
from kvadmit._allocator import bench_native_cycles
from kvadmit._arrival_gate import REJECT_REASONS
from kvadmit._curves import peak_blocks
from kvadmit._free_queue import BlockObjectQueue, FreeBlockQueue
from kvadmit._ledger import STATES
from kvadmit._length_model import next_quantile
from kvadmit._policies import POLICIES
from kvadmit._victims import VICTIMS
# (cimported types are C-level names here: their Python names are set explicitly)
globals().update(ArrivalResult=ArrivalResult, BlockAllocator=BlockAllocator,
                 OutputLengthModel=OutputLengthModel, Rejection=Rejection, StepTimeFit=StepTimeFit)

include "core.pxi"
include "sim.pxi"

COMPILED = True
"""Set only by the compiled module (tests check it is a real extension)."""
