"""The load reports newer routers read, on `vllm serve` with kvadmit (issue 44):

- `GET /v1/loads?include=core,disagg,queues,memory`, SMG 1.13's probe
  (patches/vllm_get_load.py): SGLang's schema with kvadmit's numbers, idle and while
  requests wait, consistent with the same moment's /metrics;
- the series docs/router.md's llm-d EPP configuration names (the YAML block is read
  from the page): each there once in /metrics, a gauge, with the spec's labels and the
  values' meaning (prometheus_client's text parser, as the EPP's own scrape parses it);
- a real SMG (`smg launch`, skipped where it is not installed) in front of two
  kvadmit instances: it parses their /v1/loads (its `GET /workers` shows what it
  read) and sends requests to the idle one while the other's forecast fills its pool.

One server is busy by the same recipe as test_serve_refusals.py: a streamed filler
of 40 + 1000 tokens ends on 33 of the 34 blocks, and two requests of 40 + 1020 tokens
(the whole pool alone) wait for the whole filler.
"""
import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving import free_port, metrics, running_server, serve_command

CONFIG = {"kvadmit": {"policy": "peak", "max_queued_requests": 4}}
PROBE = "/v1/loads?include=core,disagg,queues,memory"       # SMG 1.13's exact probe
DOCS = Path(__file__).resolve().parents[2] / "docs" / "router.md"
FILL, LONG = 1000, 1020


def start(model_dir, tmp_path_factory, name):
    log = tmp_path_factory.mktemp(name) / "serve.log"
    cmd = serve_command(model_dir, free_port(), CONFIG, tokenizer=True, blocks=35,
                        max_model_len=1088)
    return running_server(cmd, log)     # kvadmit's launcher turns multiprocess mode on


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with start(model_dir, tmp_path_factory, "a") as base:
        yield base, model_dir


def get_json(url, timeout=10):
    return json.loads(urllib.request.urlopen(url, timeout=timeout).read())


def prompt(seed, n=40):
    return [(seed * 7919 + i) % 997 + 3 for i in range(n)]


class Busy:
    """A filler streaming on `base` and two long requests waiting behind it."""

    def __init__(self, base, model):
        self.base, self.model, self.results = base, model, {}
        self.running, self.done = threading.Event(), threading.Event()
        self.threads = [threading.Thread(target=self.filler)]

    def body(self, seed, n_tokens, stream):
        return {"model": self.model, "prompt": prompt(seed), "max_tokens": n_tokens,
                "temperature": 0, "ignore_eos": True, "stream": stream}

    def filler(self):
        with httpx.Client(timeout=300) as c, c.stream(
                "POST", self.base + "/v1/completions", json=self.body(10, FILL, True)) as r:
            for _ in r.iter_lines():
                self.running.set()
            self.results["filler"] = r.status_code
        self.running.set()
        self.done.set()

    def waiter(self, seed):
        r = httpx.post(self.base + "/v1/completions", json=self.body(seed, LONG, False),
                       timeout=300)
        self.results[seed] = r.status_code

    def __enter__(self):
        self.threads[0].start()
        assert self.running.wait(120) and not self.done.is_set(), self.results
        for seed in (11, 12):
            self.threads.append(threading.Thread(target=self.waiter, args=(seed,)))
            self.threads[-1].start()
        deadline = time.time() + 30
        while time.time() < deadline and not self.done.is_set():
            if metrics(self.base).get("kvadmit_waiting_requests") == 2:
                return self
            time.sleep(0.2)
        pytest.fail(f"the two long requests did not wait: {metrics(self.base)}")

    def __exit__(self, *exc):
        for t in self.threads:
            t.join(300)
        assert self.results == {"filler": 200, 11: 200, 12: 200}, self.results


def check_report(report, scraped):
    """SMG's schema (its SchedulerLoadSnapshot's i32 fields as JSON integers) and
    kvadmit's numbers of the same moment's /metrics."""
    assert isinstance(report["timestamp"], str) and report["version"]
    assert report["dp_rank_count"] == 1 and len(report["loads"]) == 1
    rank, extra = report["loads"][0], report["kvadmit"]
    for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs",
                "num_waiting_uncached_tokens"):
        assert type(rank[key]) is int, (key, rank)
    assert extra["source"] == "kvadmit", report
    assert rank["num_waiting_reqs"] == scraped["kvadmit_waiting_requests"]
    assert rank["queues"] == {"waiting": rank["num_waiting_reqs"]}
    assert rank["token_usage"] == round(min(1.0, extra["admission_pressure"]), 4)
    rate = rank["gen_throughput"] or 2000.0
    assert rank["num_waiting_uncached_tokens"] == math.ceil(extra["predicted_queue_delay_s"]
                                                            * rate)
    assert not {"memory", "disagg_mode"} & set(rank)
    return rank, extra


def test_v1_loads_reports_kvadmits_state_idle_and_while_requests_wait(server):
    base, model = server
    idle_scrape = metrics(base)
    idle = get_json(base + PROBE)
    rank, extra = check_report(idle, idle_scrape)
    assert rank["num_waiting_reqs"] == 0 and rank["num_running_reqs"] == 0
    assert extra["admission_pressure"] == 0.0 and rank["num_waiting_uncached_tokens"] == 0
    assert "queues" not in get_json(base + "/v1/loads")["loads"][0]     # include= honoured
    with Busy(base, model) as busy:
        scraped = metrics(base)
        report = get_json(base + PROBE)
        assert not busy.done.is_set()
        rank, extra = check_report(report, scraped)
        assert rank["num_waiting_reqs"] == 2 and rank["num_running_reqs"] == 1
        assert rank["num_total_reqs"] == 3
        # the filler's forecast peak (33 blocks) and two whole-pool prompts waiting
        assert extra["admission_pressure"] > 1.0 and rank["token_usage"] == 1.0


# ---- llm-d: the series the documented EPP configuration names -------------------------

def epp_config():
    text = DOCS.read_text()
    block = re.search(r"<!-- llm-d-epp-config[^>]*-->\s*```yaml\n(.*?)```", text, re.S)
    assert block, "docs/router.md lost its llm-d EPP configuration block"
    return yaml.safe_load(block.group(1))


def epp_specs(config):
    """attribute -> PromQL selector, for the kvadmit engine config's specs the EPP
    reads (the standard ones and customMetrics)."""
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    specs = {key: engine[key] for key in ("queuedRequestsSpec", "runningRequestsSpec",
                                         "kvUsageSpec")}
    specs.update({m["attributeKey"]: m["metricSpec"] for m in engine["customMetrics"]})
    return specs


def selector(spec):
    """`name{a=b,c="d"}` (the EPP's spec.go accepts both) -> (name, labels)."""
    name, _, labels = spec.partition("{")
    pairs = re.findall(r'(\w+)\s*=\s*"?([^",}]+)"?', labels)
    return name.strip(), dict(pairs)


def test_the_documented_epp_config_is_consistent():
    config = epp_config()
    specs = epp_specs(config)
    assert specs["kvUsageSpec"] == "kvadmit_admission_pressure"
    assert "kvadmit_predicted_queue_delay_seconds" in specs.values()
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = {ref["pluginRef"] for prof in config["schedulingProfiles"] for ref in prof["plugins"]}
    refs |= {config["flowControl"]["saturationDetector"]["pluginRef"]}
    refs |= {e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]}
    refs |= {s["pluginRef"] for s in config["dataLayer"]["sources"]}
    assert refs <= names, refs - names
    for plugin in config["plugins"]:
        if plugin["type"] == "endpoint-attribute-scorer":
            assert plugin["parameters"]["attributeKey"] in specs, plugin
    (detector,) = [p for p in config["plugins"] if p["type"] == "utilization-detector"]
    assert 0 < detector["parameters"]["kvCacheUtilThreshold"] <= 1.0


def scrape(base, specs):
    """Each spec's one matching sample in /metrics, with its family's type."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    found = {}
    for attribute, spec in specs.items():
        name, labels = selector(spec)
        family = families.get(name)
        assert family is not None, f"{spec}: no such family in /metrics"
        assert family.type == "gauge", (spec, family.type)
        samples = [s for s in family.samples if s.name == name
                   and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(samples) == 1, (spec, samples)
        found[attribute] = samples[0].value
    return found


def test_metrics_serve_every_series_the_epp_config_names_as_gauges(server):
    base, model = server
    specs = epp_specs(epp_config())
    delay = "kvadmit.predicted_queue_delay_seconds"
    idle = scrape(base, specs)
    assert idle["kvUsageSpec"] == idle["kvadmit.admission_pressure"] == 0.0
    assert idle[delay] == 0.0 and idle["queuedRequestsSpec"] == 0.0
    with Busy(base, model) as busy:
        values = scrape(base, specs)
        assert not busy.done.is_set()
    assert values["kvUsageSpec"] == values["kvadmit.admission_pressure"] > 1.0   # [0, inf)
    assert values[delay] >= 0.0 and math.isfinite(values[delay])                  # seconds
    assert values["queuedRequestsSpec"] == 2.0 and values["runningRequestsSpec"] == 1.0


# ---- a real SMG in front of two kvadmit instances ---------------------------------------

@pytest.fixture(scope="module")
def smg_binary():
    path = shutil.which("smg") or shutil.which("smg", path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip("SMG is not installed (pip install smg==1.13.0)")
    return path


@pytest.fixture(scope="module")
def fleet(smg_binary, server, model_dir, tmp_path_factory):
    base_a, model = server
    with start(model_dir, tmp_path_factory, "b") as base_b:
        port = free_port()
        log = tmp_path_factory.mktemp("smg") / "smg.log"
        cmd = [smg_binary, "launch", "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-urls", base_a, base_b, "--policy", "power_of_two",
               "--load-monitor-interval", "1"]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        router = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while sum(bool(load) for load in smg_loads(router, quiet=True).values()) < 2:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"SMG did not read both workers' loads: {log.read_text()[-3000:]}")
                time.sleep(1)
            yield router, base_a, base_b, model, log
        finally:
            proc.terminate()
            proc.wait(30)


def smg_loads(router, quiet=False):
    """What SMG read from each worker's /v1/loads: its `GET /workers` shows each
    worker's `engine_load`, its own WorkerLoadResponse re-serialized (SMG 1.13 has no
    router-level /v1/loads; its /get_loads flattens the same numbers)."""
    try:
        workers = get_json(router + "/workers")["workers"]
    except OSError:
        if quiet:
            return {}
        raise
    return {w["url"]: w.get("engine_load") for w in workers}


def test_smg_parses_kvadmits_v1_loads(fleet):
    router, base_a, base_b, model, log = fleet
    workers = smg_loads(router)
    assert set(workers) == {base_a, base_b}, workers
    for details in workers.values():
        # SMG re-serializes its own WorkerLoadResponse: kvadmit's extra object is gone,
        # the version is the worker's (vLLM's), and what is left is its parse of the report
        assert "kvadmit" not in details and details["dp_rank_count"] == 1, details
        assert details["version"] == get_json(base_a + PROBE)["version"], details
        (rank,) = details["loads"]
        assert rank["num_waiting_reqs"] == 0 and rank["token_usage"] == 0.0, rank
        assert rank["queues"]["waiting"] == 0, rank
    r = httpx.post(router + "/v1/completions", timeout=120,
                   json={"model": model, "prompt": "Hello there", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text


def test_smg_routes_around_the_instance_whose_forecast_fills_its_pool(fleet):
    """While A holds a filler whose forecast peak is 33 of its 34 blocks from its
    first token, and two requests wait: SMG reads A's report (waiting 2, token_usage
    1.0: kvadmit's pressure, over SMG's default overload threshold of 0.8) and sends
    every request to B. Which of SMG's rules decided (the overload veto, or
    power_of_two's expected-wait comparison, which A's queue also loses) is not
    separated here."""
    router, base_a, base_b, model, log = fleet
    with Busy(base_a, model) as busy:
        deadline = time.time() + 30
        while time.time() < deadline:
            seen = {url: load["loads"][0] for url, load in smg_loads(router).items()}
            if seen[base_a].get("num_waiting_reqs") == 2:
                break
            time.sleep(0.5)
        assert seen[base_a]["token_usage"] == 1.0 and seen[base_a]["num_waiting_reqs"] == 2
        kv_now = metrics(base_a).get("vllm:kv_cache_usage_perc", 0.0)
        arrived = {b: metrics(b).get("kvadmit_arrived_total", 0.0) for b in (base_a, base_b)}
        for i in range(6):
            r = httpx.post(router + "/v1/completions", timeout=120,
                           json={"model": model, "prompt": f"Hello {i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert not busy.done.is_set()
        after = {b: metrics(b).get("kvadmit_arrived_total", 0.0) for b in (base_a, base_b)}
    assert after[base_a] == arrived[base_a], (arrived, after, kv_now)
    assert after[base_b] == arrived[base_b] + 6, (arrived, after)
