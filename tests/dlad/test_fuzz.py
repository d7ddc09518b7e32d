"""A short fuzzing campaign against a running daemon (the long one: bench/fuzz_frontend.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import zmq

from dlad import protocol
from dlad.config import load_config
from dlad.daemon import Daemon
from dlad.errors import ProtocolError, Status
from dlad_bench.fuzz import campaign, messages
from tests.dlad.serving import serve_in_thread

CONFIG = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
cheap_requests_per_s = 1000000.0  # every malformed message reaches the decoder's words
max_message_bytes = 262144
max_image_width = 256
max_image_height = 256
[metrics]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = 300.0
[devices.gpu]
kind = "gpu"
mode = "timing"
latency_us = 300.0
[models.demo]
devices = ["dla0", "gpu"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def test_the_generator_is_reproducible_and_stays_under_the_zeromq_guard() -> None:
    first = list(itertools.islice(messages(3, max_message_bytes=4096), 500))
    assert first == list(itertools.islice(messages(3, max_message_bytes=4096), 500))
    assert all(sum(map(len, m)) < 2 * 4096 for m in first)
    limits = protocol.Limits(max_message_bytes=4096, max_header_bytes=4096)
    refused = sum(not _decodes(frames, limits) for frames in first)
    assert 300 < refused < 500  # mostly malformed, some left valid


def _decodes(frames: list[bytes], limits: protocol.Limits) -> bool:
    try:
        protocol.decode_request(frames, limits)
    except ProtocolError:
        return False
    return True


def test_a_short_campaign_crashes_nothing_and_every_message_is_answered(tmp_path: Path) -> None:
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(CONFIG)
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"])
    with serve_in_thread(daemon) as endpoint:
        result = campaign(endpoint, 3000, seed=11, max_message_bytes=262144)
        assert (result.sent, result.replies, result.undecodable) == (3000, 3000, 0)
        assert result.statuses["BAD_REQUEST"] > 1500
        assert result.statuses["OK"] > 0  # the valid requests among them were served
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        with ctx.socket(zmq.DEALER) as sock:
            sock.connect(endpoint)
            sock.send_multipart(protocol.encode(protocol.StatusRequest(1)))
            assert sock.poll(20_000)
            assert protocol.decode_reply(sock.recv_multipart()).status == Status.OK
