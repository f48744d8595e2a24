"""Bad input, fuzzed, on `vllm serve` (issue 53): bench/fuzz_serve.py's run, smaller.
Its two servers (token-id prompts with untrusted fields ignored; the tokenizer, chat
too, with untrusted fields refused and priority scheduling), each with flows, a gateway
secret and trusted_proxies, take 100 of its seeded junk requests each (headers and body
fields: wrong types, huge numbers, NaN, unicode, 64 KiB values, repeated headers; half
streaming). Every request is served or answered with a 4xx, a 400 kvadmit gives names
the field, none is a 5xx; the engine lives through it (process alive, /health 200 with
kvadmit's state ok, no kvadmit internal error) and every KV block is back at idle."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import fuzz_serve as fs  # noqa: E402

PER_SERVER = 100


def test_junk_requests_are_served_or_refused_naming_the_field_and_the_engine_lives(model_dir,
                                                                                   tmp_path):
    results = [fs.run_setup(setup, model_dir, range(k * PER_SERVER, (k + 1) * PER_SERVER), 0,
                            tmp_path / f"{setup.label}.log")
               for k, setup in enumerate(fs.SETUPS)]
    for r in results:
        summary = {k: r[k] for k in ("setup", "statuses", "end", "tracebacks")}
        assert r["answered"] == r["requests"] == PER_SERVER, summary
        assert r["server_errors"] == [] and r["no_answer"] == [], r
        assert r["unnamed_400s"] == [], r
        assert r["end"]["ok"], summary
        # the run means something: some served, some refused by kvadmit as invalid
        assert r["statuses"].get("200", 0) >= 10, summary
        assert r["statuses"].get("400 kvadmit:invalid", 0) >= 1, summary
    # untrusted raises are refused with 400 on the second server
    assert results[1]["statuses"].get("400 kvadmit:untrusted_field", 0) >= 1, results[1]["statuses"]
