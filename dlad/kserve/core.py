"""The Open Inference Protocol's meaning for dlad, apart from its transports.

An inference request names one model and carries one image, as one input tensor:

- ``IMAGE``, UINT8, a frame of the ZeroMQ protocol's shape for its pixel format (``H x W x 3``
  RGB by default; the tensor's or the request's ``format`` parameter names BGR, GRAY, NV12 or
  YUYV, and a YUV frame's ``colorspace`` and ``color_range``), with an optional leading batch
  dimension of 1; or
- ``IMAGE_BYTES``, BYTES of shape ``[1]``: an encoded JPEG or PNG file, decoded here.

Its request parameters are the INFER's settings (``conf``, ``iou``, ``max_det``,
``deadline_ms``, ``stream``, ``priority``) and Triton's ``timeout`` (µs, a deadline). The answer
has two outputs: ``DETECTIONS``, FP32 ``[N, 6]`` (x1, y1, x2, y2, score, class, in the image's
pixels, as the ZeroMQ reply's rows), and ``CLASSES``, BYTES ``[N]``, each row's class name; its
parameters say which device ran it and where the time went (the ZeroMQ reply's ``timing``).

A request is built into an :class:`~dlad.protocol.InferRequest`, encoded, and decoded by the
daemon's one request decoder (the ZeroMQ INFER's checks against the configured limits), then
run by :meth:`~dlad.frontend.Frontend.infer_local`. A refusal or failure raises the
:class:`~dlad.errors.DladError` of its status; :data:`HTTP_CODES` and the gRPC module map those.
"""

from __future__ import annotations

import base64
import io
import math
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from dlad import protocol
from dlad.errors import BadRequest, NotFound, Status, error_for

__all__ = [
    "CLASSES", "DETECTIONS", "EXTENSIONS", "HTTP_CODES", "IMAGE", "IMAGE_BYTES", "MODEL_VERSION",
    "Answer", "Call", "Gateway", "ModelInfo", "Output", "Tensor", "parse_bytes",
]  # fmt: skip

IMAGE: Final = "IMAGE"
IMAGE_BYTES: Final = "IMAGE_BYTES"
DETECTIONS: Final = "DETECTIONS"
CLASSES: Final = "CLASSES"
OUTPUTS: Final = (DETECTIONS, CLASSES)
MODEL_VERSION: Final = "1"
"""The one version of each model (a request may name it, or none)."""
EXTENSIONS: Final = ("binary_tensor_data", "parameters")
"""The protocol extensions served: Triton's binary tensor data over HTTP, and parameters."""

HTTP_CODES: Final = {
    Status.BAD_REQUEST: 400,
    Status.NOT_FOUND: 404,
    Status.OVERLOADED: 503,
    Status.DEADLINE_EXCEEDED: 504,
    Status.CANCELLED: 499,
    Status.SHUTTING_DOWN: 503,
    Status.DEVICE_FAILED: 503,
    Status.INTERNAL: 500,
}
"""Each non-OK status's HTTP code: a retryable one (OVERLOADED, SHUTTING_DOWN, DEVICE_FAILED)
is 503, as a server that cannot take the request now answers."""

_SETTINGS: Final = ("conf", "iou", "max_det", "deadline_ms", "stream", "priority", "timeout")
_IMAGE_PARAMETERS: Final = ("format", "colorspace", "color_range")
_IGNORED: Final = ("binary_data_output",)  # the HTTP transport's, read there
_ENCODED: Final = ("JPEG", "PNG")
_LENGTH: Final = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Tensor:
    """An input tensor as a transport received it: its elements are ``raw`` (little-endian
    bytes; BYTES elements each behind a 4-byte length) or ``values`` (a JSON array, nested or
    flat, or a gRPC ``contents`` field's list)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    parameters: Mapping[str, object] = field(default_factory=dict)
    raw: bytes | memoryview | None = None
    values: Sequence[Any] | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """One inference request. ``owner``: who sent it, for the per-client in-flight cap (the
    peer's host, or the name of its token); ``deadline_s``: the transport's own deadline
    (gRPC's), if any."""

    model: str
    version: str
    id: str
    parameters: Mapping[str, object]
    inputs: Sequence[Tensor]
    outputs: Sequence[str] | None
    owner: str
    deadline_s: float | None = None


@dataclass(frozen=True, slots=True)
class Output:
    """An output tensor: ``array`` (FP32) or ``strings`` (BYTES)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    array: npt.NDArray[np.float32] | None = None
    strings: list[bytes] | None = None

    def raw(self) -> bytes:
        """Its bytes as the binary extension and gRPC's raw contents carry them."""
        if self.array is not None:
            return self.array.astype("<f4", copy=False).tobytes()
        return b"".join(_LENGTH.pack(len(s)) + s for s in self.strings or ())

    def values(self) -> list[Any]:
        """Its elements for a JSON body (flat, row-major; BYTES as text)."""
        if self.array is not None:
            return [float(v) for v in self.array.ravel()]
        return [s.decode("utf-8", "replace") for s in self.strings or ()]


@dataclass(frozen=True, slots=True)
class Answer:
    model: str
    id: str
    outputs: list[Output]
    parameters: dict[str, object]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What metadata says of a served model."""

    name: str
    family: str
    class_names: tuple[str, ...]


class _Infer(Protocol):
    def __call__(self, owner: str, request: protocol.InferRequest) -> Awaitable[Any]: ...


def parse_bytes(raw: bytes | memoryview, count: int, name: str) -> list[bytes]:
    """``count`` BYTES elements, each behind a 4-byte little-endian length, filling ``raw``
    exactly. Raises BadRequest naming the tensor."""
    view = memoryview(raw).cast("B")
    out: list[bytes] = []
    at = 0
    for _ in range(count):
        if at + 4 > len(view):
            raise BadRequest(f"{name}: its data ends inside element {len(out)}'s length")
        (n,) = _LENGTH.unpack_from(view, at)
        if at + 4 + n > len(view):
            raise BadRequest(f"{name}: element {len(out)} says {n} bytes; fewer follow")
        out.append(bytes(view[at + 4 : at + 4 + n]))
        at += 4 + n
    if at != len(view):
        raise BadRequest(f"{name}: {len(view) - at} bytes follow its {count} element(s)")
    return out


def _count(shape: tuple[int, ...], name: str) -> int:
    if any(n < 0 for n in shape):
        raise BadRequest(f"{name}: shape must be non-negative integers, got {list(shape)}")
    return math.prod(shape)


def _text(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"parameter {key!r} must be a string, got {value!r}")
    return value


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"parameter {key!r} must be a number, got {value!r}")
    return float(value)


def _integer(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"parameter {key!r} must be an integer, got {value!r}")
    return value


class Gateway:
    """The protocol's requests for this daemon (see the module docstring).

    Args:
        name: the server's name (``[daemon] name``).
        version: dlad's version.
        models: the served models, by name.
        limits: the frontend's limits (the decoder checks every image against them).
        infer: runs a decoded INFER (``Frontend.infer_local``).
        ready: whether the daemon serves (``/v2/health/ready``).
        model_ready: whether a device serves the model now.
        decode_threads: how many encoded images are decoded at once (off the event loop).
    """

    def __init__(
        self,
        *,
        name: str,
        version: str,
        models: Mapping[str, ModelInfo],
        limits: protocol.Limits,
        infer: _Infer,
        ready: Callable[[], bool],
        model_ready: Callable[[str], bool],
        decode_threads: int = 2,
    ) -> None:
        self.name = name
        self.version = version
        self.models = dict(models)
        self.limits = limits
        self._infer = infer
        self.ready = ready
        self._model_ready = model_ready
        self._decoding = anyio.CapacityLimiter(decode_threads)

    # ------------------------------------------------------------------ metadata
    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "extensions": list(EXTENSIONS)}

    def model(self, name: str, version: str = "") -> ModelInfo:
        """The model ``name`` (at ``version``: "" or :data:`MODEL_VERSION`); raises NotFound."""
        info = self.models.get(name)
        if info is None:
            known = ", ".join(self.models) or "none"
            raise NotFound(f"no model {name!r} (models: {known})")
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"model {name!r} has version {MODEL_VERSION} only, not {version!r}")
        return info

    def model_ready(self, name: str, version: str = "") -> bool:
        self.model(name, version)
        return self.ready() and self._model_ready(name)

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        info = self.model(name, version)
        return {
            "name": info.name,
            "versions": [MODEL_VERSION],
            "platform": f"dlad_{info.family}",
            "inputs": [
                {"name": IMAGE, "datatype": "UINT8", "shape": [-1, -1, 3]},
                {"name": IMAGE_BYTES, "datatype": "BYTES", "shape": [1]},
            ],
            "outputs": [
                {"name": DETECTIONS, "datatype": "FP32", "shape": [-1, 6]},
                {"name": CLASSES, "datatype": "BYTES", "shape": [-1]},
            ],
        }

    # ------------------------------------------------------------------ inference
    async def infer(self, call: Call) -> Answer:
        """Run ``call``; raises the DladError of a refusal or failure."""
        info = self.model(call.model, call.version)
        wanted = self._outputs(call.outputs)
        settings = self._settings(call)
        if len(call.inputs) != 1:
            raise BadRequest(f"a request has one input, {IMAGE} or {IMAGE_BYTES}; "
                             f"got {len(call.inputs)}")  # fmt: skip
        tensor = call.inputs[0]
        image, image_settings = await self._image(tensor, call.parameters)
        # raises ProtocolError (a BadRequest) naming the field
        request = protocol.InferRequest(0, call.model, image, **image_settings, **settings)
        # The daemon's own decoder: the ZeroMQ INFER's checks against the configured limits.
        decoded = protocol.decode_request(protocol.encode(request), self.limits)
        assert isinstance(decoded, protocol.InferRequest)
        status, message, device, timing, found = await self._infer(call.owner, decoded)
        if status != Status.OK:
            raise error_for(status, message)
        outputs = []
        if DETECTIONS in wanted:
            outputs.append(Output(DETECTIONS, "FP32", (len(found), 6),
                                  array=np.ascontiguousarray(found, np.float32)))  # fmt: skip
        if CLASSES in wanted:
            names = info.class_names
            strings = [
                (names[c] if 0 <= c < len(names) else str(c)).encode()
                for c in found[:, 5].astype(np.int64).tolist()
            ]
            outputs.append(Output(CLASSES, "BYTES", (len(strings),), strings=strings))
        parameters: dict[str, object] = {"device": device or ""}
        parameters.update({f"{k}": int(v) for k, v in timing.items() if k.endswith("_us")})
        return Answer(call.model, call.id, outputs, parameters)

    @staticmethod
    def _outputs(names: Sequence[str] | None) -> tuple[str, ...]:
        if not names:
            return OUTPUTS
        for name in names:
            if name not in OUTPUTS:
                raise BadRequest(f"no output {name!r} (outputs: {', '.join(OUTPUTS)})")
        return tuple(n for n in OUTPUTS if n in names)

    @staticmethod
    def _settings(call: Call) -> dict[str, Any]:
        """The INFER's settings from the request's parameters (and its transport's deadline)."""
        p = call.parameters
        for key in p:
            if key not in (*_SETTINGS, *_IMAGE_PARAMETERS, *_IGNORED):
                known = ", ".join((*_SETTINGS, *_IMAGE_PARAMETERS))
                raise BadRequest(f"unknown parameter {key!r} (parameters: {known})")
        out: dict[str, Any] = {}
        for key in ("conf", "iou"):
            if key in p:
                out[key] = _number(p[key], key)
        for key in ("max_det", "priority"):
            if key in p:
                out[key] = _integer(p[key], key)
        if "stream" in p:
            out["stream"] = _text(p["stream"], "stream")
        deadlines: list[float] = []
        if "deadline_ms" in p:
            deadlines.append(_number(p["deadline_ms"], "deadline_ms"))
        if "timeout" in p:  # Triton's, in µs
            deadlines.append(_integer(p["timeout"], "timeout") / 1e3)
        if call.deadline_s is not None:
            deadlines.append(max(call.deadline_s * 1e3, 1.0))
        if deadlines:
            out["deadline_ms"] = max(1, math.ceil(min(deadlines)))
        return out

    async def _image(
        self, tensor: Tensor, parameters: Mapping[str, object]
    ) -> tuple[npt.NDArray[np.uint8], dict[str, Any]]:
        """The image ``tensor`` carries, and its pixel format's settings."""
        count = _count(tensor.shape, tensor.name)
        if tensor.name == IMAGE_BYTES:
            if tensor.datatype != "BYTES" or count != 1:
                raise BadRequest(f"{IMAGE_BYTES} is BYTES of shape [1] (one encoded image), "
                                 f"got {tensor.datatype} {list(tensor.shape)}")  # fmt: skip
            if tensor.raw is not None:
                (data,) = parse_bytes(tensor.raw, 1, IMAGE_BYTES)
            else:
                data = self._encoded_value(tensor.values)
            async with self._decoding:
                rgb = await anyio.to_thread.run_sync(self._decode, data)
            return rgb, {"format": "RGB"}
        if tensor.name != IMAGE:
            raise BadRequest(f"no input {tensor.name!r} (inputs: {IMAGE}, {IMAGE_BYTES})")
        if tensor.datatype != "UINT8":
            raise BadRequest(f"{IMAGE} is UINT8, got {tensor.datatype}")
        settings: dict[str, Any] = {}
        for key in _IMAGE_PARAMETERS:
            value = tensor.parameters.get(key, parameters.get(key))
            if value is not None:
                settings[key] = _text(value, key)
        if count > self.limits.max_message_bytes:
            raise BadRequest(f"{IMAGE} has {count} bytes, more than the "
                             f"{self.limits.max_message_bytes} a request may carry")  # fmt: skip
        if tensor.raw is not None:
            if len(tensor.raw) != count:
                raise BadRequest(f"{IMAGE}: shape {list(tensor.shape)} is {count} bytes, "
                                 f"got {len(tensor.raw)}")  # fmt: skip
            pixels = np.frombuffer(tensor.raw, np.uint8)
        else:
            pixels = self._pixel_values(tensor.values, count)
        shape = tensor.shape[1:] if len(tensor.shape) > 2 and tensor.shape[0] == 1 else tensor.shape
        if len(shape) == 4:
            raise BadRequest(f"{IMAGE}: one image a request (a leading batch dimension of 1), "
                             f"got shape {list(tensor.shape)}")  # fmt: skip
        return pixels.reshape(shape), settings

    @staticmethod
    def _pixel_values(values: Sequence[Any] | None, count: int) -> npt.NDArray[np.uint8]:
        if values is None:
            raise BadRequest(f"{IMAGE} carries no data")
        try:
            flat = np.asarray(values, dtype=np.int64).ravel()
        except (ValueError, TypeError, OverflowError):
            raise BadRequest(f"{IMAGE}: its data must be integers 0-255") from None
        if flat.size != count:
            raise BadRequest(f"{IMAGE}: its shape holds {count} elements, its data {flat.size}")
        if flat.size and (flat.min() < 0 or flat.max() > 255):
            raise BadRequest(f"{IMAGE}: its data must be integers 0-255")
        return flat.astype(np.uint8)

    @staticmethod
    def _encoded_value(values: Sequence[Any] | None) -> bytes:
        """An IMAGE_BYTES element from a JSON body (base64 text) or gRPC's bytes_contents."""
        flat = list(values or ())
        while len(flat) == 1 and isinstance(flat[0], list):
            flat = flat[0]
        if len(flat) != 1:
            raise BadRequest(f"{IMAGE_BYTES} carries one element, got {len(flat)}")
        value = flat[0]
        if isinstance(value, bytes):
            return value
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except ValueError:
                raise BadRequest(f"{IMAGE_BYTES} in a JSON body is base64 text") from None
        raise BadRequest(f"{IMAGE_BYTES}'s element must be bytes, got {type(value).__name__}")

    def _decode(self, data: bytes) -> npt.NDArray[np.uint8]:
        """A JPEG or PNG file's pixels, RGB; its size is checked before it is decoded."""
        from PIL import Image, UnidentifiedImageError  # noqa: PLC0415  # only where used

        try:
            with Image.open(io.BytesIO(data), formats=_ENCODED) as im:
                width, height = im.size
                lim = self.limits
                if width > lim.max_width or height > lim.max_height:
                    raise BadRequest(f"{IMAGE_BYTES}: a {width} x {height} image is larger than "
                                     f"{lim.max_width} x {lim.max_height}")  # fmt: skip
                rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
        except UnidentifiedImageError:
            raise BadRequest(f"{IMAGE_BYTES}: not a JPEG or PNG image") from None
        except (OSError, SyntaxError, ValueError) as exc:  # truncated or corrupt
            raise BadRequest(f"{IMAGE_BYTES}: cannot decode it ({exc})"[:200]) from None
        return np.ascontiguousarray(rgb)
