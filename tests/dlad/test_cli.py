from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from dlad import families, protocol
from dlad.cli import main
from dlad.config import load_config
from dlad.daemon import plane_engine
from dlad.errors import Status
from tests.dlad.serving import NUMERIC_DEMO, serve_config


def test_version_and_help_import_nothing_heavy() -> None:
    code = (
        "import sys, dlad.cli\n"
        "try:\n    dlad.cli.main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = {'torch', 'onnx', 'onnxruntime', 'zmq', 'anyio'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_config_errors_exit_2_naming_key_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[devices.dla0]\nkind = 'dla'\ncore = 2\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err
    assert "core" in err
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_status_of_an_absent_daemon_is_a_clear_failure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--endpoint", "tcp://127.0.0.1:9", "--timeout", "0.2"]) == 1
    assert "no reply" in capsys.readouterr().err


# ----------------------------------------------------------------------- clear errors, exit codes
ROOT = Path(__file__).resolve().parents[2]
DLAD = [sys.executable, "-c", "import sys; from dlad.cli import main; sys.exit(main())"]


def test_endpoint_without_a_scheme_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["status", "--endpoint", "127.0.0.1:5555"],
                 ["status", "--watch", "1", "--endpoint", "localhost:5555"]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "has no scheme" in err
        assert "tcp://" in err
        assert "Traceback" not in err


def test_a_tcp_endpoint_without_a_port_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["status", "--endpoint", "tcp://127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert err == ("dlad: --endpoint: endpoint 'tcp://127.0.0.1' has no port (tcp://host:port, "
                   "e.g. tcp://127.0.0.1:5555)\n")  # fmt: skip


def test_config_may_follow_the_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[devices.dla0]\nkind = 'dla'\ncore = 2\n")
    assert main(["status", "--config", str(bad)]) == 2  # read: the error names it
    assert "bad.toml" in capsys.readouterr().err
    shipped = str(ROOT / "etc" / "dlad.toml")
    assert main(["status", "--config", shipped, "--endpoint", "tcp://127.0.0.1:9", "--timeout",
                 "0.2"]) == 1  # fmt: skip
    assert "no reply" in capsys.readouterr().err


@contextmanager
def answering(reply: protocol.Reply) -> Iterator[str]:
    """A ROUTER on a free port that answers every message with ``reply`` (a stand-in daemon)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                frames = sock.recv_multipart()
                request = protocol.decode_request(frames[1:])
                answer = dataclasses.replace(reply, id=request.id)
                sock.send_multipart([frames[0], *protocol.encode(answer)])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(10)
        sock.close(0)
        ctx.term()


def test_status_exits_1_when_the_daemon_answers_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reply = protocol.StatusReply(0, Status.INTERNAL, message="the report could not be built")
    with answering(reply) as endpoint:
        assert main(["status", "--endpoint", endpoint]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # not "null"
    assert "INTERNAL: the report could not be built" in captured.err


def test_a_closed_pipe_ends_quietly() -> None:
    """``dlad status ... | head``: the reader is gone before anything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [*DLAD, "status", "--platform"], stdout=write_end, stderr=subprocess.PIPE,
            timeout=120, check=False, cwd=ROOT,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert proc.returncode == 0
    assert proc.stderr == b""


def test_platform_names_the_engine_each_device_gets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(
        DAEMON_CFG.format(port=5555, metrics_port=9100)
        + '[devices.dla1]\nkind = "dla"\ncore = 1\nmode = "numeric"\n'
        + "[pre_post]\nenabled = false\n"
    )
    cfg.write_text(cfg.read_text().replace('devices = ["dla0"]', 'devices = ["dla0", "dla1"]')
                   .replace('core0 = "bundled:demo/fp16_heads.dla0.emu"',
                            'core0 = "bundled:demo/fp16_heads.dla0.emu"\n'
                            'core1 = "bundled:demo/fp16_heads.dla1.emu"'))  # fmt: skip
    assert main(["--config", str(cfg), "status", "--platform"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native_core"] == "present"
    assert report["engines"] == {
        "dla0": "C++: emulated DLA core 0 (timing), pre/post off",
        "dla1": "Python: emulated DLA core 1 (numeric), pre/post off",
    }


def _port_in_use() -> tuple[socket.socket, int]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


DAEMON_CFG = """
[frontend]
endpoints = ["tcp://127.0.0.1:{port}"]
[metrics]
enabled = true
port = {metrics_port}
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


@pytest.mark.parametrize("taken", ["frontend", "metrics"])
def test_a_port_in_use_names_the_port_and_the_key(tmp_path: Path, taken: str) -> None:
    held, port = _port_in_use()
    free, free_port = _port_in_use()
    free.close()  # a port nothing listens on (for the other of the two)
    ports = (port, free_port) if taken == "frontend" else (free_port, port)
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(DAEMON_CFG.format(port=ports[0], metrics_port=ports[1]))
    try:
        proc = subprocess.run(
            [*DLAD, "--config", str(cfg)], capture_output=True, text=True, timeout=100,
            check=False, cwd=ROOT,
        )  # fmt: skip
    finally:
        held.close()
    assert proc.returncode == 1
    key = "frontend.endpoints[0]" if taken == "frontend" else "metrics.port"
    assert f"dlad: {cfg}: {key}: " in proc.stderr
    assert str(port) in proc.stderr
    assert "in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_core_that_cannot_load_names_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A numeric core on a host where no INT8 operands are exact cannot load its loadable: the
    daemon does not start, and says which device and why, with no traceback."""
    from dlad.devices import int8_layout

    def no_exact(choice: str = "auto") -> int8_layout.KernelPath:
        raise int8_layout.NoExactKernelError("neither operand layout is exact here (test)")

    monkeypatch.setattr("dlad.devices.int8_engine.select_kernel_path", no_exact)
    free, port = _port_in_use()
    free.close()
    cfg = tmp_path / "dlad.toml"
    text = DAEMON_CFG.format(port=port, metrics_port=port).replace('mode = "timing"\n', "")
    cfg.write_text(text.replace("enabled = true", "enabled = false"))
    assert main(["--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"dlad: {cfg}: devices.dla0: cannot open or load" in err
    assert "neither operand layout is exact here" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("engine", ["torch", "tensorrt"])
def test_a_gpu_engine_that_cannot_start_names_the_device(
    tmp_path: Path, engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real GPU engine whose program is missing (or whose runtime is absent: no torch, no
    TensorRT, no CUDA here) stops the start with the device and the reason, no traceback."""
    free, port = _port_in_use()
    free.close()
    cfg = tmp_path / "dlad.toml"
    text = DAEMON_CFG.format(port=port, metrics_port=port).replace(
        "enabled = true", "enabled = false"
    )
    text = text.replace('devices = ["dla0"]', 'devices = ["dla0", "gpu"]')
    text = text.replace(
        "[models.demo]",
        f'[devices.gpu]\nkind = "gpu"\nengine = "{engine}"\n[models.demo]',
    )
    cfg.write_text(text + f'{engine} = "missing.{engine}"\n')
    assert main(["--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert f"dlad: {cfg}: devices.gpu: cannot build the {engine} GPU engine for model 'demo'" in err
    assert "Traceback" not in err


def test_without_the_cpp_core_the_daemon_says_so_in_one_line_and_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An install whose C++ core did not build (no compiler, no wheel) cannot serve: one line,
    exit status 2, no traceback."""
    monkeypatch.setattr("dlad.native_plane._CORE", None)
    monkeypatch.setattr("dlad.native_plane._CORE_MISSING", "No module named 'dlad._native'")
    free, port = _port_in_use()
    free.close()
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(DAEMON_CFG.format(port=port, metrics_port=port))
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("dlad: dlad was installed without its C++ core, which serves every")
    assert "No module named 'dlad._native'" in err


def test_a_family_without_cuda_kernels_is_pre_post_processed_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plane's GPU chain runs the yolov5 kernels: a model whose family has no CUDA post
    program is served by a Python engine with pre/post on the CPU, as the executors serve it
    (before, the plane ran yolov5's kernels on its heads)."""
    cfg = tmp_path / "dlad.toml"
    cfg.write_text('[devices.dla0]\nkind = "dla"\ncore = 0\nmode = "timing"\n'
                   '[models.demo]\ndevices = ["dla0"]\n[models.demo.loadables]\n'
                   'core0 = "bundled:demo/fp16_heads.dla0.emu"\n')  # fmt: skip
    plan = load_config(cfg).plan()
    dla = plan.placements[0]
    assert plane_engine(plan, dla, pre_post=True, gpu=True)[0] == "timing"
    cpu_only = dataclasses.replace(families.FAMILIES["yolov5"], cuda_program=None)
    monkeypatch.setitem(families.FAMILIES, "yolov5", cpu_only)
    assert plane_engine(plan, dla, pre_post=True, gpu=True) == (
        "python",
        "Python: emulated DLA core 0 (timing), pre/post on the CPU",
    )


@pytest.mark.parametrize(
    ("table", "key"), [("frontend", "data_plane"), ("scheduler", "core"), ("frontend", "rcvhwm")]
)
def test_a_removed_key_is_named_as_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, key: str
) -> None:
    cfg = tmp_path / "dlad.toml"
    text = DAEMON_CFG.format(port=5555, metrics_port=9100)
    cfg.write_text(text + f'\n[{table}]\n{key} = "python"\n' if f"[{table}]" not in text else
                   text.replace(f"[{table}]\n", f'[{table}]\n{key} = "python"\n'))  # fmt: skip
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{table}.{key}: removed: " in err
    assert "delete the key" in err


@pytest.mark.parametrize(
    ("engine", "pre_post", "gpu", "kind", "words"),
    [
        ("torch", True, True, "gpu-graphs", ("C++: GPU batches of up to 4 on the torch "
         "engine's CUDA graphs, pre/post on the GPU")),
        ("tensorrt", True, True, "gpu-graphs", ("C++: GPU batches of up to 4 on the tensorrt "
         "engine's CUDA graphs, pre/post on the GPU")),
        ("torch", True, False, "python", ("Python: GPU batches of up to 4 on the torch engine, "
         "pre/post on the CPU")),
        ("tensorrt", True, False, "python", ("Python: GPU batches of up to 4 on the tensorrt "
         "engine, pre/post on the CPU")),
        ("emulated", True, True, "python", ("Python: GPU batches of up to 4 on the emulated "
         "engine, pre/post on the CPU")),
        ("torch", False, True, "python", ("Python: GPU batches of up to 4 on the torch engine, "
         "pre/post off")),
        ("emulated", False, True, "gpu-timing", ("C++: emulated Orin GPU (timing), batches of "
         "up to 4, pre/post off")),
    ],
)  # fmt: skip
def test_platform_names_the_gpus_engine(
    tmp_path: Path, engine: str, pre_post: bool, gpu: bool, kind: str, words: str
) -> None:
    """The plane runs the GPU's batches itself for the torch and TensorRT engines with pre/post
    on a GPU (their CUDA graphs between the plane's kernels) and for the emulated GPU in timing
    mode with pre/post off; the others are Python engines, their pre/post on the CPU (no
    device-side I/O)."""
    (tmp_path / "demo.pt2").write_bytes(b"")  # named only: the words read no program
    mode = 'mode = "timing"\n' if engine == "emulated" else ""  # the emulated engine's only
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(
        f'[devices.gpu]\nkind = "gpu"\nengine = "{engine}"\nmax_batch = 4\n{mode}'
        '[models.demo]\ndevices = ["gpu"]\n[models.demo.loadables]\n'
        'core0 = "bundled:demo/fp16_heads.dla0.emu"\ntorch = "demo.pt2"\n'
        'tensorrt = "demo.gpu.engine"\n'
    )
    plan = load_config(cfg).plan()
    assert plane_engine(plan, plan.placements[0], pre_post=pre_post, gpu=gpu) == (kind, words)


def _report(out: str) -> Any:
    """The JSON report among the lines (the daemon in this process logs to stdout too)."""
    lines = out.splitlines()
    start = lines.index("{")
    return json.loads("\n".join(lines[start : lines.index("}", start) + 1]))


def test_status_is_a_summary_on_a_terminal_and_json_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlad.cli import _status

    with serve_config(NUMERIC_DEMO, tmp_path) as endpoint:
        assert main(["status", "--endpoint", endpoint]) == 0  # captured: no terminal
        report = _report(capsys.readouterr().out)
        assert report["models"][0]["name"] == "demo"
        assert _status(endpoint, 10.0, as_json=False) == 0  # what a terminal gets
        out = capsys.readouterr().out
        assert "RUNNING" in out
        assert "dla0" in out
        assert "model demo (yolov5, 8 classes, 256x256) on dla0" in out
        assert main(["status", "--json", "--endpoint", endpoint]) == 0
        assert _report(capsys.readouterr().out)["models"] == report["models"]
