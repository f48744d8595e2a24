"""The engine side of `bench/noisy_neighbour_serve.py --split-ttft`: on the server it
is put on PYTHONPATH with KVADMIT_TTFT_SPLIT_DIR set, and Python imports it at start-up
in every process. In the engine core it wraps vLLM's own `Scheduler` (kvadmit's
scheduler subclasses it and calls it, so both configs are seen alike) and writes, one
JSON line each, to DIR/engine.<pid>.jsonl:

  {"ev": "add", "t": wall time, "id": request id, "key": its first 8 prompt tokens,
   "arrival": when the API server took it in (vLLM's arrival_time, wall time)}
  {"ev": "sched", "t": wall time, "new": ids the step starts}
  {"ev": "out", "t": wall time, "first": ids whose first token the step emitted}

A bench tool, not part of kvadmit: nothing is patched without the variable."""
import os

_DIR = os.environ.get("KVADMIT_TTFT_SPLIT_DIR")


def _install(Scheduler):
    import json
    import time

    out = {}

    def write(rec):
        f = out.get("f")
        if f is None:
            f = out["f"] = open(os.path.join(_DIR, f"engine.{os.getpid()}.jsonl"), "a", buffering=1)
        f.write(json.dumps(rec) + "\n")

    add, schedule, update = Scheduler.add_request, Scheduler.schedule, Scheduler.update_from_output
    first_seen = set()

    def add_request(self, request):
        write({"ev": "add", "t": time.time(), "id": request.request_id,
               "key": list(request.prompt_token_ids[:8]),
               "arrival": getattr(request, "arrival_time", None)})
        return add(self, request)

    def schedule_(self, *a, **k):
        result = schedule(self, *a, **k)
        new = [r.req_id for r in result.scheduled_new_reqs]
        if new:
            write({"ev": "sched", "t": time.time(), "new": new})
        return result

    def update_from_output(self, *a, **k):
        result = update(self, *a, **k)
        first = []
        for eco in result.values():
            for o in eco.outputs:
                if o.new_token_ids and o.request_id not in first_seen:
                    first_seen.add(o.request_id)
                    first.append(o.request_id)
        if first:
            write({"ev": "out", "t": time.time(), "first": first})
        return result

    Scheduler.add_request, Scheduler.schedule = add_request, schedule_
    Scheduler.update_from_output = update_from_output


class _AfterImport:
    """A meta-path finder that wraps vLLM's scheduler module once it is loaded (so a
    process that never imports it, the resource tracker, stays as it was)."""
    TARGET = "vllm.v1.core.sched.scheduler"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET:
            return None
        import importlib.machinery
        import sys
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _install(module.Scheduler)
            sys.meta_path.remove(self)
        spec.loader.exec_module = exec_module
        return spec


if _DIR:
    import sys
    sys.meta_path.insert(0, _AfterImport())
