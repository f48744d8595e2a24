"""Real vLLM engine, same workload, vLLM's scheduler against each kvadmit policy.

Runs `vllm.LLM.generate` once per configuration in this process (one engine
at a time) on a tiny random-weight Llama built locally, and reports per
configuration: preemptions, recomputed tokens, engine steps, wall time, output
tokens/s, TTFT and TPOT p50/p99, rejections, and whether every request
produced exactly its expected tokens.

Real output lengths shorter than `max_tokens` are made real: each request
carries its trace length, and the `StopAtLength` logits processor makes the
model emit EOS at exactly that position (finish_reason "stop"), so the
scheduler sees a `max_tokens` cap it cannot trust, as in production.

    python -m kvadmit.bench.vllm --workload azure --json out.json

One module per job:

- `hooks`: what runs inside vLLM's engine (the counting schedulers);
- `stop_at`: the logits processor that stops a request at its real length;
- `workload`: the requests (synthetic, or an Azure trace scaled to the context);
- `configs`: the engine shape and the configurations `--configs` names;
- `run`: one engine per configuration, in a rotated order after a warm-up;
- `output`: the table, the JSON and the chart;
- `suite`: `--suite`, beside the simulator's native engine;
- `cli`: the command line (`kvadmit bench vllm`).

The names below are re-exported for those who load them by this package's name (vLLM's
`scheduler_cls="kvadmit.bench.vllm.CountingScheduler"` and
`--logits-processors kvadmit.bench.vllm:StopAtLength`, bench/ scripts, tests); each is
imported on first use, so `kvadmit.bench.vllm.workload` and `.configs` need no vLLM.
"""

_EXPORTS = {
    "hooks": ("COUNTS_ENV", "EXPECT_ENV", "STEP_TIMES_ENV", "CountingScheduler",
              "CountingKvadmitAsyncScheduler", "CountingKvadmitScheduler",
              "CountingVllmAsyncScheduler", "CountingVllmScheduler", "TimingVllmScheduler"),
    "stop_at": ("STOP_AT_KEY", "StopAtLength"),
    "workload": ("DEFAULT_TRACE", "BenchRequest", "as_burst", "azure_workload", "build_workload",
                 "synthetic_workload"),
    "configs": ("CONFIGS", "CONFIG_DOCS", "DEFAULT_CONFIG", "BenchConfig", "BenchEngine",
                "default_configs", "parse_config", "split_configs"),
    "run": ("run_configs", "run_one", "run_order", "warm_up"),
    "output": ("PLOT_COLOURS", "PLOT_MARKS", "best_watermark", "plot", "plot_marks",
               "print_table", "ratios", "save_json"),
    "suite": ("SUITE", "SUITE_CONFIGS", "SuiteCase", "run_suite"),
    "cli": ("main",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
