"""kvadmit's benchmarks on vLLM's real engine, beside the simulator's (kvadmit.simulate):

- `vllm`: `kvadmit bench vllm`, vLLM's engine in this process (`LLM.generate`), one
  engine per configuration on one workload (`python -m kvadmit.bench.vllm`);
- `serve`: `kvadmit bench serve`, goodput against load on `vllm serve`, driven by
  vLLM's own load generator (`python -m kvadmit.bench.serve`).

The adapter itself (kvadmit.vllm) imports nothing from here; the benches' code that
vLLM loads by name (the counting schedulers, the stop-at logits processor) lives in
`kvadmit.bench.vllm`.
"""
