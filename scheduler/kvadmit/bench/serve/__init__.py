"""`kvadmit bench serve`: the online benchmark. Goodput against load, past saturation,
on `vllm serve`, driven by vLLM's own load generator (`vllm bench serve`).

One `vllm serve` per config runs on 127.0.0.1 (the tiny local model with its
tokenizer, a small KV pool), all started before the sweep. The capacity is measured
first: every request at once (`--request-rate inf`) on vLLM's default server, and
capacity = completed requests / duration. Then each point of the sweep is one
`vllm bench serve` run: Poisson arrivals (`--burstiness`: gamma-distributed gaps,
1 = Poisson) at `--load` times the capacity, the same requests and the same arrival
seed for every config. The configs are interleaved (every point runs on every
server, in a rotated order) and every point is repeated (`--repeats`, a new arrival
seed each time); the table gives medians with their min-max spread, counts first.

Requests come from the Azure conversation trace, lengths scaled as in `kvadmit bench
vllm` (max_model_len / 8192), and each stops at its real length: the server loads the
bench's stop-at logits processor (`--logits-processors
kvadmit.bench.vllm:StopAtLength`) and each request carries its length in `vllm_xargs`
(`kvadmit_stop_at`, with `min_tokens` one less) and the scaled cap as `max_tokens`,
which the scheduler cannot trust. `vllm bench serve` sends a custom dataset (JSONL)
for this; its rows' `request_overrides` become the per-request body fields
(`kvadmit bench serve client`). With `--fixed-length N` a second sweep runs
vLLM's random dataset unchanged (`--random-output-len N --ignore-eos`: every
max_tokens honest) on vLLM's default and kvadmit's default.

Per point: goodput (the share of requests meeting both --ttft-ms and --tpot-ms, by
`vllm bench serve --goodput`), TTFT and TPOT p50/p99, output tokens/s, preemptions
(the server's `vllm:num_preemptions_total`, before and after), the prefill tokens
recomputed after preemptions and their share of all prefill computed (RFC #54644's
measure; vLLM counts no recompute, so each server's scheduler is the config's own
counting it: `recompute`, `points.recompute_counts`), refusals per kvadmit
reason (the server's `kvadmit_rejected_total`) and per HTTP status (the client's
errors: 429 (or 503, per `overload_status`)/400 before a stream starts; 200 when the refusal came inside the stream).

    kvadmit bench serve --requests 200 --load 0.25 0.5 1 1.5 2 --repeats 2
    kvadmit bench serve client [vllm bench serve flags]   # vLLM's client, CPU build

One module per job:

- `configs`: the configs `--configs` names (which server each row is);
- `loadgen`: vLLM's load generator (`vllm bench serve`, in this process) and the trace
  rows it sends;
- `server`: one `vllm serve` per config (kvadmit.vllm.serve's launcher), its /metrics;
- `recompute`: the servers' schedulers, counting the prefill they recompute;
- `points`: one `vllm bench serve` run against a server, and the sweep of them;
- `report`: the medians, the goal figures, the table and the chart;
- `cli`: the command line, and the run's sections and JSON.
"""
