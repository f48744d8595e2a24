"""Trace-replay simulator: the engines' decisions on a virtual clock.

`kvadmit simulate` (kvadmit.simulate.cli) replays a workload (kvadmit.simulate.
workload) through each policy (kvadmit.simulate.policies) on the native engine
model or vLLM's real scheduler (kvadmit.simulate.engine), with time from a
step-time model (kvadmit.simulate.steptime), and reports goodput and friends
(kvadmit.simulate.metrics). `--instances N --router NAME` runs a fleet of native
engines behind a router instead (kvadmit.simulate.fleet, .routers, .fleet_cli).
"""
from kvadmit.simulate.engine import EngineShape, RawRun, run_native
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.policies import BUILTIN as POLICIES, PolicySpec, parse_policy
from kvadmit.simulate.run import at_load, capacity_rps, compare
from kvadmit.simulate.steptime import PRESETS, StepTimeModel, get_preset
from kvadmit.simulate.workload import Workload, agent_sessions, from_trace, synthetic

__all__ = ["EngineShape", "RawRun", "run_native", "Slo", "summarize", "POLICIES", "PolicySpec",
           "parse_policy", "at_load", "capacity_rps", "compare", "PRESETS", "StepTimeModel",
           "get_preset", "Workload", "agent_sessions", "from_trace", "synthetic"]
