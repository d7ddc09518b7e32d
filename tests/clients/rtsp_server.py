"""A small RTSP server for the tests: one H.264 stream over TCP (RTP interleaved, RFC 2326 and
RFC 6184, packetization mode 1), played in real time from frames encoded once, which can drop
its clients mid-stream. FFmpeg's RTSP client (PyAV) reads it as it reads a camera.

The registry has no RTSP server to start from a test (FFmpeg's own RTSP support is a client
and a pusher); this one speaks only what a camera's RTSP server must to FFmpeg: OPTIONS,
DESCRIBE (SDP with the SPS and PPS), SETUP (``RTP/AVP/TCP;interleaved=0-1``), PLAY, then RTP.
"""

from __future__ import annotations

import base64
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

MTU = 1400  # the largest RTP payload sent; larger NAL units go in FU-A fragments


def encode(frames: list[np.ndarray], fps: int) -> list[list[bytes]]:
    """Each RGB frame as H.264 NAL units (SPS and PPS before every IDR), one list a frame."""
    h, w = frames[0].shape[:2]
    codec = av.CodecContext.create("libx264", "w")
    codec.width, codec.height, codec.pix_fmt = w, h, "yuv420p"
    codec.time_base, codec.framerate = Fraction(1, fps), Fraction(fps, 1)
    codec.options = {"preset": "ultrafast", "tune": "zerolatency", "g": str(fps),
                     "x264-params": "repeat-headers=1:bframes=0"}  # fmt: skip
    packets = []
    for i, rgb in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame.pts = i
        packets += codec.encode(frame)
    packets += codec.encode(None)
    return [_nal_units(bytes(p)) for p in packets]


def _nal_units(annex_b: bytes) -> list[bytes]:
    """The NAL units of an Annex B byte stream (start codes of 3 or 4 bytes)."""
    out, i, n = [], 0, len(annex_b)
    starts = []
    while i < n - 2:
        if annex_b[i] == 0 and annex_b[i + 1] == 0 and annex_b[i + 2] == 1:
            starts.append(i + 3)
            i += 3
        else:
            i += 1
    for k, s in enumerate(starts):
        end = starts[k + 1] - 3 if k + 1 < len(starts) else n
        unit = annex_b[s:end].rstrip(b"\x00") if k + 1 < len(starts) else annex_b[s:end]
        if unit:
            out.append(unit)
    return out


@dataclass
class Stream:
    """What the server plays: NAL units a frame, at ``fps``; a client is dropped after
    ``drop_after`` frames (0: never)."""

    units: list[list[bytes]]
    fps: int
    drop_after: int = 0
    sessions: int = 0  # PLAYs served
    dropped: int = 0  # clients dropped mid-stream
    lock: threading.Lock = field(default_factory=threading.Lock)

    def parameter_sets(self) -> tuple[bytes, bytes]:
        sps = next(u for f in self.units for u in f if u[0] & 0x1F == 7)
        pps = next(u for f in self.units for u in f if u[0] & 0x1F == 8)
        return sps, pps


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        stream = self.server.stream
        while True:
            request = self._read_request()
            if request is None:
                return
            method, url, headers = request
            cseq = headers.get("cseq", "0")
            if method == "OPTIONS":
                self._reply(cseq, ["Public: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN"])
            elif method == "DESCRIBE":
                sps, pps = stream.parameter_sets()
                sets = ",".join(base64.b64encode(p).decode() for p in (sps, pps))
                sdp = ("v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\ns=dlad test\r\nc=IN IP4 0.0.0.0\r\n"
                       "t=0 0\r\nm=video 0 RTP/AVP 96\r\na=rtpmap:96 H264/90000\r\n"
                       f"a=fmtp:96 packetization-mode=1;sprop-parameter-sets={sets}\r\n"
                       "a=control:trackID=0\r\n").encode()  # fmt: skip
                self._reply(cseq, [f"Content-Base: {url}/", "Content-Type: application/sdp",
                                   f"Content-Length: {len(sdp)}"], sdp)  # fmt: skip
            elif method == "SETUP":
                if "TCP" not in headers.get("transport", ""):
                    self._reply(cseq, [], status="461 Unsupported Transport")
                    continue
                self._reply(cseq, ["Transport: RTP/AVP/TCP;unicast;interleaved=0-1",
                                   "Session: 4242;timeout=60"])  # fmt: skip
            elif method == "PLAY":
                self._reply(cseq, ["Session: 4242", "Range: npt=0.000-"])
                with stream.lock:
                    stream.sessions += 1
                self._play(stream)
                return
            elif method == "TEARDOWN":
                self._reply(cseq, ["Session: 4242"])
                return
            else:
                self._reply(cseq, [], status="501 Not Implemented")

    def _read_request(self) -> tuple[str, str, dict[str, str]] | None:
        line = self.rfile.readline()
        while line in (b"\r\n", b"\n"):
            line = self.rfile.readline()
        if not line:
            return None
        method, url, _ = line.decode().split(" ", 2)
        headers = {}
        while (row := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = row.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        if int(headers.get("content-length", 0)):
            self.rfile.read(int(headers["content-length"]))
        return method, url, headers

    def _reply(
        self, cseq: str, lines: list[str], body: bytes = b"", status: str = "200 OK"
    ) -> None:
        head = "\r\n".join([f"RTSP/1.0 {status}", f"CSeq: {cseq}", *lines, "", ""])
        self.wfile.write(head.encode() + body)

    def _play(self, stream: Stream) -> None:
        """RTP over the connection in real time, looping, until the client goes or the
        stream's ``drop_after`` frames have gone (then the connection is cut)."""
        seq, ssrc, period = 0, 0x0D1AD, 1.0 / stream.fps
        start = time.monotonic()
        n = 0
        try:
            while True:
                if stream.drop_after and n == stream.drop_after:
                    with stream.lock:
                        stream.dropped += 1
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                stamp = (n * 90_000 // stream.fps) & 0xFFFFFFFF
                units = stream.units[n % len(stream.units)]
                for k, unit in enumerate(units):
                    for payload, last in _packets(unit):
                        marker = last and k == len(units) - 1
                        header = struct.pack("!BBHII", 0x80, (0x80 if marker else 0) | 96,
                                             seq & 0xFFFF, stamp, ssrc)  # fmt: skip
                        packet = header + payload
                        self.wfile.write(b"$\x00" + struct.pack("!H", len(packet)) + packet)
                        seq += 1
                self.wfile.flush()
                n += 1
                delay = start + n * period - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        except OSError:
            return  # the client went


def _packets(unit: bytes) -> Iterator[tuple[bytes, bool]]:
    """A NAL unit's RTP payloads (single, or FU-A fragments) and whether each is its last."""
    if len(unit) <= MTU:
        yield unit, True
        return
    indicator = (unit[0] & 0xE0) | 28
    kind = unit[0] & 0x1F
    body = unit[1:]
    for at in range(0, len(body), MTU):
        first, last = at == 0, at + MTU >= len(body)
        header = (0x80 if first else 0) | (0x40 if last else 0) | kind
        yield bytes([indicator, header]) + body[at : at + MTU], last


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, stream: Stream) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.stream = stream


@contextmanager
def rtsp_server(stream: Stream) -> Iterator[str]:
    """Serve ``stream``; yields its URL."""
    server = _Server(stream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"rtsp://127.0.0.1:{server.server_address[1]}/cam"
    finally:
        server.shutdown()
        server.server_close()
