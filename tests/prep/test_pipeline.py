from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prep.cli import main
from prep.manifest import StageRecord
from prep.pipeline import PRESETS, Chain, ConfigError, load_config, resolve_preset


def test_presets_load() -> None:
    for p in PRESETS.glob("*.toml"):
        load_config(p)
    assert load_config(resolve_preset("demo")).model.variant == "n"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.epochz": 3}, "unknown key"),
        ({"train.epochs": "three"}, "expected int"),
        ({"train.lr": True}, "expected a number"),
        ({"train.optimizer": "rmsprop"}, "not one of"),
        ({"nosuch.key": 1}, "unknown key"),
        ({"epochs": 1}, "section.key"),
    ],
)
def test_config_errors_name_the_key(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_overrides_apply() -> None:
    cfg = load_config(resolve_preset("demo"), {"train.epochs": 3, "build.cores": [1]})
    assert cfg.train.epochs == 3
    assert cfg.build.cores == (1,)


def test_manifest_tracks_inputs_settings_and_outputs(tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a")
    out = tmp_path / "stage"
    out.mkdir()
    (out / "result.bin").write_bytes(b"x")
    rec = StageRecord("demo", out, {"src": src}, {"k": 1})
    assert not rec.up_to_date()
    rec.write({"result": out / "result.bin"}, {"m": 2})
    assert rec.up_to_date()
    assert not StageRecord("demo", out, {"src": src}, {"k": 2}).up_to_date()
    src.write_text("b")
    assert not rec.up_to_date()
    src.write_text("a")
    assert rec.up_to_date()
    (out / "result.bin").write_bytes(b"tampered")
    assert not rec.up_to_date()
    data = json.loads((out / "manifest.json").read_text())
    assert {"torch", "python"} <= set(data["versions"])


def test_stage_without_inputs_is_a_clear_error(tmp_path: Path) -> None:
    chain = Chain(tmp_path, load_config(resolve_preset("smoke")))
    with pytest.raises(FileNotFoundError, match="run the earlier stages first"):
        chain.run("train")


def test_cli_bad_settings_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--preset", "smoke", "--set", "train.nope=1"]) == 2
    assert "unknown key" in capsys.readouterr().err
    assert main(["config", "--preset", "no-such-preset"]) == 2


def test_help_does_not_import_torch() -> None:
    code = "import sys, prep.cli; prep.cli._parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_chain_end_to_end_then_skips(tmp_path: Path) -> None:
    work = tmp_path / "run"
    assert main(["all", "--preset", "smoke", "--workdir", str(work), "-q"]) == 0
    for path in [
        "data/train/annotations.json",
        "cache/train.npz",
        "cache/val.npz",
        "train/fp32.pt",
        "qat/qat.pt",
        "export/fp32.onnx",
        "export/qat.onnx",
        "translate/model_noqdq.onnx",
        "translate/model_precision_config.json",
        "translate/model_precision_config_calib.cache",
        "build/trtexec_commands.json",
        "validate/metrics.json",
    ]:
        assert (work / path).exists(), path
    cache = (work / "translate/model_precision_config_calib.cache").read_text().splitlines()
    assert cache[0] == "TRT-8600-EntropyCalibration2"
    assert any(line.startswith("images: ") for line in cache)
    assert {"s8", "s16", "s32"} <= {line.split(": ")[0] for line in cache}
    metrics = json.loads((work / "validate/metrics.json").read_text())
    assert set(metrics["rows"]) == {
        "fp32",
        "qat_fakequant",
        "int8_emulated_int8_heads",
        "int8_emulated_fp16_heads",
        "int8_emulated_fp16_heads_last_c3",
    }
    lat = {
        k: v["modelled_dla_latency_ms"] for k, v in metrics["rows"].items() if k.startswith("int8")
    }
    assert (
        lat["int8_emulated_int8_heads"]
        < lat["int8_emulated_fp16_heads"]
        < lat["int8_emulated_fp16_heads_last_c3"]
    )
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("manifest.json")}
    assert main(["all", "--preset", "smoke", "--workdir", str(work), "-q"]) == 0
    assert {p: p.stat().st_mtime_ns for p in work.rglob("manifest.json")} == stamps
    # A changed setting reruns that stage and everything after it.
    assert (
        main(
            [
                "validate",
                "--preset",
                "smoke",
                "--workdir",
                str(work),
                "-q",
                "--set",
                "validate.iou_threshold=0.5",
            ]
        )
        == 0
    )
    assert (work / "validate/manifest.json").stat().st_mtime_ns != stamps[
        work / "validate/manifest.json"
    ]


def test_a_yolo26_runs_every_stage(tmp_path: Path) -> None:
    """A DFL family through the whole chain: QAT, export, translation (attention's product and
    softmax the only FP16 nodes), the emulated loadables of its head variants, which name the
    family and its classes, and their mAP beside FP32's."""
    from dlad.loadable import read_loadable

    work = tmp_path / "run"
    args = ["all", "--preset", "smoke", "--workdir", str(work), "-q"]
    assert main([*args, "--set", "model.family=yolo26"]) == 0
    config = json.loads((work / "translate/model_precision_config.json").read_text())
    assert config["fp16_nodes"]
    assert all("/attn/" in n for n in config["fp16_nodes"])
    loadable = read_loadable(work / "build/int8_heads.dla0.emu")
    assert loadable.family == "yolo26"
    assert loadable.anchors_px == ()
    assert len(loadable.class_names) == loadable.num_classes
    metrics = json.loads((work / "validate/metrics.json").read_text())
    assert set(metrics["rows"]) == {
        "fp32", "qat_fakequant", "int8_emulated_int8_heads", "int8_emulated_fp16_heads",
        "int8_emulated_fp16_heads_branches",
    }  # fmt: skip
    int8, fp16, branches = (
        read_loadable(work / f"build/{v}.dla0.emu")
        for v in ("int8_heads", "fp16_heads", "fp16_heads_branches")
    )
    # the third row: the Detect layer's branches in FP16 as well
    extra = set(branches.fp16_nodes) - set(fp16.fp16_nodes)
    assert "/cv2.0/cv2.0.1/conv/Conv" in extra  # the Detect layer's branches, as RawHeads runs them
    assert all(n.startswith(("/cv2.", "/cv3.")) for n in extra)
    assert int8.latency_us < fp16.latency_us < branches.latency_us
    # its bundle: the README names the family, and its command regenerates this very model
    out = tmp_path / "bundle"
    assert main(["bundle", *args[1:], "--set", "model.family=yolo26", "--out", str(out)]) == 0
    readme = (out / "README.md").read_text()
    assert readme.startswith("# Bundled model: YOLO26n at ")
    assert f"prep all --preset smoke --workdir {work} --set model.family=yolo26 && " in readme
    assert json.loads((out / "expected_detections.json").read_text())["heads_sha256"]
