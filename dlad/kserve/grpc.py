"""The Open Inference Protocol over gRPC (grpcio's asyncio server).

The service is ``inference.GRPCInferenceService`` (``open_inference.proto``, loaded at run time
by grpcio-tools): ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and
ModelInfer; Triton's other methods answer UNIMPLEMENTED. Inputs come in ``raw_input_contents``
or in typed ``contents``; outputs go back in ``raw_output_contents``. A client's deadline is the
INFER's deadline (or bounds the ``deadline_ms`` it names). An error aborts the call with
:data:`GRPC_CODES`'s code for its status, the status's name in the ``dlad-status`` trailer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Final

import grpc
import structlog

from dlad.auth import BearerTokens
from dlad.errors import DladError, InternalError, Status
from dlad.kserve.core import MODEL_VERSION, Call, Gateway, Tensor

__all__ = ["GRPC_CODES", "GrpcServer", "messages"]

log = structlog.get_logger("dlad")

GRPC_CODES: Final = {
    Status.BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.OVERLOADED: grpc.StatusCode.UNAVAILABLE,
    Status.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Status.CANCELLED: grpc.StatusCode.CANCELLED,
    Status.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    Status.DEVICE_FAILED: grpc.StatusCode.UNAVAILABLE,
    Status.INTERNAL: grpc.StatusCode.INTERNAL,
}
"""Each non-OK status's gRPC code: the retryable ones are UNAVAILABLE, which clients' retry
policies retry."""

_CONTENTS: Final = {
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "FP32": "fp32_contents",
    "FP64": "fp64_contents", "BOOL": "bool_contents", "BYTES": "bytes_contents",
}  # fmt: skip
_PROTO: Final = Path(__file__).with_name("open_inference.proto")
_SERVICE: Final = "inference.GRPCInferenceService"
_METHODS: Final = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                   "ModelInfer")  # fmt: skip
_loaded: dict[str, Any] | None = None


def messages() -> dict[str, Any]:
    """The protocol's message classes by name (``ModelInferRequest``, ...), compiled from
    ``open_inference.proto`` by grpcio-tools' protoc once, into a descriptor pool of dlad's own
    (a process may also hold Triton's client, whose messages have the same names)."""
    global _loaded  # noqa: PLW0603  # compiled once, on first use
    if _loaded is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # noqa: PLC0415
        from grpc_tools import protoc  # noqa: PLC0415

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "set.pb"
            if protoc.main(["protoc", f"-I{_PROTO.parent}", f"--descriptor_set_out={out}",
                            _PROTO.name]) != 0:  # fmt: skip
                raise RuntimeError(f"protoc could not compile {_PROTO}")
            files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
        pool = descriptor_pool.DescriptorPool()
        for f in files:
            pool.Add(f)
        classes = message_factory.GetMessages(list(files), pool=pool)
        _loaded = {name.rpartition(".")[2]: cls for name, cls in classes.items()
                   if name.count(".") == 1}  # fmt: skip
    return _loaded


def _parameters(params: Any) -> dict[str, object]:
    return {key: getattr(p, p.WhichOneof("parameter_choice") or "string_param")
            for key, p in params.items()}  # fmt: skip


def _set_parameter(target: Any, key: str, value: object) -> None:
    p = target[key]
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


class GrpcServer:
    """The gRPC server for ``gateway`` on ``host:port`` (``port`` 0: any free one, see
    :attr:`port`). ``tokens``: the allow-list (None: none needed); ``tls``: (certificate chain,
    private key) in PEM."""

    def __init__(
        self,
        gateway: Gateway,
        host: str,
        port: int,
        *,
        tokens: BearerTokens | None = None,
        tls: tuple[bytes, bytes] | None = None,
        max_message_bytes: int,
    ) -> None:
        self.gateway = gateway
        self.host = host
        self.port = port
        self.tokens = tokens
        self._tls = tls
        self._max = max_message_bytes
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind and serve (OSError: the address cannot be bound)."""
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self._max),
            ("grpc.max_send_message_length", self._max),
            ("grpc.so_reuseport", 0),
        ])  # fmt: skip
        server.add_generic_rpc_handlers((_handlers(self),))
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            if self._tls is None:
                port = server.add_insecure_port(address)
            else:
                credentials = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
                port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:  # grpcio: "Failed to bind to address ..."
            raise OSError(str(exc)) from None
        await server.start()
        self._server, self.port = server, port

    async def close(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ requests
    def client(self, context: grpc.aio.ServicerContext) -> str | None:
        """Who calls: its token's name (None: no valid token where one is needed), or its
        peer's host."""
        if self.tokens is None:
            peer = context.peer() or ""  # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"
            return "grpc:" + peer.partition(":")[2].rpartition(":")[0]
        metadata = context.invocation_metadata() or ()
        given = next((v for k, v in metadata if k == "authorization"), None)
        name = self.tokens.client(given if isinstance(given, str) else None)
        return None if name is None else f"grpc:{name}"

    def call(self, request: Any, owner: str, deadline_s: float | None) -> Call:
        raw = list(request.raw_input_contents)
        inputs = []
        for i, t in enumerate(request.inputs):
            params = _parameters(t.parameters)
            if raw:
                data = raw[i] if i < len(raw) else b""
                inputs.append(Tensor(t.name, t.datatype, tuple(t.shape), params, raw=data))
            else:
                field = _CONTENTS.get(t.datatype, "uint_contents")
                values = list(getattr(t.contents, field))
                inputs.append(Tensor(t.name, t.datatype, tuple(t.shape), params, values=values))
        outputs = [o.name for o in request.outputs] or None
        return Call(request.model_name, request.model_version, request.id,
                    _parameters(request.parameters), inputs, outputs, owner,
                    deadline_s)  # fmt: skip


def _handlers(server: GrpcServer) -> grpc.GenericRpcHandler:
    """The service's methods over ``server``'s gateway."""
    pb = messages()
    gateway = server.gateway

    async def abort(context: grpc.aio.ServicerContext, exc: DladError) -> None:
        context.set_trailing_metadata((("dlad-status", exc.status.name),))
        await context.abort(GRPC_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

    async def guarded(context: grpc.aio.ServicerContext) -> str:
        owner = server.client(context)
        if owner is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid `authorization: Bearer <token>` is required")  # fmt: skip
        return owner or ""

    async def server_live(request: Any, context: Any) -> Any:
        return pb["ServerLiveResponse"](live=True)

    async def server_ready(request: Any, context: Any) -> Any:
        return pb["ServerReadyResponse"](ready=gateway.ready())

    async def model_ready(request: Any, context: Any) -> Any:
        await guarded(context)
        try:
            ready = gateway.model_ready(request.name, request.version)
        except DladError as exc:
            await abort(context, exc)
        return pb["ModelReadyResponse"](ready=ready)

    async def server_metadata(request: Any, context: Any) -> Any:
        await guarded(context)
        return pb["ServerMetadataResponse"](**gateway.server_metadata())

    async def model_metadata(request: Any, context: Any) -> Any:
        await guarded(context)
        try:
            meta = gateway.model_metadata(request.name, request.version)
        except DladError as exc:
            await abort(context, exc)
        response = pb["ModelMetadataResponse"]
        return response(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[response.TensorMetadata(**t) for t in meta["inputs"]],
            outputs=[response.TensorMetadata(**t) for t in meta["outputs"]],
        )  # fmt: skip

    async def model_infer(request: Any, context: Any) -> Any:
        owner = await guarded(context)
        try:
            call = server.call(request, owner, context.time_remaining())
            answer = await gateway.infer(call)
        except DladError as exc:
            await abort(context, exc)
        except Exception as exc:  # a bug: answered, logged
            log.error("kserve_internal_error", method="ModelInfer",
                      error=f"{type(exc).__name__}: {exc}"[:200], exc_info=exc)  # fmt: skip
            await abort(context, InternalError(f"internal error ({type(exc).__name__}); "
                                               "see the daemon's log"))  # fmt: skip
        reply = pb["ModelInferResponse"](model_name=answer.model, model_version=MODEL_VERSION,
                                         id=answer.id)  # fmt: skip
        for key, value in answer.parameters.items():
            _set_parameter(reply.parameters, key, value)
        for o in answer.outputs:
            reply.outputs.add(name=o.name, datatype=o.datatype, shape=list(o.shape))
            reply.raw_output_contents.append(o.raw())
        return reply

    methods = (server_live, server_ready, model_ready, server_metadata, model_metadata,
               model_infer)  # fmt: skip
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=pb[f"{name}Request"].FromString,
            response_serializer=pb[f"{name}Response"].SerializeToString,
        )
        for name, method in zip(_METHODS, methods, strict=True)
    }
    return grpc.method_handlers_generic_handler(_SERVICE, handlers)
