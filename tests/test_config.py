"""AdmissionConfig: defaults, JSON, and an error naming field, value and range."""
import dataclasses
import pathlib

import pytest

from kvadmit import AdmissionConfig, ConfigError
from kvadmit.vllm.settings import VllmSettings


def test_defaults_and_round_trip():
    c = AdmissionConfig()
    assert c.policy == "auto" and c.victim == "lifo" and c.max_queued_requests == 0
    assert c.pause_on_shortfall and c.bypass_head_of_line        # auto's own shortfall and bypass
    peak = c.replace(policy="peak")
    assert not peak.pause_on_shortfall and not peak.bypass_head_of_line
    assert AdmissionConfig.from_dict(c.to_dict()) == c
    assert AdmissionConfig.from_json('{"policy": "reserve", "max_queued_requests": 8}') == \
        c.replace(policy="reserve", max_queued_requests=8)
    assert AdmissionConfig.from_dict(None) == c


@pytest.mark.parametrize("values,needle", [
    ({"policy": "magic"}, "policy='magic': must be one of overcommit, reserve, peak, predict, adaptive, auto"),
    ({"victim": "random"}, "victim='random': must be one of lifo, priority, lcf, length"),
    ({"max_queued_requests": -1}, "max_queued_requests=-1: out of range [0, 1000000000]"),
    ({"max_queued_requests": 2.5}, "max_queued_requests=2.5: must be an integer"),
    ({"max_queued_requests": True}, "max_queued_requests=True: must be an integer"),
    ({"shed_lower_priority": 1}, "shed_lower_priority=1: must be true or false"),
    ({"adaptive_quantile": 0}, "adaptive_quantile=0: out of range (0.0, 1.0]"),
    ({"adaptive_quantile": 1.5}, "adaptive_quantile=1.5: out of range (0.0, 1.0]"),
    ({"adaptive_quantile": float("nan")}, "adaptive_quantile=nan: must be a number"),
    ({"drain_window_s": "30"}, "drain_window_s='30': must be a number"),
    ({"policy": "adaptive", "adaptive_quantile": 0.99, "adaptive_max_quantile": 0.95},
     "adaptive_max_quantile=0.95 must be >="),
    ({"retry_after_default_s": 10, "retry_after_max_s": 5}, "retry_after_max_s=5 must be >="),
    ({"polcy": "peak"}, "unknown key 'polcy'; did you mean 'policy'?"),
    ({"max_queue_requests": 8}, "unknown key 'max_queue_requests'; did you mean 'max_queued_requests'?"),
    ({"zzz": 1}, "unknown key 'zzz'; see `kvadmit config` for the keys"),
    ({"agent_interval_steps": 50}, "'agent_interval_steps' was replaced: use agent_interval_s"),
    ({"kvadmit": {"policy": "peak"}}, "without the 'kvadmit' wrapper"),
    # vLLM-only (kvadmit.vllm.settings): the core's config, SGLang and the simulator refuse it
    ({"native_allocator": True}, "'native_allocator' is a vLLM-only setting"),
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
    with pytest.raises(ConfigError, match="must be a JSON object of kvadmit's keys, got null"):
        AdmissionConfig.from_json("null")     # not "defaults": that is no caps


def test_unknown_key_error_suggests_one_key_not_all():
    with pytest.raises(ConfigError) as e:
        AdmissionConfig.from_dict({"polcy": "peak"})
    assert "victim" not in str(e.value) and len(str(e.value)) < 120


@pytest.mark.parametrize("settings", [
    {"kvadmitt": {"policy": "peak"}}, {"KVAdmit": {}}, {"kv_admit": {}}, {"kvadmit_config": {}},
    {"kvadmin": {}}, {"other_plugin": 1, "kvadmitt": {}},
])
def test_a_misspelt_section_is_an_error(settings):
    """vLLM's --additional-config is shared with other plug-ins: a key that looks like
    "kvadmit" but is not would leave kvadmit on its defaults (no caps), silently."""
    from kvadmit.config import section_from

    key = next(k for k in settings if k != "other_plugin")
    with pytest.raises(ConfigError) as e:
        section_from(settings, "--additional-config")
    assert f"unknown key {key!r}; did you mean 'kvadmit'?" in str(e.value)


@pytest.mark.parametrize("value, got", [(None, "null"), (3, "int"), ([1], "list")])
def test_a_null_or_scalar_section_is_an_error(value, got):
    from kvadmit.config import section_from

    with pytest.raises(ConfigError, match=f"'kvadmit' must be an object of kvadmit's keys, got {got}"):
        section_from({"kvadmit": value}, "--additional-config")


def test_other_plugins_keys_and_no_section_pass():
    from kvadmit.config import section_from

    assert section_from({"other_plugin": {"x": 1}, "admit": 2}, "x") == {}
    assert section_from(None, "x") == {}
    assert section_from({"kvadmit": {"policy": "peak"}}, "x") == {"policy": "peak"}


def test_docs_list_every_key_with_its_default():
    page = (pathlib.Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert AdmissionConfig.markdown_table() in page, \
        "docs/configuration.md's key table is stale: paste the output of `kvadmit config`"
    assert VllmSettings.markdown_table() in page, \
        "docs/configuration.md's vLLM-only key table is stale: paste the output of `kvadmit config`"
    for cls in (AdmissionConfig, VllmSettings):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in page


def test_vllm_only_settings_split_from_the_core_keys():
    """native_allocator is the vLLM adapter's, not the core's: split off, checked, and
    never a field of AdmissionConfig."""
    settings, core_keys = VllmSettings.split({"policy": "peak", "native_allocator": True})
    assert settings == VllmSettings(native_allocator=True) and core_keys == {"policy": "peak"}
    assert VllmSettings.split({}) == (VllmSettings(), {})
    assert "native_allocator" not in {f.name for f in dataclasses.fields(AdmissionConfig)}
    with pytest.raises(ConfigError, match="native_allocator='yes': must be true or false"):
        VllmSettings.split({"native_allocator": "yes"})


def test_kvadmit_config_prints_both_tables():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "kvadmit.cli", "config"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert AdmissionConfig.markdown_table() in out and VllmSettings.markdown_table() in out


def test_the_core_config_knows_no_adapter_key_yet_every_engine_names_them():
    """kvadmit.config names no adapter's key (kvadmit.vllm.settings registers its own);
    a process that imports only the core's config (SGLang's plug-in, the simulator)
    still refuses a vLLM-only key by name, not as "unknown"."""
    import subprocess
    import sys
    from kvadmit import config
    source = pathlib.Path(config.__file__).read_text()
    assert "native_allocator" not in source and "kvadmit.vllm" not in source
    script = ("from kvadmit.config import AdmissionConfig, ConfigError\n"
              "try:\n    AdmissionConfig.from_dict({'native_allocator': True})\n"
              "except ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "'native_allocator' is a vLLM-only setting" in out and "unknown key" not in out
    with pytest.raises(ValueError, match="'policy' is a key of the core's AdmissionConfig"):
        config.register_adapter_keys(["policy"], "is taken")


@pytest.mark.parametrize("policy, shortfall, expected", [
    ("auto", "auto", "preempt"),          # auto would pause: the engine cannot
    ("peak", "auto", "preempt"),          # would not pause anyway: the same, resolved
    ("auto", "preempt", "preempt"),
    ("auto", "pause", None),              # an explicit pause the engine cannot do
])
def test_shortfall_is_resolved_once_for_an_engine_that_cannot_pause(policy, shortfall, expected):
    cfg = AdmissionConfig(policy=policy, shortfall=shortfall)
    assert cfg.for_engine(None) is cfg                # an engine that can pause keeps it
    if expected is None:
        with pytest.raises(ConfigError, match="shortfall='pause': no pausing here; use "
                                              "shortfall='preempt'"):
            cfg.for_engine("no pausing here")
        return
    out = cfg.for_engine("no pausing here")
    assert out.shortfall == expected and not out.pause_on_shortfall
