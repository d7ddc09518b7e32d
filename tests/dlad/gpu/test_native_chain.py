"""The native plane's GPU chain on a real GPU: a daemon with CUDA pre/post answers each frame,
sent in the message or in shared memory, with the detections the numpy reference gives the same
frame, to float32's last bits (pre/post-processing on the CPU, in a Python engine of the plane;
the emulated core in timing mode writes the same pattern into its heads either way,
EmulatedDlaCore's real-looking logits with a few boxes above the thresholds).
tests/dlad/test_native_gpu.py holds the chain's steps to the driver's rules on a fake driver."""

from __future__ import annotations

from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import Status
from dlad.protocol import InferReply, InferRequest, ShmRef
from tests.dlad.gpu.conftest import needs_gpu
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_daemon import dealer, recv
from tests.dlad.test_native_gpu import DAEMON

pytestmark = [
    needs_gpu,
    pytest.mark.timeout(300),
]

# test_native_gpu's daemon on the fake driver, here on the GPU (the plane's GPU chain) or with
# pre/post-processing on the CPU (the numpy reference, in a Python engine)
CONFIG = DAEMON.replace(
    "[pre_post]\nenabled = true", '[pre_post]\nenabled = true\nbackend = "{plane}"'
)

# shape, format, conf, iou, max_det
FRAMES: list[tuple[tuple[int, ...], protocol.PixelFormat, float, float | None, int | None]] = [
    ((480, 640, 3), "RGB", 0.1, 0.45, 300),
    ((720, 1280, 3), "BGR", 0.2, 0.6, 50),
    ((333, 257, 1), "GRAY", 0.1, 0.3, None),
    ((64, 64, 3), "RGB", 0.3, None, None),  # nothing passes 0.3: no detections
    ((480, 640, 3), "RGB", 0.1, 0.45, 300),  # the first's settings again: no copy
]


def _detections(tmp_path: Path, plane: str) -> list[npt.NDArray[np.float32]]:
    cfg = tmp_path / f"{plane}.toml"
    cfg.write_text(CONFIG.format(plane=plane))
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    rng = np.random.default_rng(11)
    out = []
    segment = shared_memory.SharedMemory(create=True, size=8 << 20)
    assert segment.buf is not None
    segment.buf[: protocol.SHM_HEADER_BYTES] = protocol.shm_header(bytes(16))
    try:
        with serve_in_thread(daemon) as endpoint, dealer(endpoint) as sock:
            for rid, (shape, fmt, conf, iou, max_det) in enumerate(FRAMES):
                image = rng.integers(0, 256, size=shape, dtype=np.uint8)
                for shm in (False, True, True):  # in the message, then twice in shared memory
                    ref = None
                    if shm:
                        buf = segment.buf
                        assert buf is not None
                        np.frombuffer(buf, np.uint8)[4096 : 4096 + image.nbytes] = image.ravel()
                        ref = ShmRef(segment.name, 4096, segment.size, bytes(16))
                    request = InferRequest(rid, "demo", image, format=fmt, conf=conf, iou=iou,
                                           max_det=max_det, shm=ref)  # fmt: skip
                    sock.send_multipart(protocol.encode(request))
                    reply = recv(sock)
                    assert isinstance(reply, InferReply)
                    assert reply.status is Status.OK, reply.message
                    out.append(reply.detections)
    finally:
        segment.close()
        segment.unlink()
    return out


def test_the_gpu_chain_gives_the_numpy_references_detections(tmp_path: Path) -> None:
    python = _detections(tmp_path, "cpu")
    native = _detections(tmp_path, "cuda")
    assert sum(len(d) for d in python) > 0  # the comparison has boxes to compare
    for i, (p, n) in enumerate(zip(python, native, strict=True)):
        # the same boxes and classes; the GPU's float32 math may differ in the last bit
        assert n.shape == p.shape, f"frame {i}"
        np.testing.assert_array_equal(n[:, 5], p[:, 5], err_msg=f"frame {i}")
        np.testing.assert_allclose(n[:, :5], p[:, :5], rtol=1e-5, atol=1e-3, err_msg=f"frame {i}")
