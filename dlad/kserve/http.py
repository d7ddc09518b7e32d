"""The Open Inference Protocol over HTTP/REST (aiohttp), with Triton's binary tensor data.

Routes (``{v}``: ``/versions/<version>``, optional)::

    GET  /v2/health/live                 200 while the daemon runs
    GET  /v2/health/ready                200 when it serves, else 503
    GET  /v2                             server metadata
    GET  /v2/models/<model>{v}           model metadata
    GET  /v2/models/<model>{v}/ready     200 when a device serves the model, else 503
    POST /v2/models/<model>{v}/infer     inference

An infer body is the protocol's JSON, or (Triton's binary extension) that JSON followed by the
inputs' bytes, its length in the ``Inference-Header-Content-Length`` header and each binary
input's size in its ``binary_data_size`` parameter. Outputs come back in binary the same way
where the request asks (an output's ``binary_data`` parameter, or the request's
``binary_data_output``), else as JSON ``data``. An error is ``{"error": "<message>"}`` with the
status's HTTP code (:data:`dlad.kserve.core.HTTP_CODES`) and a ``dlad-status`` header naming it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

import structlog
from aiohttp import web

from dlad.auth import BearerTokens
from dlad.errors import BadRequest, DladError, InternalError, Status
from dlad.kserve.core import HTTP_CODES, MODEL_VERSION, Answer, Call, Gateway, Tensor

__all__ = ["HttpServer"]

log = structlog.get_logger("dlad")
_HEADER_LENGTH: Final = "Inference-Header-Content-Length"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, name: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers={"dlad-status": name})


def _fail(exc: DladError) -> web.Response:
    return _error(HTTP_CODES.get(exc.status, 500), exc.message, exc.status.name)


def _ready(ok: bool) -> web.Response:
    return web.Response(status=200 if ok else 503)


class HttpServer:
    """The HTTP/REST server for ``gateway`` on ``host:port`` (``port`` 0: any free one, see
    :attr:`port`). ``tokens``: the allow-list (None: none needed); ``tls``: HTTPS."""

    def __init__(
        self,
        gateway: Gateway,
        host: str,
        port: int,
        *,
        tokens: BearerTokens | None = None,
        tls: ssl.SSLContext | None = None,
        max_body_bytes: int,
    ) -> None:
        self.gateway = gateway
        self.host = host
        self.port = port
        self.tokens = tokens
        self._tls = tls
        self._max = max_body_bytes
        app = web.Application(client_max_size=max_body_bytes, middlewares=[self._guard])
        versioned = "/v2/models/{model}{version:(/versions/[^/]+)?}"
        app.add_routes([
            web.get("/v2/health/live", self._live),
            web.get("/v2/health/ready", self._server_ready),
            web.get("/v2", self._server_metadata),
            web.get(versioned, self._model_metadata),
            web.get(versioned + "/ready", self._model_ready),
            web.post(versioned + "/infer", self._infer),
        ])  # fmt: skip
        # a client that goes away cancels its request (a queued image is cancelled in the plane)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, handler_cancellation=True
        )

    async def start(self) -> None:
        """Bind and serve (OSError: the address cannot be bound)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._tls)
        await site.start()
        server = cast("asyncio.Server | None", site._server)  # aiohttp keeps the bound one here
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        await self._runner.cleanup()

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    # ------------------------------------------------------------------ requests
    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Tokens (health checks aside), and no request's failure reaches aiohttp as a
        traceback: an HTTP error keeps its code, a bug is a logged 500."""
        guarded = self.tokens is not None and not request.path.startswith("/v2/health/")
        if guarded and self._client(request) is None:
            return _error(
                401, "a valid `Authorization: Bearer <token>` is required", "UNAUTHENTICATED"
            )
        try:
            return await handler(request)
        except DladError as exc:
            return _fail(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"the body is larger than the {self._max} bytes a request may "
                "carry ([frontend] max_message_bytes)",
                Status.BAD_REQUEST.name,
            )
        except web.HTTPException as exc:
            return _error(exc.status, exc.reason, Status.BAD_REQUEST.name
                          if exc.status < 500 else Status.INTERNAL.name)  # fmt: skip
        except Exception as exc:  # a bug: answered, logged
            log.error("kserve_internal_error", path=request.path,
                      error=f"{type(exc).__name__}: {exc}"[:200], exc_info=exc)  # fmt: skip
            return _fail(InternalError(f"internal error ({type(exc).__name__}); "
                                       "see the daemon's log"))  # fmt: skip

    def _client(self, request: web.Request) -> str | None:
        """Who sends ``request``: its token's name (None: no valid token where one is needed),
        or its peer's address."""
        if self.tokens is None:
            return request.remote or ""
        return self.tokens.client(request.headers.get("Authorization"))

    async def _live(self, request: web.Request) -> web.Response:
        return _ready(True)

    async def _server_ready(self, request: web.Request) -> web.Response:
        return _ready(self.gateway.ready())

    async def _server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.gateway.server_metadata())

    @staticmethod
    def _model(request: web.Request) -> tuple[str, str]:
        return request.match_info["model"], request.match_info["version"].rpartition("/")[2]

    async def _model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.gateway.model_metadata(*self._model(request)))

    async def _model_ready(self, request: web.Request) -> web.Response:
        return _ready(self.gateway.model_ready(*self._model(request)))

    async def _infer(self, request: web.Request) -> web.Response:
        model, version = self._model(request)
        body = await request.read()
        head, binary = self._split(body, request.headers.get(_HEADER_LENGTH))
        try:
            doc = json.loads(head)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"the request is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise BadRequest("the request is a JSON object")
        inputs = self._inputs(doc.get("inputs"), binary)
        parameters = _object(doc.get("parameters", {}), "parameters")
        outputs, as_binary = self._outputs(doc.get("outputs"), parameters)
        request_id = doc.get("id", "")
        if not isinstance(request_id, str):
            raise BadRequest("id is a string")
        call = Call(model, version, request_id, parameters, inputs, outputs,
                    owner=f"http:{self._client(request)}")  # fmt: skip
        return self._answer(await self.gateway.infer(call), as_binary)

    @staticmethod
    def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
        if header_length is None:
            return body, memoryview(b"")
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadRequest(f"{_HEADER_LENGTH} must be the JSON's length, at most the body's "
                             f"{len(body)} bytes, got {header_length!r}")  # fmt: skip
        n = int(header_length)
        return body[:n], memoryview(body)[n:]

    @staticmethod
    def _inputs(raw: object, binary: memoryview) -> list[Tensor]:
        if not isinstance(raw, list):
            raise BadRequest("inputs is a list of tensors")
        tensors, at = [], 0
        for i, item in enumerate(raw):
            t = _object(item, f"inputs[{i}]")
            name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape")
            if not isinstance(name, str) or not isinstance(datatype, str):
                raise BadRequest(f"inputs[{i}] has a name and a datatype (strings)")
            if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in shape
            ):
                raise BadRequest(f"inputs[{i}].shape is a list of integers")
            params = _object(t.get("parameters", {}), f"inputs[{i}].parameters")
            size = params.pop("binary_data_size", None)
            if size is not None:
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise BadRequest(f"inputs[{i}].parameters.binary_data_size is a byte count")
                if at + size > len(binary):
                    raise BadRequest(f"inputs[{i}] says {size} binary bytes; the body has "
                                     f"{len(binary) - at} more")  # fmt: skip
                tensors.append(Tensor(name, datatype, tuple(shape), params,
                                      raw=binary[at : at + size]))  # fmt: skip
                at += size
            elif "data" in t:
                data = t["data"] if isinstance(t["data"], list) else [t["data"]]
                tensors.append(Tensor(name, datatype, tuple(shape), params, values=data))
            else:
                raise BadRequest(f"inputs[{i}] has data, or binary_data_size")
        if at != len(binary):
            raise BadRequest(f"{len(binary) - at} binary bytes follow the inputs'")
        return tensors

    @staticmethod
    def _outputs(raw: object, parameters: dict[str, Any]) -> tuple[list[str] | None, set[str]]:
        """The outputs asked for (None: all) and those wanted in binary."""
        everything = parameters.get("binary_data_output") is True
        if raw is None:
            return None, {"*"} if everything else set()
        if not isinstance(raw, list):
            raise BadRequest("outputs is a list")
        names, binary = [], set()
        for i, item in enumerate(raw):
            o = _object(item, f"outputs[{i}]")
            name = o.get("name")
            if not isinstance(name, str):
                raise BadRequest(f"outputs[{i}].name is a string")
            names.append(name)
            params = _object(o.get("parameters", {}), f"outputs[{i}].parameters")
            if params.get("binary_data", everything) is True:
                binary.add(name)
        return names, binary

    @staticmethod
    def _answer(answer: Answer, as_binary: set[str]) -> web.Response:
        outputs, chunks = [], []
        for o in answer.outputs:
            doc: dict[str, Any] = {"name": o.name, "datatype": o.datatype, "shape": list(o.shape)}
            if "*" in as_binary or o.name in as_binary:
                raw = o.raw()
                doc["parameters"] = {"binary_data_size": len(raw)}
                chunks.append(raw)
            else:
                doc["data"] = o.values()
            outputs.append(doc)
        head = json.dumps({
            "model_name": answer.model, "model_version": MODEL_VERSION, "id": answer.id,
            "parameters": answer.parameters, "outputs": outputs,
        }).encode()  # fmt: skip
        if not chunks:
            return web.Response(body=head, content_type="application/json")
        return web.Response(body=b"".join([head, *chunks]),
                            content_type="application/octet-stream",
                            headers={_HEADER_LENGTH: str(len(head))})  # fmt: skip


def _object(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"{what} is a JSON object")
    return dict(value)
