"""CURVE authentication: who may connect, key rotation, and what the config refuses."""

from __future__ import annotations

import copy
import functools
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dlad.auth import write_keypair
from dlad.config import ConfigError, load_config, parse_config
from dlad.daemon import Daemon
from dlad_client import Client, ClientTimeout, CurveKeys
from tests.dlad.serving import serve_in_thread
from tests.dlad.test_config import SHIPPED_DATA
from tests.dlad.test_metrics import wait_for

CONFIG = """
[frontend]
endpoints = ["tcp://127.0.0.1:5555"]
[metrics]
enabled = false
[auth]
mode = "curve"
server_secret_key = "keys/server.key_secret"
client_keys_dir = "allowed"
[devices.dla0]
kind = "dla"
core = 0
mode = "timing"
latency_us = 500.0
[models.demo]
devices = ["dla0"]
[models.demo.loadables]
core0 = "bundled:demo/fp16_heads.dla0.emu"
"""


def _refused(daemon: Daemon) -> float:
    return daemon.metrics.registry.get_sample_value("dlad_auth_refused_total") or 0.0


def _refused_since(daemon: Daemon, before: float) -> bool:
    return _refused(daemon) > before


@pytest.fixture
def keyed(tmp_path: Path) -> tuple[Path, Daemon]:
    write_keypair(tmp_path / "keys", "server")
    write_keypair(tmp_path / "keys", "alice")
    write_keypair(tmp_path / "keys", "mallory")
    (tmp_path / "allowed").mkdir()
    (tmp_path / "allowed" / "alice.key").write_bytes((tmp_path / "keys" / "alice.key").read_bytes())
    (tmp_path / "dlad.toml").write_text(CONFIG)
    plan = load_config(tmp_path / "dlad.toml").plan()
    return tmp_path, Daemon(plan, endpoints=["tcp://127.0.0.1:0"])


def _keys(root: Path, name: str) -> CurveKeys:
    return CurveKeys.from_files(root / "keys" / "server.key", root / "keys" / f"{name}.key_secret")


def test_keygen_writes_a_pair_with_a_private_secret(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dlad.cli", "keygen", "cam-7", "--dir", str(tmp_path / "k")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "cam-7.key_secret" in out.stdout
    secret = tmp_path / "k" / "cam-7.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    keys = CurveKeys.from_files(tmp_path / "k" / "cam-7.key", secret)
    assert len(keys.public) == len(keys.secret) == 40  # Z85 of 32 bytes


def test_only_allowed_keys_get_answers_and_rotation_takes_effect(keyed: Any) -> None:
    root, daemon = keyed
    with serve_in_thread(daemon) as ep:
        with Client(ep, curve=_keys(root, "alice"), timeout_s=20) as alice:
            assert alice.status()["ready"]
        for who in ("mallory", None):  # an unknown key; no key at all
            before = _refused(daemon)
            curve = _keys(root, who) if who else None
            with Client(ep, curve=curve, timeout_s=0.5) as stranger:
                with pytest.raises(ClientTimeout, match="none connected"):
                    stranger.status()  # the handshake never completes: nothing is sent
                if who is not None:
                    wait_for(functools.partial(_refused_since, daemon, before))  # refused that key
        assert daemon.counters.received == 1  # alice's STATUS, no more
        # Rotation: allow mallory's key, then withdraw alice's.
        allowed = root / "allowed"
        (allowed / "mallory.key").write_bytes((root / "keys" / "mallory.key").read_bytes())
        (allowed / "alice.key").unlink()
        assert daemon.frontend.client_keys is not None
        daemon.frontend.client_keys.reload()  # what the heartbeat does every reload_s
        with Client(ep, curve=_keys(root, "mallory"), timeout_s=20) as mallory:
            assert mallory.status()["ready"]
        before = _refused(daemon)
        with Client(ep, curve=_keys(root, "alice"), timeout_s=0.5) as alice:
            with pytest.raises(ClientTimeout, match="none connected"):
                alice.status()
            wait_for(lambda: _refused(daemon) > before)


def test_the_config_refuses_what_auth_cannot_serve(tmp_path: Path) -> None:
    data = copy.deepcopy(SHIPPED_DATA)
    data["frontend"]["endpoints"] = ["tcp://*:5555"]
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert (info.value.key, "beyond loopback" in info.value.reason) == (
        "frontend.endpoints[0]", True,
    )  # fmt: skip
    data["auth"] = {"allow_plain_tcp": True}
    parse_config(data)  # said out loud: a trusted network
    data["auth"] = {"mode": "curve"}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "auth.server_secret_key"
    data["auth"] = {"mode": "curve", "server_secret_key": "nope", "client_keys_dir": "."}
    with pytest.raises(ConfigError) as info:
        parse_config(data, source=tmp_path / "x.toml").plan()
    assert info.value.key == "auth.server_secret_key"
    assert "no such file" in info.value.reason
    data["auth"] = {"server_secret_key": "x"}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.key == "auth.server_secret_key"


def test_an_ipc_socket_file_gets_the_configured_mode(tmp_path: Path) -> None:
    text = CONFIG.replace('[auth]\nmode = "curve"\nserver_secret_key = "keys/server.key_secret"\n'
                          'client_keys_dir = "allowed"\n', "")  # fmt: skip
    text = text.replace('endpoints = ["tcp://127.0.0.1:5555"]',
                        'endpoints = ["ipc://dlad.sock"]\nipc_mode = 0o600')  # fmt: skip
    (tmp_path / "dlad.toml").write_text(text)
    daemon = Daemon(load_config(tmp_path / "dlad.toml").plan())
    with serve_in_thread(daemon):
        assert stat.S_IMODE(os.stat(tmp_path / "dlad.sock").st_mode) == 0o600


def test_dlad_bench_takes_client_keys(keyed: Any) -> None:
    from dlad_bench.cli import main

    root, daemon = keyed
    args = ["--input", "random:32x32", "--warmup-s", "0.1", "--window-s", "0.3",
            "--stability-pct", "50", "--max-trials", "3", "--timeout-s", "5",
            "--connect-timeout-s", "10", "--quiet", "--concurrency", "1"]  # fmt: skip
    keys = ["--curve-server-key", str(root / "keys" / "server.key"),
            "--curve-key", str(root / "keys" / "alice.key_secret")]  # fmt: skip
    with serve_in_thread(daemon) as ep:
        assert main(["--endpoint", ep, *args, *keys]) == 0
        assert main(["--endpoint", ep, *args, keys[0], keys[1]]) == 2  # one without the other
