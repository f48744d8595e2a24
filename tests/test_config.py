"""AdmissionConfig: defaults, JSON, and an error naming field, value and range."""
import dataclasses
import pathlib

import pytest

from kvadmit import AdmissionConfig, ConfigError


def test_defaults_and_round_trip():
    c = AdmissionConfig()
    assert c.policy == "peak" and c.victim == "lifo" and c.max_queued_requests == 0
    assert AdmissionConfig.from_dict(c.to_dict()) == c
    assert AdmissionConfig.from_json('{"policy": "reserve", "max_queued_requests": 8}') == \
        c.replace(policy="reserve", max_queued_requests=8)
    assert AdmissionConfig.from_dict(None) == c


@pytest.mark.parametrize("values,needle", [
    ({"policy": "magic"}, "policy='magic': must be one of overcommit, reserve, peak, predict, adaptive"),
    ({"victim": "random"}, "victim='random': must be one of lifo, priority, lcf, length"),
    ({"max_queued_requests": -1}, "max_queued_requests=-1: out of range [0, 1000000000]"),
    ({"max_queued_requests": 2.5}, "max_queued_requests=2.5: must be an integer"),
    ({"max_queued_requests": True}, "max_queued_requests=True: must be an integer"),
    ({"shed_lower_priority": 1}, "shed_lower_priority=1: must be true or false"),
    ({"adaptive_quantile": 0}, "adaptive_quantile=0: out of range (0.0, 1.0]"),
    ({"adaptive_quantile": 1.5}, "adaptive_quantile=1.5: out of range (0.0, 1.0]"),
    ({"adaptive_quantile": float("nan")}, "adaptive_quantile=nan: must be a number"),
    ({"drain_window_s": "30"}, "drain_window_s='30': must be a number"),
    ({"adaptive_quantile": 0.99, "adaptive_max_quantile": 0.95}, "adaptive_max_quantile=0.95 must be >="),
    ({"retry_after_default_s": 10, "retry_after_max_s": 5}, "retry_after_max_s=5 must be >="),
    ({"polcy": "peak"}, "unknown key 'polcy'; known keys: adaptive_bucket_tokens"),
])
def test_errors_name_the_field(values, needle):
    with pytest.raises(ConfigError) as e:
        AdmissionConfig.from_dict(values)
    assert needle in str(e.value)


def test_bad_json_and_bad_type():
    with pytest.raises(ConfigError, match="not valid JSON"):
        AdmissionConfig.from_json("{policy: peak}")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        AdmissionConfig.from_json("[1, 2]")


def test_docs_list_every_key_with_its_default():
    page = (pathlib.Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert AdmissionConfig.markdown_table() in page, \
        "docs/configuration.md's key table is stale: paste the output of `kvadmit config`"
    for f in dataclasses.fields(AdmissionConfig):
        assert f"`{f.name}`" in page
