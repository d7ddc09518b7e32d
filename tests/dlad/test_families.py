"""Model families: the loadable names its family, and the executor post-processes as that family
does; an unknown name is refused when the config loads, naming the file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from dlad import families, protocol
from dlad.config import ConfigError, load_config
from dlad.daemon import Daemon
from dlad.errors import Status
from dlad.families import FAMILIES, Family, UnknownFamilyError, family_for
from dlad.loadable import read_loadable, write_loadable
from dlad.models import DEMO
from tests.dlad.serving import serve_in_thread

pytestmark = pytest.mark.timeout(60)

CONFIG = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = 500.0
[models.other]
devices = ["dla0"]
[models.other.loadables]
core0 = "{path}"
"""


def _with_family(tmp_path: Path, name: str) -> Path:
    demo = read_loadable(DEMO / "fp16_heads.dla0.emu", expect_core=0)
    return write_loadable(tmp_path / f"{name}.dla0.emu", dataclasses.replace(demo, family=name))


def test_the_bundled_family_is_yolov5() -> None:
    assert read_loadable(DEMO / "fp16_heads.dla0.emu").family == "yolov5"
    assert family_for("yolov5").cuda
    with pytest.raises(UnknownFamilyError, match=r"no model family 'yolov9'.*yolov5"):
        family_for("yolov9")


def test_every_cuda_family_has_its_kernels_in_its_source() -> None:
    """The GPU program is kernels.cu and each family's .cu: every kernel a family names is
    defined there, and every program it makes names one of them."""
    for family in FAMILIES.values():
        if family.cuda_source is None:
            continue
        source = family.cuda_source.read_text(encoding="utf-8")
        for kernel in family.cuda_kernels:
            assert f'extern "C" __global__ void {kernel}(' in source
    demo = read_loadable(DEMO / "fp16_heads.dla0.emu")
    assert families.post_program(demo).kernel in family_for(demo.family).cuda_kernels


def test_an_unknown_family_is_refused_when_the_config_loads(tmp_path: Path) -> None:
    cfg = tmp_path / "dlad.toml"
    path = _with_family(tmp_path, "yolov9")
    cfg.write_text(CONFIG.format(path=path))
    with pytest.raises(ConfigError) as info:
        load_config(cfg).plan()
    assert info.value.key == "models.other.loadables.core0"
    assert "no model family 'yolov9'" in str(info.value)
    assert str(path) in str(info.value)


def test_the_executor_post_processes_as_the_family_its_loadable_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second model family is a loadable naming it and the family itself; the frontend,
    scheduler and executors are the same code."""
    calls: list[dict[str, Any]] = []
    marker = np.array([[1, 2, 3, 4, 0.5, 7]], np.float32)

    def probe_post(heads: Any, model: Any, letterbox: Any, **kw: Any) -> np.ndarray:
        calls.append({"heads": len(heads), "classes": model.num_classes, **kw})
        return marker

    monkeypatch.setitem(FAMILIES, "probe", Family("probe", lambda _: None, probe_post))
    assert family_for("probe").name == "probe"
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(CONFIG.format(path=_with_family(tmp_path, "probe")))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    ctx = zmq.Context()
    with serve_in_thread(daemon) as endpoint, ctx.socket(zmq.DEALER) as sock:
        sock.linger = 0
        sock.connect(endpoint)
        image = np.zeros((48, 64, 3), np.uint8)
        request = protocol.InferRequest(1, "other", image, conf=0.3, iou=0.5, max_det=9)
        sock.send_multipart(protocol.encode(request))
        assert sock.poll(20_000)
        reply = protocol.decode_reply(sock.recv_multipart())
    ctx.term()
    assert isinstance(reply, protocol.InferReply)
    assert reply.status == Status.OK
    np.testing.assert_array_equal(reply.detections, marker)
    assert calls == [{"heads": 3, "classes": 8, "conf": 0.3, "iou": 0.5, "max_det": 9}]
