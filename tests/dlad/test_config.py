"""dlad.config: the shipped etc/dlad.toml loads and plans; every way a config can be wrong is a
ConfigError naming the file and the key path; every field is documented."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dlad.config as config_module
from dlad.config import (
    Config,
    ConfigError,
    DaemonConfig,
    DeviceConfig,
    FaultConfig,
    FrontendConfig,
    LoggingConfig,
    MetricsConfig,
    PrePostConfig,
    endpoint_problem,
    load_config,
    parse_config,
)
from dlad.loadable import read_loadable, write_loadable
from dlad.models import DEMO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "etc" / "dlad.toml"
SHIPPED_TEXT = SHIPPED.read_text()
SHIPPED_DATA = tomllib.loads(SHIPPED_TEXT)


def write(tmp_path: Path, text: str, name: str = "dlad.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def add_to_table(text: str, table: str, line: str) -> str:
    """``line`` added to ``[table]`` of ``text`` (the root table for "")."""
    if not table:
        return f"{line}\n{text}"
    return replace_once(text, f"[{table}]\n", f"[{table}]\n{line}\n")


def expect_error(path: Path, key: str) -> ConfigError:
    """load_config(path) must fail on ``key``, naming the file as given and the key."""
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.file, err.key) == (str(path), key), str(err)
    assert str(err).startswith(f"{path}: {key}: "), str(err)
    assert err.reason
    assert str(err).endswith(err.reason)
    return err


# ----------------------------------------------------------------------------- the shipped file


def test_shipped_config_loads_and_plans() -> None:
    config = load_config(SHIPPED)
    assert config.source == SHIPPED
    assert [(d.name, d.kind, d.core) for d in config.devices] == [
        ("dla0", "dla", 0),
        ("dla1", "dla", 1),
        ("gpu", "gpu", None),
    ]
    assert config.frontend.endpoints == ("tcp://127.0.0.1:5555",)
    assert config.model("demo").devices == ("dla0", "dla1", "gpu")
    plan = config.plan()
    assert plan.config is config
    assert plan.base_dir == SHIPPED.parent
    assert plan.endpoints == config.frontend.endpoints
    assert [(p.model, p.device) for p in plan.placements] == [
        ("demo", "dla0"), ("demo", "dla1"), ("demo", "gpu")]  # fmt: skip
    for p, core in zip(plan.placements, (0, 1, 0), strict=True):  # the gpu takes core 0's
        assert p.path == DEMO / f"fp16_heads.dla{core}.emu"
        assert p.path.is_absolute()
        assert p.loadable == read_loadable(p.path, expect_core=core)
        assert p.latency_us == p.loadable.latency_us > 0  # no override in the shipped file
    assert plan.for_device("dla1") == plan.placements[1:2]
    assert plan.for_model("demo") == plan.placements
    assert plan.for_device("gpu") == plan.placements[2:]
    assert plan.for_model("nope") == ()


def test_config_is_frozen_and_planning_leaves_it_unchanged() -> None:
    config = load_config(SHIPPED)
    before = copy.deepcopy(config)
    config.plan()
    assert config == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.daemon = DaemonConfig()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.devices[0].queue_depth = 9  # type: ignore[misc]
    with pytest.raises(KeyError):
        config.device("dla7")
    with pytest.raises(KeyError):
        config.model("nope")


def test_omitted_sections_and_keys_take_the_documented_defaults() -> None:
    data = {
        "devices": {"dla0": {"kind": "dla", "core": 0}},
        "models": {"m": {"devices": ["dla0"], "loadables": {"core0": "bundled:demo/x.emu"}}},
    }
    config = parse_config(data)
    assert (config.daemon, config.frontend, config.logging) == (
        DaemonConfig(),
        FrontendConfig(),
        LoggingConfig(),
    )
    assert (config.metrics, config.pre_post) == (MetricsConfig(), PrePostConfig())
    assert config.devices == (DeviceConfig(name="dla0", kind="dla", core=0),)
    assert config.devices[0].faults == FaultConfig()
    assert config.source is None
    model = config.model("m")
    assert (model.conf_threshold, model.iou_threshold, model.max_det) == (0.25, 0.45, 300)
    assert model.loadables.core1 is None


def test_toml_integers_are_accepted_where_floats_are_expected() -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["daemon"]["drain_timeout_s"] = 3
    config = parse_config(data)
    assert config.daemon.drain_timeout_s == 3.0
    assert type(config.daemon.drain_timeout_s) is float


# ----------------------------------------------------------------------------- errors

UNKNOWN_KEY_CASES = [
    ("", "bogus"),
    ("daemon", "daemon.bogus"),
    ("frontend", "frontend.bogus"),
    ("logging", "logging.bogus"),
    ("metrics", "metrics.bogus"),
    ("pre_post", "pre_post.bogus"),
    ("devices.dla0", "devices.dla0.bogus"),
    ("devices.gpu", "devices.gpu.bogus"),
    ("models.demo", "models.demo.bogus"),
    ("models.demo.loadables", "models.demo.loadables.bogus"),
]


@pytest.mark.parametrize(("table", "key"), UNKNOWN_KEY_CASES)
def test_unknown_key_at_every_level(tmp_path: Path, table: str, key: str) -> None:
    path = write(tmp_path, add_to_table(SHIPPED_TEXT, table, "bogus = 1"))
    err = expect_error(path, key)
    assert "unknown key" in err.reason


def test_unknown_key_in_a_subtable_and_a_quoted_key(tmp_path: Path) -> None:
    text = SHIPPED_TEXT + '\n[devices.dla1.faults]\nerror_rate = 0.1\n"a.b c" = 1\n'
    expect_error(write(tmp_path, text), 'devices.dla1.faults."a.b c"')
    # "source" is a field of Config, but set by the loader, never read from the file.
    expect_error(write(tmp_path, 'source = "x"\n' + SHIPPED_TEXT), "source")


@pytest.mark.parametrize(
    ("old", "new", "key", "reason"),
    [
        ("drain_timeout_s = 10.0", 'drain_timeout_s = "10"', "daemon.drain_timeout_s", "number"),
        ("drain_timeout_s = 10.0", "drain_timeout_s = true", "daemon.drain_timeout_s", "number"),
        ("sndhwm = 128", "sndhwm = 128.0", "frontend.sndhwm", "integer"),
        ("sndhwm = 128", "sndhwm = true", "frontend.sndhwm", "integer"),
        ('endpoints = ["tcp://127.0.0.1:5555"]', 'endpoints = "tcp://127.0.0.1:5555"',
         "frontend.endpoints", "array"),
        ('endpoints = ["tcp://127.0.0.1:5555"]', "endpoints = [5555]",
         "frontend.endpoints[0]", "string"),
        ("[metrics]\nenabled = true", "[metrics]\nenabled = 0", "metrics.enabled", "boolean"),
        ("[shm]\nenabled = true", "[shm]\nenabled = 1", "shm.enabled", "boolean"),
        ("max_segments = 64", "max_segments = 0", "shm.max_segments", "1..4096"),
        ("max_segments = 64", "max_segments = 4097", "shm.max_segments", "SIGBUS guard"),
        ("idle_s = 30.0", "idle_s = -1.0", "shm.idle_s", "> 0"),
        ('level = "info"', 'level = "loud"', "logging.level", "one of"),
        ('level = "info"', "level = 3", "logging.level", "one of"),
        ("core = 0", "core = 0.5", "devices.dla0.core", "integer"),
        ('kind = "gpu"', 'kind = "tpu"', "devices.gpu.kind", "one of"),
        ("max_det = 300", "max_det = 1979-05-27", "models.demo.max_det", "integer"),
        ("drain_timeout_s = 10.0", "drain_timeout_s = nan", "daemon.drain_timeout_s", "finite"),
        ('devices = ["dla0", "dla1", "gpu"]', 'devices = "dla0"', "models.demo.devices", "array"),
    ],
)  # fmt: skip
def test_wrong_type(tmp_path: Path, old: str, new: str, key: str, reason: str) -> None:
    err = expect_error(write(tmp_path, replace_once(SHIPPED_TEXT, old, new)), key)
    assert reason in err.reason


def test_tables_must_be_tables_and_names_must_be_names() -> None:
    for section, value, key in [
        ("logging", 3, "logging"), ("devices", 3, "devices"),
        ("devices", {"dla0": 3}, "devices.dla0"), ("devices", {}, "devices"),
        ("devices", {"bad name": {}}, 'devices."bad name"'),
        ("models", {}, "models"), ("models", [], "models"),
    ]:  # fmt: skip
        data = copy.deepcopy(SHIPPED_DATA)
        data[section] = value
        with pytest.raises(ConfigError) as info:
            parse_config(data, source="etc/dlad.toml")
        assert info.value.key == key
        assert str(info.value).startswith(f"etc/dlad.toml: {key}: ")


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"nope\.toml: cannot read config: No such file") as info:
        load_config(missing)
    assert (info.value.file, info.value.key) == (str(missing), "")
    with pytest.raises(ConfigError, match=r"dlad\.toml: not valid TOML"):
        load_config(write(tmp_path, "[daemon\n"))
    (tmp_path / "bin.toml").write_bytes(b'name = "\xff"\n')
    with pytest.raises(ConfigError, match=r"bin\.toml: not UTF-8"):
        load_config(tmp_path / "bin.toml")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path)  # a directory


def test_required_key_missing(tmp_path: Path) -> None:
    text = replace_once(SHIPPED_TEXT, 'devices = ["dla0", "dla1", "gpu"]\n', "")
    err = expect_error(write(tmp_path, text), "models.demo.devices")
    assert err.reason == "required key missing"
    text = replace_once(SHIPPED_TEXT, 'kind = "gpu"\n', "")
    expect_error(write(tmp_path, text), "devices.gpu.kind")


def test_bad_core_message_is_exact(tmp_path: Path) -> None:
    path = write(tmp_path, replace_once(SHIPPED_TEXT, "core = 1\n", "core = 2\n"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: devices.dla1.core: must be 0 or 1, got 2"


@pytest.mark.parametrize(
    ("old", "new", "key", "reason"),
    [
        ("core = 1\n", "core = 0\n", "devices.dla1.core", "DLA core 0 is already devices.dla0"),
        ("core = 1\n", "", "devices.dla1.core", "required for a dla device"),
        ('kind = "gpu"\n', 'kind = "gpu"\ncore = 1\n', "devices.gpu.core", "only a dla"),
        ('kind = "gpu"\nbackend = "auto"', 'kind = "gpu"\nbackend = "cudla"',
         "devices.gpu.backend", "auto, cuda, cpu"),
        ("queue_depth = 16", "queue_depth = 0", "devices.gpu.queue_depth", ">= 1, got 0"),
        ("max_batch = 8", "max_batch = 65", "devices.gpu.max_batch", "1 to 64"),
        ("max_queue_delay_us = 0.0", "max_queue_delay_us = -1.0",
         "devices.gpu.max_queue_delay_us", ">= 0"),
        ("core = 0\nqueue_depth = 4", "core = 0\nqueue_depth = -3", "devices.dla0.queue_depth",
         ">= 1"),
        ("sndhwm = 128", "sndhwm = 0", "frontend.sndhwm", ">= 1, got 0"),
        ("\nthreads = 2", "\nthreads = 0", "pre_post.threads", ">= 1"),
        ("max_message_bytes = 67108864", "max_message_bytes = 1000000",
         "frontend.max_message_bytes", "cannot hold a 4096x4096x3 image"),
        ('["tcp://127.0.0.1:5555"]', '["tcp://127.0.0.1"]', "frontend.endpoints[0]", "tcp://"),
        ('["tcp://127.0.0.1:5555"]', '["tcp://127.0.0.1:70000"]', "frontend.endpoints[0]",
         "1-65535"),
        ('["tcp://127.0.0.1:5555"]', '["udp://127.0.0.1:5"]', "frontend.endpoints[0]",
         "unknown transport 'udp'"),
        ('["tcp://127.0.0.1:5555"]', '["tcp://*:5555", "tcp://*:5555"]',
         "frontend.endpoints[1]", "twice"),
        ('["tcp://127.0.0.1:5555"]', "[]", "frontend.endpoints", "at least one"),
        ("default_deadline_ms = 1000.0", "default_deadline_ms = 90000.0",
         "daemon.default_deadline_ms", "must be <= max_deadline_ms (60000), got 90000"),
        ("max_deadline_ms = 60000.0", "max_deadline_ms = -1.0", "daemon.max_deadline_ms", "> 0"),
        ("drain_timeout_s = 10.0", "drain_timeout_s = 0", "daemon.drain_timeout_s", "> 0"),
        ('name = "dlad"', 'name = " "', "daemon.name", "non-empty"),
        ('event_loop = "uvloop"', 'event_loop = "trio"', "daemon.event_loop",
         "must be one of 'uvloop', 'asyncio', got a string 'trio'"),
        ('gpu_frames = "auto"', 'gpu_frames = "zero-copy"', "pre_post.gpu_frames",
         "must be one of 'auto', 'in-place', 'copy'"),
        ("port = 9464", "port = 0", "metrics.port", "1-65535"),
        ('["dla0", "dla1", "gpu"]', '["dla0", "dla7"]', "models.demo.devices[1]",
         "no device 'dla7'"),
        ('["dla0", "dla1", "gpu"]', '["dla0", "dla0"]', "models.demo.devices[1]", "twice"),
        ('["dla0", "dla1", "gpu"]', "[]", "models.demo.devices", "at least one"),
        ("conf_threshold = 0.25", "conf_threshold = 1.0", "models.demo.conf_threshold", "[0, 1)"),
        ("iou_threshold = 0.45", "iou_threshold = 0", "models.demo.iou_threshold", "(0, 1]"),
        ("max_det = 300", "max_det = 0", "models.demo.max_det", ">= 1"),
        ('core1 = "bundled:demo/fp16_heads.dla1.emu"\n', "", "models.demo.loadables",
         "core1 is required: devices.dla1 (DLA core 1) serves this model"),
        ('core0 = "bundled:demo/fp16_heads.dla0.emu"', 'core0 = ""',
         "models.demo.loadables.core0", "non-empty path"),
    ],
)  # fmt: skip
def test_impossible_values(tmp_path: Path, old: str, new: str, key: str, reason: str) -> None:
    err = expect_error(write(tmp_path, replace_once(SHIPPED_TEXT, old, new)), key)
    assert reason in err.reason


def test_cuda_pre_post_needs_a_gpu_that_is_not_on_cpu(tmp_path: Path) -> None:
    text = replace_once(
        SHIPPED_TEXT, '[pre_post]\nbackend = "auto"', '[pre_post]\nbackend = "cuda"'
    )
    load_config(write(tmp_path, text))
    text = replace_once(text, 'kind = "gpu"\nbackend = "auto"', 'kind = "gpu"\nbackend = "cpu"')
    err = expect_error(write(tmp_path, text), "pre_post.backend")
    assert "cuda needs a gpu" in err.reason


def test_no_loadables_at_all(tmp_path: Path) -> None:
    text = SHIPPED_TEXT.split("[models.demo.loadables]")[0] + "[models.demo.loadables]\n"
    expect_error(write(tmp_path, text), "models.demo.loadables")


@pytest.mark.parametrize(
    ("faults", "key", "reason"),
    [
        ("error_rate = 1.5", "error_rate", "[0, 1]"),
        ("hang_rate = -0.1", "hang_rate", "[0, 1]"),
        ("error_rate = 0.6\nhang_rate = 0.6", "hang_rate", "<= 1, got 1.2"),
        ("seed = -1", "seed", ">= 0"),
    ],
)
def test_fault_injection_bounds(tmp_path: Path, faults: str, key: str, reason: str) -> None:
    text = SHIPPED_TEXT + f"\n[devices.dla0.faults]\n{faults}\n"
    err = expect_error(write(tmp_path, text), f"devices.dla0.faults.{key}")
    assert reason in err.reason


@pytest.mark.parametrize(
    ("setting", "key"),
    [({"mode": "timing"}, "mode"), ({"latency_us": 500.0}, "latency_us"),
     ({"faults": {"error_rate": 0.1}}, "faults"), ({"faults": {"hang_rate": 0.1}}, "faults")],
)  # fmt: skip
def test_emulation_settings_on_real_hardware_are_errors(setting: dict[str, Any], key: str) -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["devices"]["dla0"].update(setting)
    parse_config(data)  # fine on an emulated core ("auto" is emulated without libcudla)
    data["devices"]["dla0"]["backend"] = "cudla"
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="x.toml")
    assert str(info.value).startswith(f"x.toml: devices.dla0.{key}: emulation only")
    data["devices"]["dla0"]["faults"] = {"seed": 3}  # a seed alone injects nothing
    data["devices"]["dla0"].pop(key, None)
    with pytest.raises(ConfigError, match="cudla_core0 is required"):
        parse_config(data)  # a cudla core runs a TensorRT loadable
    data["models"]["demo"]["loadables"]["cudla_core0"] = "model.dla0.loadable"
    parse_config(data)


# ----------------------------------------------------------------------------- loadables


def _loadables(text: str, core0: str, core1: str) -> str:
    text = replace_once(text, '"bundled:demo/fp16_heads.dla0.emu"', json.dumps(core0))
    return replace_once(text, '"bundled:demo/fp16_heads.dla1.emu"', json.dumps(core1))


def test_loadable_built_for_the_other_core(tmp_path: Path) -> None:
    other = dataclasses.replace(read_loadable(DEMO / "fp16_heads.dla0.emu"), dla_core=1)
    write_loadable(tmp_path / "built_for_1.emu", other)
    text = _loadables(SHIPPED_TEXT, "built_for_1.emu", "bundled:demo/fp16_heads.dla1.emu")
    err = expect_error(write(tmp_path, text), "models.demo.loadables.core0")
    assert str(tmp_path / "built_for_1.emu") in err.reason
    assert "built for DLA core 1, loaded on core 0" in err.reason


def test_missing_corrupt_and_unknown_bundled_loadables(tmp_path: Path) -> None:
    good1 = "bundled:demo/fp16_heads.dla1.emu"
    err = expect_error(write(tmp_path, _loadables(SHIPPED_TEXT, "missing.emu", good1)),
                       "models.demo.loadables.core0")  # fmt: skip
    assert f"cannot read {tmp_path / 'missing.emu'}" in err.reason
    (tmp_path / "junk.emu").write_bytes(b"not a loadable at all, just bytes")
    err = expect_error(write(tmp_path, _loadables(SHIPPED_TEXT, "junk.emu", good1)),
                       "models.demo.loadables.core0")  # fmt: skip
    assert "corrupt" in err.reason
    for bad in ["bundled:nomodel/x.emu", "bundled:", "bundled:demo/../demo/fp16_heads.dla0.emu"]:
        err = expect_error(write(tmp_path, _loadables(SHIPPED_TEXT, bad, good1)),
                           "models.demo.loadables.core0")  # fmt: skip
        assert "bundled:<model>/<file>" in err.reason
        assert "models: demo" in err.reason


def test_loadables_of_one_model_must_be_the_same_network(tmp_path: Path) -> None:
    base = read_loadable(DEMO / "fp16_heads.dla1.emu")
    renamed = dataclasses.replace(base, class_names=tuple(f"c{i}" for i in range(8)))
    write_loadable(tmp_path / "renamed.emu", renamed)
    text = _loadables(SHIPPED_TEXT, "bundled:demo/fp16_heads.dla0.emu", "renamed.emu")
    err = expect_error(write(tmp_path, text), "models.demo.loadables")
    assert "differ in class_names" in err.reason


def test_relative_paths_resolve_against_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf" / "models").mkdir(parents=True)
    for core in (0, 1):
        data = (DEMO / f"fp16_heads.dla{core}.emu").read_bytes()
        (tmp_path / "conf" / "models" / f"m{core}.emu").write_bytes(data)
    text = _loadables(SHIPPED_TEXT, "models/m0.emu", "./models/../models/m1.emu")
    text = replace_once(text, '["tcp://127.0.0.1:5555"]', '["ipc://run/d.sock", "ipc://@dlad"]')
    text = add_to_table(text, "devices.dla0", "latency_us = 250.0")
    write(tmp_path / "conf", text)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(Path("..") / "conf" / "dlad.toml")
    assert config.model("demo").loadables.core0 == "models/m0.emu"  # the config keeps the text
    plan = config.plan()
    assert plan.base_dir == tmp_path / "conf"
    assert [p.path for p in plan.placements] == [
        tmp_path / "conf" / "models" / "m0.emu",
        tmp_path / "conf" / "models" / "m1.emu",
        tmp_path / "conf" / "models" / "m0.emu",  # the gpu: core 0's
    ]
    assert plan.endpoints == (f"ipc://{tmp_path / 'conf' / 'run' / 'd.sock'}", "ipc://@dlad")
    assert [p.latency_us for p in plan.placements] == [
        250.0,
        plan.placements[1].loadable.latency_us,
        plan.placements[2].loadable.latency_us,
    ]


def test_ipc_path_too_long_once_resolved(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    text = replace_once(SHIPPED_TEXT, '["tcp://127.0.0.1:5555"]', f'["ipc://{"s" * 50}.sock"]')
    err = expect_error(write(deep, text), "frontend.endpoints[0]")
    assert "107 bytes" in err.reason


def test_a_model_on_the_gpu_uses_a_configured_loadable() -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["models"]["demo"]["devices"] = ["gpu", "dla1"]
    del data["models"]["demo"]["loadables"]["core0"]
    plan = parse_config(data, source=SHIPPED).plan()
    gpu, dla1 = plan.placements
    assert (gpu.device, gpu.loadable.dla_core, dla1.device) == ("gpu", 1, "dla1")
    assert gpu.path == dla1.path == DEMO / "fp16_heads.dla1.emu"
    assert plan.config.device("gpu").batch_limit == 8  # the gpu's default batch
    assert plan.config.device("dla1").batch_limit == 1


@pytest.mark.parametrize(
    ("device", "setting", "value", "reason"),
    [
        # settings the emulated GPU does not use
        ("gpu", "task_timeout_ms", 50.0, "dla devices only"),
        ("gpu", "faults", {"error_rate": 0.1}, "dla devices only"),
        # batching settings on a DLA, which runs batch 1
        ("dla0", "engine", "emulated", "gpu device only"),
        ("dla0", "max_batch", 4, "gpu device only"),
        ("dla0", "max_queue_delay_us", 5.0, "gpu device only"),
    ],
)
def test_settings_of_the_other_device_kind_are_refused(
    device: str, setting: str, value: Any, reason: str
) -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["devices"][device][setting] = value
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == f"devices.{device}.{setting}"
    assert reason in info.value.reason


@pytest.mark.parametrize("engine", ["torch", "tensorrt"])
def test_a_real_gpu_engine_needs_its_artifact_and_no_emulation_settings(engine: str) -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["devices"]["gpu"]["engine"] = engine
    data["devices"]["gpu"]["mode"] = "numeric"
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "models.demo.loadables"
    assert f"{engine} is required" in info.value.reason
    data["models"]["demo"]["loadables"][engine] = f"demo.{engine}"
    assert parse_config(data).device("gpu").engine == engine
    for key, value in (("mode", "timing"), ("latency_us", 900.0), ("threads", 2)):
        bad = copy.deepcopy(data)
        bad["devices"]["gpu"][key] = value
        with pytest.raises(ConfigError) as info:
            parse_config(bad)
        assert info.value.key == f"devices.gpu.{key}"
        assert "emulated engine only" in info.value.reason
    data["devices"]["gpu"]["engine"] = "onnx"
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "devices.gpu.engine"


def test_two_models_on_one_device_are_refused() -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["models"]["other"] = copy.deepcopy(data["models"]["demo"])
    data["models"]["other"]["devices"] = ["dla1"]
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "models.other.devices[0]"
    assert "already serves model 'demo'" in info.value.reason


def test_hand_pins_need_the_static_policy_and_known_devices() -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["scheduler"] = {"policy": "static", "pins": {"cam0": "gpu", "front door": "dla1"}}
    assert dict(parse_config(data).scheduler.pins) == {"cam0": "gpu", "front door": "dla1"}
    refused = {
        "scheduler.pins": ({"policy": "latency", "pins": {"cam0": "gpu"}}, "only policy"),
        "scheduler.pins.cam1": ({"policy": "static", "pins": {"cam1": "dla7"}}, "no device"),
        'scheduler.pins."c\\u0007"': ({"policy": "static", "pins": {"c\x07": "gpu"}}, "printable"),
        "scheduler.pins.cam2": ({"policy": "static", "pins": {"cam2": 1}}, "expected a string"),
    }
    for key, (table, reason) in refused.items():
        data["scheduler"] = table
        with pytest.raises(ConfigError) as info:
            parse_config(data)
        assert (info.value.key, reason in info.value.reason) == (key, True), info.value


def test_in_memory_config_errors_name_only_the_key() -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["devices"]["dla1"]["core"] = 2
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value) == "devices.dla1.core: must be 0 or 1, got 2"
    assert info.value.file is None


@pytest.mark.parametrize(
    ("endpoint", "ok"),
    [("tcp://127.0.0.1:5555", True), ("tcp://*:*", True), ("tcp://[::1]:80", True),
     ("tcp://eth0:1", True), ("ipc:///tmp/x.sock", True), ("ipc://*", True),
     ("inproc://dlad", True), ("tcp://:5", False), ("tcp://h:0", False), ("tcp://h:-1", False),
     ("tcp://a b:5", False), ("tcp://", False), ("inproc://", False), ("127.0.0.1:5", False),
     ("ipc://" + "x" * 108, False), ("pgm://e;239.0.0.1:5", False)],
)  # fmt: skip
def test_endpoint_syntax(endpoint: str, ok: bool) -> None:
    assert (endpoint_problem(endpoint) is None) == ok


# ----------------------------------------------------------------------------- documentation


def undocumented_fields(source: str) -> list[str]:
    """``Class.field`` for each field of a dataclass in ``source`` not followed by a non-empty
    attribute docstring."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or not any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            continue
        for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = after.value.value if isinstance(after, ast.Expr) and isinstance(
                    after.value, ast.Constant) else None  # fmt: skip
                if not (isinstance(doc, str) and doc.strip()):
                    missing.append(f"{node.name}.{stmt.target.id}")
    return missing


def test_every_config_field_has_a_docstring() -> None:
    source = inspect.getsource(config_module)
    assert undocumented_fields(source) == []
    # The AST walk sees exactly the runtime dataclasses and their fields, so none escapes it.
    runtime = {
        f"{cls.__name__}.{f.name}"
        for cls in vars(config_module).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == "dlad.config"
        for f in dataclasses.fields(cls)
    }
    assert len(runtime) > 40
    stripped = re.sub(r'(\n\s+"""[^"]*""")', "", source)  # every field docstring removed
    assert set(undocumented_fields(stripped)) == runtime


def test_the_docstring_check_catches_a_missing_or_empty_docstring() -> None:
    source = '''
@dataclass(frozen=True)
class A:
    x: int = 1
    """Documented."""
    y: int = 2
    z: int = 3
    """ """
class NotAConfig:
    w: int
'''
    assert undocumented_fields(source) == ["A.y", "A.z"]


# ----------------------------------------------------------------------------- properties

_LEVELS: dict[str, tuple[str, ...]] = {
    "": (), "daemon": ("daemon",), "frontend": ("frontend",), "logging": ("logging",),
    "metrics": ("metrics",), "pre_post": ("pre_post",), "devices.dla0": ("devices", "dla0"),
    "devices.dla0.faults": ("devices", "dla0", "faults"), "devices.gpu": ("devices", "gpu"),
    "models.demo": ("models", "demo"), "models.demo.loadables": ("models", "demo", "loadables"),
}  # fmt: skip
_KNOWN = {
    "": {"daemon", "frontend", "logging", "metrics", "pre_post", "devices", "models"},
    **{level: {f.name for f in dataclasses.fields(cls)} for level, cls in [
        ("daemon", DaemonConfig), ("frontend", FrontendConfig), ("logging", LoggingConfig),
        ("metrics", MetricsConfig), ("pre_post", PrePostConfig), ("devices.dla0", DeviceConfig),
        ("devices.gpu", DeviceConfig), ("devices.dla0.faults", FaultConfig),
        ("models.demo", config_module.ModelConfig),
        ("models.demo.loadables", config_module.LoadablesConfig)]},
}  # fmt: skip
_TOML_VALUES = st.recursive(
    st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=5,
)


def _toml_key(key: str) -> str:
    """The key as TOML writes it (the spec's bare-key alphabet), built without dlad's code."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


@settings(max_examples=100, deadline=None)
@given(level=st.sampled_from(sorted(_LEVELS)), key=st.text(min_size=0, max_size=12),
       value=_TOML_VALUES)  # fmt: skip
def test_random_unknown_keys_are_always_rejected(level: str, key: str, value: Any) -> None:
    known = _KNOWN[level] - {"name"}  # a device's or model's name is its table key
    if key in known:
        key += "_x"
    data = copy.deepcopy(SHIPPED_DATA)
    data["devices"]["dla0"]["faults"] = {"seed": 1}
    table = data
    for part in _LEVELS[level]:
        table = table[part]
    table[key] = value
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="etc/dlad.toml")
    err = info.value
    assert err.file == "etc/dlad.toml"
    assert "unknown key" in err.reason
    quoted = err.key.removeprefix(f"{level}.") if level else err.key
    assert tomllib.loads(f"{quoted} = 1") == {key: 1}  # the message's key is valid TOML for it
    if "\x7f" not in key:
        assert quoted == _toml_key(key)
    assert str(err).startswith(f"etc/dlad.toml: {err.key}: unknown key")


def test_config_is_one_tree_of_frozen_classes() -> None:
    for cls in vars(config_module).values():
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
    assert Config.__dataclass_fields__["source"].metadata.get("toml") is False


def test_importing_the_config_stays_light() -> None:
    import subprocess

    code = (
        "import sys, dlad.config; "
        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'tensorrt', 'zmq') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_max_det_bound_is_the_wire_limit() -> None:
    from dlad import config, protocol

    assert config.MAX_DET == protocol.MAX_DET
    assert config.MAX_BATCH == protocol.MAX_BATCH


# ----------------------------------------------------------------------------- the shipped file
def _fields(cls: type, table: str) -> set[str]:
    """Every TOML key path of ``cls`` below ``table``: ``devices.*.core``-style, a table of
    tables' key as ``*``."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("toml") is False or f.metadata.get("from_key"):
            continue
        tp, path = hints[f.name], f"{table}{f.name}"
        inner: list[Any] = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            out |= _fields(tp, f"{path}.")  # type: ignore[arg-type]
        elif inner and typing.get_origin(tp) is tuple:
            out |= _fields(inner[0], f"{path}.*.")
        else:
            out.add(path)
    return out


def _documented_keys(text: str) -> dict[str, str]:
    """Each key path the file sets or shows in a comment (``# key = value``), with the comment
    block above its table: {path: comment}. ``[devices.dla0]`` counts as ``devices.*``."""
    keys: dict[str, str] = {}
    table, block = "", ""
    comment: list[str] = []
    for line in text.splitlines():
        header = re.fullmatch(r"#?\s*\[([A-Za-z0-9_.]+)\]\s*", line)
        if header:
            parts = header.group(1).split(".")
            if parts[0] in ("devices", "models") and len(parts) > 1:
                parts[1] = "*"
            table, block, comment = ".".join(parts) + ".", " ".join(comment), []
            continue
        key = re.fullmatch(r"#?\s*([a-z_0-9]+)\s*=.*", line)
        if key:
            keys[table + key.group(1)] = block
        elif line.startswith("#"):
            comment.append(line.lstrip("# "))
        elif not line.strip():
            comment = [] if not table else comment
    return keys


def test_the_shipped_config_documents_every_setting() -> None:
    """etc/dlad.toml is where a user learns the settings: each field of the config is there,
    set or in a comment, under a table whose comment explains it, and the file names no key
    the config does not have."""
    documented = _documented_keys(SHIPPED.read_text())
    fields = _fields(Config, "")
    assert sorted(fields - set(documented)) == []
    assert sorted(set(documented) - fields) == []
    tables = {path.rpartition(".")[0] for path in documented}
    for table in tables - {"models.*.loadables", "devices.*.faults"}:  # explained just above
        block = next(c for p, c in documented.items() if p.rpartition(".")[0] == table)
        assert block.strip(), f"[{table}] has no comment above it"


def test_the_documentation_check_sees_a_missing_key() -> None:
    text = '# the daemon\n[daemon]\nname = "x"\n# [devices.dla0]\n# core = 0\n'
    assert _documented_keys(text) == {"daemon.name": "the daemon", "devices.*.core": ""}
