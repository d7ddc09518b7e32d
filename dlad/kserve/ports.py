"""The daemon's KServe ports: the gateway and its HTTP and gRPC servers, from ``[kserve]``."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

import dlad
from dlad.auth import BearerTokens
from dlad.errors import StartupError

if TYPE_CHECKING:
    from dlad.config import Plan
    from dlad.frontend import Frontend
    from dlad.kserve.grpc import GrpcServer
    from dlad.kserve.http import HttpServer

__all__ = ["KServePorts"]

log = structlog.get_logger("dlad")


class KServePorts:
    """``[kserve]``'s servers for a daemon: requests go to ``frontend.infer_local``.

    Args:
        plan: the daemon's plan (its config's ``[kserve]``, models and limits).
        frontend: the daemon's frontend.
        ready: whether the daemon serves.
        model_ready: whether a device serves the named model now.
        ports: override the configured ports ({"http": 0} binds any free port; tests).
    """

    def __init__(
        self,
        plan: Plan,
        frontend: Frontend,
        *,
        ready: Callable[[], bool],
        model_ready: Callable[[str], bool],
        ports: dict[str, int] | None = None,
    ) -> None:
        try:
            from dlad.kserve.core import Gateway, ModelInfo  # noqa: PLC0415
            from dlad.kserve.grpc import GrpcServer  # noqa: PLC0415
            from dlad.kserve.http import HttpServer  # noqa: PLC0415
        except ImportError as exc:
            raise StartupError(f"[kserve] needs the kserve extra (pip install 'dlad[kserve]'): "
                               f"{exc}", key="kserve.enabled") from None  # fmt: skip
        config = plan.config
        k = config.kserve
        models = {}
        for m in config.models:
            placements = plan.for_model(m.name)
            if placements:
                lo = placements[0].loadable
                models[m.name] = ModelInfo(m.name, lo.family, tuple(lo.class_names))
        self.gateway = Gateway(
            name=config.daemon.name, version=dlad.__version__, models=models,
            limits=frontend.limits, infer=frontend.infer_local, ready=ready,
            model_ready=model_ready, decode_threads=k.decode_threads,
        )  # fmt: skip
        self.tokens = None if k.tokens_file is None else BearerTokens(plan.base_dir / k.tokens_file)
        cert = None if k.tls_cert_file is None else plan.base_dir / k.tls_cert_file
        key = None if k.tls_key_file is None else plan.base_dir / k.tls_key_file
        addresses = k.addresses()
        for name, port in (ports or {}).items():
            addresses[name] = (addresses[name][0], port)
        self.http: HttpServer | None = None
        self.grpc: GrpcServer | None = None
        limit = config.frontend.max_message_bytes
        if "http" in addresses:
            context = None
            if cert is not None and key is not None:
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                _load(lambda: context.load_cert_chain(cert, key), "kserve.tls_cert_file")
            self.http = HttpServer(self.gateway, *addresses["http"], tokens=self.tokens,
                                   tls=context, max_body_bytes=limit)  # fmt: skip
        if "grpc" in addresses:
            tls = None
            if cert is not None and key is not None:
                tls = _load(lambda: (cert.read_bytes(), key.read_bytes()), "kserve.tls_cert_file")
            self.grpc = GrpcServer(self.gateway, *addresses["grpc"], tokens=self.tokens,
                                   tls=tls, max_message_bytes=limit)  # fmt: skip

    async def start(self) -> None:
        """Bind and serve both. Raises StartupError naming the port that cannot be bound."""
        for key, server in (("http", self.http), ("grpc", self.grpc)):
            if server is None:
                continue
            try:
                await server.start()
            except OSError as exc:
                why = exc.strerror or str(exc)
                raise StartupError(f"cannot serve KServe {key} on {server.host}:{server.port}: "
                                   f"{why}", key=f"kserve.{key}") from None  # fmt: skip
        log.info("kserve", http=None if self.http is None else self.http.url,
                 grpc=None if self.grpc is None else self.grpc.address,
                 tokens=None if self.tokens is None else len(self.tokens))  # fmt: skip

    async def close(self) -> None:
        if self.grpc is not None:
            await self.grpc.close()
        if self.http is not None:
            await self.http.close()

    def reload_tokens(self) -> None:
        """Re-read the tokens file if it changed (a broken one keeps the last list)."""
        if self.tokens is None:
            return
        try:
            self.tokens.reload()
        except StartupError as exc:
            log.warning("kserve_tokens_unreadable", reason=exc.message)


def _load(read: Callable[[], Any], key: str) -> Any:
    try:
        return read()
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot read the TLS certificate or key: {exc}", key=key) from None
