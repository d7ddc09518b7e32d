"""Authentication of clients: ZeroMQ CURVE with a ZAP handler and an allow-list of client keys.

With ``[auth] mode = "curve"`` the frontend's ROUTER is a CURVE server with the daemon's secret
key (``server_secret_key``: a certificate file as :func:`write_keypair` or
``zmq.auth.create_certificates`` write it). A client must know the server's public key and
present a key pair of its own whose public key is in ``client_keys_dir`` (one certificate file
each, ``*.key``; secret files there are refused). ZeroMQ's handshake refuses every other client
before it can send a message; the daemon logs each refusal (``client_refused``, at most one line
per key and minute) and counts it (``dlad_auth_refused_total``).

Rotation: add the client's new public key file to ``client_keys_dir``; the daemon re-reads the
directory every ``reload_s`` (new connections then use it); when the client runs on its new key,
delete the old file. A connection authenticated with a key that is later removed stays open
until it reconnects (ZeroMQ authenticates at the handshake).

The key identifies the client (the ZAP User-Id, its public key in Z85): per-client limits and
fairness count by it (docs/protocol.md "Clients and connections").

The KServe ports (HTTP, gRPC) have no CURVE: there, :class:`BearerTokens` (``[kserve]
tokens_file``) plays the allow-list's part, a token's name the key's, with TLS for the wire.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from dlad.errors import StartupError

__all__ = [
    "BearerTokens", "ClientKeys", "Gate", "configure_client", "configure_server",
    "read_server_keys", "start_gate", "write_keypair",
]  # fmt: skip

log = structlog.get_logger("dlad")
ZAP_DOMAIN = "dlad"


def write_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write a new CURVE key pair ``<name>.key`` (public) and ``<name>.key_secret`` in
    ``directory`` (created, mode 0700; the secret file 0600). Returns their paths."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def read_server_keys(path: Path, key: str = "auth.server_secret_key") -> tuple[bytes, bytes]:
    """The (public, secret) keys of a secret certificate file. Raises StartupError naming
    ``key`` when the file is missing, unreadable or holds no secret key."""
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read the key file {path}: {exc}", key=key) from None
    if not secret:
        raise StartupError(f"{path} holds no secret key (use the .key_secret file)", key=key)
    return public, secret


class ClientKeys:
    """The allow-list: the public keys in ``directory``, re-read when it changes. Also the
    credentials provider of the ZAP handler (:meth:`callback`)."""

    def __init__(self, directory: Path, *, on_refused: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self._keys: frozenset[bytes] = frozenset()
        self._stamp: tuple[float, int] | None = None
        self._on_refused = on_refused
        self._logged: dict[bytes, float] = {}  # key -> when a refusal was last logged
        self.reload()

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self) -> bool:
        """Re-read the directory if it changed since the last read. Returns whether it did.
        Raises StartupError when it cannot be read."""
        try:
            st = self.directory.stat()
            stamp = (st.st_mtime, len(os.listdir(self.directory)))
        except OSError as exc:
            raise StartupError(f"cannot read {self.directory}: {exc.strerror}",
                               key="auth.client_keys_dir") from None  # fmt: skip
        if stamp == self._stamp:
            return False
        keys = set()
        for path in sorted(self.directory.glob("*.key")):
            try:
                public, secret = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError) as exc:
                log.warning("client_key_unreadable", file=str(path), reason=str(exc)[:200])
                continue
            if secret:
                log.warning("client_key_refused", file=str(path), reason="holds a secret key")
                continue
            keys.add(public)
        self._keys, self._stamp = frozenset(keys), stamp
        log.info("client_keys", directory=str(self.directory), keys=len(keys))
        return True

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: whether the client with public key ``key`` (Z85) may connect."""
        if key in self._keys:
            return True
        if self._on_refused is not None:
            self._on_refused(domain)
        now = time.monotonic()
        if now - self._logged.get(key, -60.0) >= 60.0:  # one line per key and minute
            if len(self._logged) > 1024:
                self._logged.clear()
            self._logged[key] = now
            log.warning("client_refused", key=key.decode("ascii", "replace"), reason="not allowed")
        return False


class Gate(AsyncioAuthenticator):
    """The daemon's ZAP handler: every handshake (NULL or CURVE) asks it. It refuses a
    connection when ``max_connections`` others are established (``established``, the frontend's
    count: connections that have spoken or outlived the handshake deadline, so that connections
    that never finish a handshake cannot take an authenticated client's place), then lets
    pyzmq's authenticator judge CURVE keys against the allow-list."""

    def __init__(
        self, ctx: zmq.Context[Any], max_connections: int, on_refused: Callable[[], None]
    ) -> None:
        super().__init__(ctx)
        self.max_connections = max_connections
        self.established: Callable[[], int] = lambda: 0
        self._on_refused = on_refused

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6 and self.established() >= self.max_connections:
            self._on_refused()
            self._send_zap_reply(msg[1], b"400", b"too many connections")  # RFC 27's reply
            return
        await super().handle_zap_message(msg)


def start_gate(
    ctx: zmq.Context[Any],
    max_connections: int,
    *,
    keys: ClientKeys | None,
    on_refused: Callable[[], None],
) -> Gate:
    """Start the ZAP handler for ``ctx`` (on the running event loop): the connection cap, and
    CURVE keys checked against ``keys`` when given."""
    gate = Gate(ctx, max_connections, on_refused)
    gate.start()
    if keys is not None:
        gate.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=keys)
    return gate


def configure_client(sock: zmq.Socket[Any], server_public: bytes, client_secret_file: Path) -> None:
    """Make ``sock`` a CURVE client of the server with ``server_public``, with the key pair in
    ``client_secret_file`` (before it connects). Raises StartupError naming ``--curve-key``."""
    public, secret = read_server_keys(client_secret_file, key="--curve-key")
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def configure_server(sock: zmq.Socket[Any], public: bytes, secret: bytes) -> None:
    """Make ``sock`` a CURVE server with this key pair (before it binds)."""
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


class BearerTokens:
    """The KServe ports' allow-list: ``name token`` lines of ``path`` (``#`` comments, blank
    lines), re-read when the file changes. A request's ``Authorization: Bearer <token>`` names
    its client (:meth:`client`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tokens: tuple[tuple[bytes, str], ...] = ()
        self._stamp: tuple[float, int] | None = None
        self.reload()

    def __len__(self) -> int:
        return len(self._tokens)

    def reload(self) -> bool:
        """Re-read the file if it changed since the last read; returns whether it did. Raises
        StartupError when it cannot be read or a line is not ``name token``."""
        key = "kserve.tokens_file"
        try:
            st = self.path.stat()
            if (st.st_mtime, st.st_size) == self._stamp:
                return False
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            raise StartupError(f"cannot read {self.path}: {why}", key=key) from None
        tokens = []
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2 or len(words[1]) < 16:
                raise StartupError(f"{self.path}:{number}: a line is `name token` (a token of "
                                   "16 characters at least)", key=key)  # fmt: skip
            tokens.append((words[1].encode(), words[0]))
        self._tokens, self._stamp = tuple(tokens), (st.st_mtime, st.st_size)
        log.info("kserve_tokens", file=str(self.path), tokens=len(tokens))
        return True

    def client(self, authorization: str | None) -> str | None:
        """The name of the token an ``Authorization`` value carries, or None (no such token,
        or not ``Bearer <token>``). Compares in constant time against every token."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        given = token.strip().encode()
        found = None
        for known, name in self._tokens:
            if hmac.compare_digest(given, known) and found is None:
                found = name
        return found
