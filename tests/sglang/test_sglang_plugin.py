"""kvadmit as an SGLang plug-in: discovery through SGLang's load_plugins(),
hooks present or absent, configuration from the environment and the command
line, and start-up stopping on a bad configuration or a missing hook target."""
import json
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

import sglang.srt.plugins as plugins  # noqa: E402
from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402

from kvadmit import ConfigError  # noqa: E402
from kvadmit.sglang import KvadmitStartupError, plugin  # noqa: E402


def all_hooks():
    return {**plugin.cli_hooks(), **plugin.engine_hooks()}


def test_entry_point_is_declared_and_loads():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvadmit"]
    assert len(eps) == 1 and eps[0].value == "kvadmit.sglang:register"
    assert eps[0].load() is plugin.register


def test_load_plugins_installs_every_hook(clean_plugins, monkeypatch):
    original = Scheduler.__dict__["get_prefill_adder_class"]
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"policy": "reserve"}))
    plugins.load_plugins()
    for target, (hook, _) in all_hooks().items():
        assert plugin.installed(target, hook) is None, target
        assert target in clean_plugins._patched
    wrapped = Scheduler.__dict__["get_prefill_adder_class"]
    assert wrapped is not original and wrapped.__wrapped__ is original
    # The static retraction-order method stays static (SGLang calls it on the instance).
    assert isinstance(ScheduleBatch.__dict__["_get_decode_retraction_order"], staticmethod)
    assert isinstance(ServerArgs.__dict__["from_cli_args"], classmethod)


def test_without_config_sglang_is_untouched(clean_plugins):
    engine_targets = list(plugin.engine_hooks())
    before = {t: _raw(t) for t in engine_targets}
    plugins.load_plugins()
    # Only the command-line hooks, which add a flag that does nothing unless given.
    assert set(clean_plugins._hooks) == set(plugin.cli_hooks())
    for target in engine_targets:
        assert _raw(target) is before[target], target
    args = prepare_server_args(["--model-path", "dummy"])
    assert isinstance(args, ServerArgs)
    import os
    assert "KVADMIT_CONFIG" not in os.environ


def test_sglang_plugins_whitelist(clean_plugins, monkeypatch):
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"policy": "peak"}))
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    plugins.load_plugins()
    assert dict(clean_plugins._hooks) == {}  # kvadmit skipped entirely

    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin, kvadmit")
    plugins.load_plugins()
    assert set(clean_plugins._hooks) == set(all_hooks())


@pytest.mark.parametrize("text, field", [
    ('{"policy": "fastest"}', "policy"),
    ('{"max_queued_requests": -1}', "max_queued_requests"),
    ('{"victim": "lifo", "no_such_key": 1}', "no_such_key"),
    ('{"policy": ', "not valid JSON"),
    ("null", "must be a JSON object of kvadmit's keys, got null"),
    ('{"polcy": "peak"}', "did you mean 'policy'?"),
    ('{"kvadmit": {"policy": "peak"}}', "without the 'kvadmit' wrapper"),   # vLLM's shape
    ('{"native_allocator": true}', "'native_allocator' is a vLLM-only setting"),
])
def test_bad_config_in_env_stops_startup(clean_plugins, monkeypatch, text, field):
    monkeypatch.setenv("KVADMIT_CONFIG", text)
    with pytest.raises(KvadmitStartupError) as info:
        plugins.load_plugins()  # SGLang swallows Exception from a plug-in, not this
    assert isinstance(info.value, SystemExit)
    assert field in str(info.value) and "KVADMIT_CONFIG" in str(info.value)


@pytest.mark.parametrize("name", ["KVADMIT_CONFG", "KV_ADMIT_CONFIG", "KVADMIT_CONF"])
def test_a_misspelt_config_variable_stops_startup(clean_plugins, monkeypatch, name):
    """Without KVADMIT_CONFIG SGLang runs without kvadmit: a variable whose name is a
    typo of it would turn admission control off without a word."""
    monkeypatch.setenv(name, '{"policy": "peak"}')
    with pytest.raises(KvadmitStartupError) as info:
        plugins.load_plugins()
    assert f"{name} is set, but kvadmit reads KVADMIT_CONFIG: did you mean KVADMIT_CONFIG?" \
        in str(info.value)


def test_missing_hook_target_raises(clean_plugins, monkeypatch):
    """An SGLang without Scheduler.get_prefill_adder_class: SGLang only logs the
    failed hook; kvadmit stops start-up and names the target and the version."""
    del Scheduler.get_prefill_adder_class  # clean_plugins puts it back afterwards
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"policy": "peak"}))
    with pytest.raises(KvadmitStartupError) as info:
        plugins.load_plugins()
    message = str(info.value)
    assert "sglang.srt.managers.scheduler.Scheduler.get_prefill_adder_class" in message
    assert "0.5.23" in message
    assert "_abort_on_queued_limit" not in message  # only what is missing is named


def test_hook_not_applied_is_detected(clean_plugins, monkeypatch):
    """A target patched before kvadmit registered is skipped by apply_hooks()
    (it is already in HookRegistry._patched); kvadmit notices."""
    clean_plugins._patched.add(plugin.T_STEP)
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"policy": "peak"}))
    with pytest.raises(KvadmitStartupError, match="get_next_batch_to_run: the target exists"):
        plugins.load_plugins()


def test_cli_flag_sets_env_for_the_ranks(clean_plugins, monkeypatch):
    plugins.load_plugins()  # no configuration yet: only the CLI hooks
    text = json.dumps({"policy": "reserve", "max_queued_requests": 8})
    args = prepare_server_args(["--model-path", "dummy", "--kvadmit-config", text])
    assert isinstance(args, ServerArgs)  # ServerArgs itself has no kvadmit field
    import os
    assert os.environ["KVADMIT_CONFIG"] == text
    # The scheduler hooks are installed in this process too (checked).
    for target, (hook, _) in plugin.engine_hooks().items():
        assert plugin.installed(target, hook) is None, target
    monkeypatch.delenv("KVADMIT_CONFIG")


def test_bad_cli_flag_stops_startup(clean_plugins, capsys):
    plugins.load_plugins()
    with pytest.raises(SystemExit) as info:
        prepare_server_args(["--model-path", "dummy", "--kvadmit-config", '{"policy": 3}'])
    assert info.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert "--kvadmit-config" in err and "policy=3" in err
    import os
    assert "KVADMIT_CONFIG" not in os.environ


def test_scheduler_init_builds_the_adapter(kvadmit_hooks, monkeypatch):
    from sglang_harness import Harness

    h = Harness(None)
    sched = h.sched
    sched.chunked_prefill_size = 512
    sched.metrics_reporter = None
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"policy": "adaptive", "victim": "length"}))
    plugin.around_scheduler_init(lambda self, *a, **k: None, sched)
    adapter = sched._kvadmit
    assert adapter.config.policy == "adaptive" and adapter.config.victim == "length"
    assert adapter.port.core.num_blocks == 2048 and adapter.port.core.block_size == 1
    assert adapter.config.prefill_chunk_tokens == 512  # taken from SGLang's chunk size
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"prefill_chunk_tokens": 0}))
    plugin.around_scheduler_init(lambda self, *a, **k: None, sched)
    assert sched._kvadmit.config.prefill_chunk_tokens == 0  # the operator's value wins

    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"policy": "nope"}))
    with pytest.raises(ConfigError, match="policy"):
        plugin.around_scheduler_init(lambda self, *a, **k: None, sched)
    # SGLang decodes its whole batch every step: a request cannot pause.
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"shortfall": "pause"}))
    with pytest.raises(ConfigError, match="shortfall='pause'"):
        plugin.around_scheduler_init(lambda self, *a, **k: None, sched)

    monkeypatch.delenv("KVADMIT_CONFIG")
    plugin.around_scheduler_init(lambda self, *a, **k: None, sched)
    assert sched._kvadmit is None  # no configuration: SGLang's own behaviour


def test_unsupported_server_is_refused(kvadmit_hooks, monkeypatch):
    from sglang_harness import Harness

    sched = Harness(None).sched
    sched.is_hybrid_swa = True
    sched.metrics_reporter = None
    monkeypatch.setenv("KVADMIT_CONFIG", "{}")
    with pytest.raises(RuntimeError, match="sliding-window"):
        plugin.around_scheduler_init(lambda self, *a, **k: None, sched)


def _raw(target):
    import pkgutil

    obj_path, _, attr = target.rpartition(".")
    return pkgutil.resolve_name(obj_path).__dict__.get(attr)


def test_empty_config_is_auto_with_sglangs_shortfall():
    """--kvadmit-config '{}' runs auto; SGLang cannot pause a request, so a shortfall
    preempts (retracts); an explicit pause is refused naming the key."""
    from kvadmit import ConfigError
    from kvadmit.sglang import settings
    cfg = settings.load_config("{}")
    assert (cfg.policy, cfg.shortfall, cfg.pause_on_shortfall, cfg.bypass_head_of_line) == \
        ("auto", "preempt", False, True)
    with pytest.raises(ConfigError, match="shortfall='pause'"):
        settings.load_config('{"shortfall": "pause"}')
