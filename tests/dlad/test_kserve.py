"""The Open Inference Protocol (KServe v2) ports, tried with NVIDIA's own clients.

A daemon serving the bundled demo model on a numeric DLA core (the real INT8 engine) answers
``tritonclient.http`` and ``tritonclient.grpc``; each image's detections must equal the ZeroMQ
SDK's for the same pixels, errors must be the status's code with its message, and the ports
must keep the daemon's limits and tokens.
"""

from __future__ import annotations

import base64
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import tomllib

from dlad import protocol
from dlad.config import ConfigError, load_config, parse_config
from dlad.daemon import Daemon
from dlad.errors import StartupError, Status
from dlad.models import DEMO

from .serving import NUMERIC_DEMO, serve_in_thread

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient (the dev extra)")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient (the dev extra)")
httpx = pytest.importorskip("httpx", reason="httpx (the dev extra)")
from PIL import Image  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from dlad_client import Client  # noqa: E402

IMAGES = sorted((DEMO / "images").glob("*.jpg"))
TOKEN = "s3cret-token-of-the-camera-rig"


class Served:
    def __init__(self, daemon: Daemon, endpoint: str) -> None:
        assert daemon.kserve is not None
        assert daemon.kserve.http
        assert daemon.kserve.grpc
        self.daemon = daemon
        self.endpoint = endpoint
        self.http = f"127.0.0.1:{daemon.kserve.http.port}"
        self.grpc = f"127.0.0.1:{daemon.kserve.grpc.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cfg = tmp_path_factory.mktemp("kserve") / "dlad.toml"
    deep = NUMERIC_DEMO.replace('kind = "dla"', 'kind = "dla"\nqueue_depth = 64')
    cfg.write_text(deep + "\n[kserve]\nenabled = true\n")
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"],
                    kserve_ports={"http": 0, "grpc": 0})  # fmt: skip
    with serve_in_thread(daemon) as endpoint:
        yield Served(daemon, endpoint)


def rgb(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def http_input(image: np.ndarray, name: str = "IMAGE", binary: bool = True) -> object:
    tensor = httpclient.InferInput(name, list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image, binary_data=binary)
    return tensor


def grpc_input(image: np.ndarray) -> object:
    tensor = grpcclient.InferInput("IMAGE", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image)
    return tensor


def encoded_input(client: object, path: Path) -> object:
    tensor = client.InferInput("IMAGE_BYTES", [1], "BYTES")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(np.array([path.read_bytes()], dtype=object))
    return tensor


def zmq_detections(endpoint: str, image: np.ndarray, **settings: object) -> np.ndarray:
    with Client(endpoint) as client:
        return client.detect(image, **settings).detections  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- metadata, health
def test_health_and_metadata_over_http(served: Served) -> None:
    client = httpclient.InferenceServerClient(served.http)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("demo")
    assert client.is_model_ready("demo", "1")
    meta = client.get_server_metadata()
    assert meta["name"] == "dlad"
    assert "binary_tensor_data" in meta["extensions"]
    model = client.get_model_metadata("demo")
    assert model["versions"] == ["1"]
    assert model["platform"] == "dlad_yolov5"
    assert [(t["name"], t["datatype"]) for t in model["inputs"]] == [
        ("IMAGE", "UINT8"), ("IMAGE_BYTES", "BYTES")]  # fmt: skip
    assert [(t["name"], t["shape"]) for t in model["outputs"]] == [
        ("DETECTIONS", [-1, 6]), ("CLASSES", [-1])]  # fmt: skip
    with pytest.raises(InferenceServerException, match="no model 'nope'"):
        client.get_model_metadata("nope")
    assert not client.is_model_ready("demo", "2")
    reply = httpx.get(f"http://{served.http}/v2/models/demo/versions/2/ready")
    assert reply.status_code == 404
    assert "version 1 only" in reply.json()["error"]


def test_health_and_metadata_over_grpc(served: Served) -> None:
    client = grpcclient.InferenceServerClient(served.grpc)
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("demo")
    assert client.get_server_metadata().name == "dlad"
    model = client.get_model_metadata("demo", as_json=True)
    assert model["platform"] == "dlad_yolov5"
    assert [t["name"] for t in model["outputs"]] == ["DETECTIONS", "CLASSES"]
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


# ---------------------------------------------------------------------------- inference
@pytest.mark.parametrize("path", IMAGES, ids=lambda p: p.name)
def test_http_detections_equal_the_sdks(served: Served, path: Path) -> None:
    image = rgb(path)
    want = zmq_detections(served.endpoint, image, conf=0.05)
    client = httpclient.InferenceServerClient(served.http)
    result = client.infer("demo", [http_input(image)], parameters={"conf": 0.05})
    np.testing.assert_array_equal(result.as_numpy("DETECTIONS"), want)
    with Client(served.endpoint) as sdk:
        names = sdk.class_names("demo")
    assert [n.decode() for n in result.as_numpy("CLASSES")] == [names[int(c)] for c in want[:, 5]]
    response = result.get_response()
    assert response["parameters"]["device"] == "dla0"
    assert response["parameters"]["total_us"] >= response["parameters"]["device_us"] > 0


@pytest.mark.parametrize("path", IMAGES[:3], ids=lambda p: p.name)
def test_grpc_detections_equal_the_sdks(served: Served, path: Path) -> None:
    image = rgb(path)
    want = zmq_detections(served.endpoint, image, conf=0.05, max_det=5)
    client = grpcclient.InferenceServerClient(served.grpc)
    result = client.infer("demo", [grpc_input(image)], parameters={"conf": 0.05, "max_det": 5})
    np.testing.assert_array_equal(result.as_numpy("DETECTIONS"), want)
    assert result.get_response().parameters["device"].string_param == "dla0"


def test_encoded_images_are_decoded_to_the_same_pixels(served: Served) -> None:
    path = IMAGES[2]
    want = zmq_detections(served.endpoint, rgb(path), conf=0.05)
    for module, address in ((grpcclient, served.grpc), (httpclient, served.http)):
        client = module.InferenceServerClient(address)
        result = client.infer("demo", [encoded_input(module, path)], parameters={"conf": 0.05})
        np.testing.assert_array_equal(result.as_numpy("DETECTIONS"), want)


def test_a_json_body_without_the_binary_extension(served: Served) -> None:
    """What curl sends: the image as JSON numbers, or a JPEG as base64; JSON outputs back."""
    image = rgb(IMAGES[1])[:64, :96].copy()
    want = zmq_detections(served.endpoint, image, conf=0.05)
    body = {"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": list(image.shape),
                        "data": image.ravel().tolist()}],
            "parameters": {"conf": 0.05}, "id": "req-7"}  # fmt: skip
    reply = httpx.post(f"http://{served.http}/v2/models/demo/infer", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    assert doc["id"] == "req-7"
    assert doc["model_name"] == "demo"
    out = {o["name"]: o for o in doc["outputs"]}
    found = np.asarray(out["DETECTIONS"]["data"], np.float32).reshape(out["DETECTIONS"]["shape"])
    np.testing.assert_array_equal(found, want)

    path = IMAGES[1]
    encoded = base64.b64encode(path.read_bytes()).decode()
    body = {"inputs": [{"name": "IMAGE_BYTES", "datatype": "BYTES", "shape": [1],
                        "data": [encoded]}], "outputs": [{"name": "DETECTIONS"}],
            "parameters": {"conf": 0.05}}  # fmt: skip
    reply = httpx.post(f"http://{served.http}/v2/models/demo/infer", json=body, timeout=60)
    doc = reply.json()
    assert [o["name"] for o in doc["outputs"]] == ["DETECTIONS"]
    found = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(-1, 6)
    np.testing.assert_array_equal(found, zmq_detections(served.endpoint, rgb(path), conf=0.05))


def test_other_pixel_formats_and_a_batch_dimension_of_one(served: Served) -> None:
    image = rgb(IMAGES[2])
    bgr = np.ascontiguousarray(image[..., ::-1])
    want = zmq_detections(served.endpoint, image, conf=0.05)
    client = httpclient.InferenceServerClient(served.http)
    result = client.infer(
        "demo", [http_input(bgr[None])], parameters={"conf": 0.05, "format": "BGR"}
    )
    np.testing.assert_array_equal(result.as_numpy("DETECTIONS"), want)
    # a tensor's own parameter, as a JSON body gives it
    body = {
        "inputs": [
            {
                "name": "IMAGE",
                "datatype": "UINT8",
                "shape": list(bgr.shape),
                "parameters": {"format": "BGR", "binary_data_size": bgr.nbytes},
            }
        ],
        "parameters": {"conf": 0.05},
        "outputs": [{"name": "DETECTIONS", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(body).encode()
    reply = httpx.post(
        f"http://{served.http}/v2/models/demo/infer",
        content=head + bgr.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=60,
    )
    n = int(reply.headers["Inference-Header-Content-Length"])
    found = np.frombuffer(reply.content[n:], "<f4").reshape(-1, 6)
    np.testing.assert_array_equal(found, want)


def test_many_requests_at_once_over_both(served: Served) -> None:
    images = [rgb(p) for p in IMAGES]
    want = [zmq_detections(served.endpoint, im, conf=0.05) for im in images]
    http = httpclient.InferenceServerClient(served.http, concurrency=8)
    grpc = grpcclient.InferenceServerClient(served.grpc)
    pending = [http.async_infer("demo", [http_input(im)], parameters={"conf": 0.05})
               for im in images * 4]  # fmt: skip

    def by_grpc(i: int) -> np.ndarray:
        r = grpc.infer("demo", [grpc_input(images[i])], parameters={"conf": 0.05})
        return r.as_numpy("DETECTIONS")

    with ThreadPoolExecutor(8) as pool:
        over_grpc = list(pool.map(by_grpc, [i % len(images) for i in range(24)]))
    for i, p in enumerate(pending):
        np.testing.assert_array_equal(p.get_result().as_numpy("DETECTIONS"), want[i % len(images)])
    for i, found in enumerate(over_grpc):
        np.testing.assert_array_equal(found, want[i % len(images)])


# ---------------------------------------------------------------------------- errors
def http_error(served: Served, body: object, model: str = "demo", **kw: object) -> tuple[int, str]:
    reply = httpx.post(
        f"http://{served.http}/v2/models/{model}/infer",
        timeout=60,
        **({"json": body} if body is not None else kw),
    )
    assert reply.status_code != 200
    return reply.status_code, reply.json()["error"]


def image_body(shape: list[int], datatype: str = "UINT8", **extra: object) -> dict[str, object]:
    n = int(np.prod(shape))
    return {"inputs": [{"name": "IMAGE", "datatype": datatype, "shape": shape,
                        "data": [0] * n}], **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (image_body([4, 4, 3], parameters={"conf": 2.0}), 400, "conf"),
        (image_body([4, 4, 3], parameters={"sequence_id": 3}), 400, "unknown parameter"),
        (image_body([4, 4, 3], parameters={"max_det": "ten"}), 400, "max_det"),
        (image_body([4, 4, 4]), 400, "RGB frame has shape"),
        (image_body([4, 4, 3], "FP32"), 400, "IMAGE is UINT8"),
        (image_body([4, 4, 3], outputs=[{"name": "SCORES"}]), 400, "no output 'SCORES'"),
        (image_body([5000, 4, 3]), 400, "height"),
        ({"inputs": []}, 400, "one input"),
        (
            {"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1], "data": [0]}]},
            400,
            "no input 'PIXELS'",
        ),
        (
            {
                "inputs": [
                    {
                        "name": "IMAGE_BYTES",
                        "datatype": "BYTES",
                        "shape": [1],
                        "data": [base64.b64encode(b"not an image").decode()],
                    }
                ]
            },
            400,
            "not a JPEG or PNG",
        ),
        (
            {
                "inputs": [
                    {"name": "IMAGE", "datatype": "UINT8", "shape": [2, 2, 3], "data": [300] * 12}
                ]
            },
            400,
            "0-255",
        ),
        ({"inputs": "IMAGE"}, 400, "inputs is a list"),
    ],
)
def test_bad_requests_are_400_with_their_reason(
    served: Served, body: dict[str, object], code: int, words: str
) -> None:
    got, message = http_error(served, body)
    assert got == code, message
    assert words in message


def test_unknown_model_is_404_and_broken_bodies_are_400(served: Served) -> None:
    assert http_error(served, image_body([4, 4, 3]), model="nope")[0] == 404
    status, message = http_error(served, None, content=b"{not json")
    assert status == 400
    assert "not JSON" in message
    status, message = http_error(served, None, content=b'{"inputs": []}xx',
                                 headers={"Inference-Header-Content-Length": "99"})  # fmt: skip
    assert status == 400
    assert "Inference-Header-Content-Length" in message
    client = grpcclient.InferenceServerClient(served.grpc)
    with pytest.raises(InferenceServerException) as info:
        client.infer("demo", [grpc_input(np.zeros((4, 4, 4), np.uint8))])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "RGB frame has shape" in info.value.message()
    # the daemon serves on
    image = rgb(IMAGES[1])
    assert client.infer("demo", [grpc_input(image)]).as_numpy("DETECTIONS") is not None


def test_a_body_over_the_message_limit_is_413(tmp_path: Path) -> None:
    cfg = tmp_path / "dlad.toml"
    limits = "[frontend]\nmax_message_bytes = 70000\nmax_image_width = 128\nmax_image_height = 128"
    cfg.write_text(NUMERIC_DEMO.replace("[frontend]", limits)
                   + "\n[kserve]\nenabled = true\n")  # fmt: skip
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"],
                    kserve_ports={"http": 0, "grpc": 0})  # fmt: skip
    with serve_in_thread(daemon):
        assert daemon.kserve is not None
        assert daemon.kserve.http
        assert daemon.kserve.grpc
        big = np.zeros((160, 160, 3), np.uint8)  # 76,800 bytes
        client = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.kserve.http.port}")
        with pytest.raises(InferenceServerException) as info:
            client.infer("demo", [http_input(big)])
        assert info.value.status() == "413"
        g = grpcclient.InferenceServerClient(f"127.0.0.1:{daemon.kserve.grpc.port}")
        with pytest.raises(InferenceServerException) as info:
            g.infer("demo", [grpc_input(big)])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        small = rgb(IMAGES[1])[:100, :100].copy()
        assert client.infer("demo", [http_input(small)]).as_numpy("DETECTIONS") is not None


# ---------------------------------------------------------------------------- tokens, config
def test_tokens_guard_both_ports_but_not_health(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"# the rig\nrig {TOKEN}\n")
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(NUMERIC_DEMO + '\n[kserve]\nenabled = true\ntokens_file = "tokens"\n')
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"],
                    kserve_ports={"http": 0, "grpc": 0})  # fmt: skip
    image = rgb(IMAGES[1])
    with serve_in_thread(daemon):
        assert daemon.kserve is not None
        assert daemon.kserve.http
        assert daemon.kserve.grpc
        http = httpclient.InferenceServerClient(f"127.0.0.1:{daemon.kserve.http.port}")
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{daemon.kserve.grpc.port}")
        assert http.is_server_ready()
        assert grpc.is_server_live()
        with pytest.raises(InferenceServerException) as info:
            http.infer("demo", [http_input(image)])
        assert info.value.status() == "401"
        with pytest.raises(InferenceServerException) as info:
            grpc.infer("demo", [grpc_input(image)], headers={"authorization": "Bearer wrong"})
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert http.infer("demo", [http_input(image)], headers=bearer).as_numpy("DETECTIONS") \
            is not None  # fmt: skip
        lower = {"authorization": f"Bearer {TOKEN}"}
        assert grpc.infer("demo", [grpc_input(image)], headers=lower).as_numpy("DETECTIONS") \
            is not None  # fmt: skip


def test_a_port_beyond_loopback_needs_tokens() -> None:
    parse: Callable[[str], Any] = _parse
    base = NUMERIC_DEMO + '\n[kserve]\nenabled = true\nhttp = "0.0.0.0:8000"\n'
    with pytest.raises(ConfigError, match=r"kserve\.http.*tokens_file"):
        parse(base)
    assert parse(base + 'tokens_file = "tokens"\n').kserve.tokens_file == "tokens"
    with pytest.raises(ConfigError, match=r"kserve\.grpc.*host:port"):
        parse(NUMERIC_DEMO + '\n[kserve]\ngrpc = "8001"\n')
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file"):
        parse(NUMERIC_DEMO + '\n[kserve]\ntls_cert_file = "c.pem"\n')


def _parse(text: str) -> Any:
    return parse_config(tomllib.loads(text))


def test_a_taken_port_is_one_startup_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "dlad.toml"
        cfg.write_text(NUMERIC_DEMO + f'\n[kserve]\nenabled = true\nhttp = "127.0.0.1:{port}"\n')
        daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"],
                        kserve_ports={"grpc": 0})  # fmt: skip
        with pytest.raises(StartupError, match=f"cannot serve KServe http on 127.0.0.1:{port}"):
            anyio.run(daemon.serve)


def test_metadata_over_http_is_json(served: Served) -> None:
    reply = httpx.get(f"http://{served.http}/v2/models/demo/versions/1")
    assert reply.status_code == 200
    assert json.loads(reply.text)["name"] == "demo"
    assert httpx.get(f"http://{served.http}/v2/models/demo/versions/1/ready").status_code == 200
    assert httpx.get(f"http://{served.http}/v2/nowhere").status_code == 404


# ---------------------------------------------------------------------------- statuses
@pytest.mark.parametrize(
    ("status", "http_code", "grpc_code"),
    [
        (Status.OVERLOADED, 503, "StatusCode.UNAVAILABLE"),
        (Status.SHUTTING_DOWN, 503, "StatusCode.UNAVAILABLE"),
        (Status.DEVICE_FAILED, 503, "StatusCode.UNAVAILABLE"),
        (Status.DEADLINE_EXCEEDED, 504, "StatusCode.DEADLINE_EXCEEDED"),
        (Status.CANCELLED, 499, "StatusCode.CANCELLED"),
        (Status.INTERNAL, 500, "StatusCode.INTERNAL"),
    ],
)
def test_each_status_has_its_code_on_both_ports(
    status: Status, http_code: int, grpc_code: str
) -> None:
    """The plane's answers as each transport gives them (a plane that answers ``status``
    stands in: the real one's refusals are tested above and in the plane's tests)."""
    from dlad.kserve.core import Gateway, ModelInfo
    from dlad.kserve.grpc import GrpcServer
    from dlad.kserve.http import HttpServer

    async def answer(owner: str, request: object) -> tuple[object, ...]:
        return int(status), f"the plane says {status.name}", None, {}, np.zeros((0, 6), "f4")

    gateway = Gateway(name="dlad", version="0", models={"demo": ModelInfo("demo", "yolov5", ())},
                      limits=protocol.Limits(), infer=answer, ready=lambda: True,
                      model_ready=lambda name: True)  # fmt: skip
    image = np.zeros((8, 8, 3), np.uint8)

    async def main() -> None:
        http = HttpServer(gateway, "127.0.0.1", 0, max_body_bytes=1 << 20)
        grpc = GrpcServer(gateway, "127.0.0.1", 0, max_message_bytes=1 << 20)
        await http.start()
        await grpc.start()
        try:
            body = {"inputs": [{"name": "IMAGE", "datatype": "UINT8", "shape": [8, 8, 3],
                                "data": [0] * 192}]}  # fmt: skip
            async with httpx.AsyncClient() as client:
                reply = await client.post(f"http://127.0.0.1:{http.port}/v2/models/demo/infer",
                                          json=body)  # fmt: skip
            assert reply.status_code == http_code
            assert reply.headers["dlad-status"] == status.name
            assert reply.json()["error"] == f"the plane says {status.name}"

            def by_grpc() -> str:
                client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc.port}")
                with pytest.raises(InferenceServerException) as info:
                    client.infer("demo", [grpc_input(image)])
                return str(info.value.status())

            assert await anyio.to_thread.run_sync(by_grpc) == grpc_code
        finally:
            await grpc.close()
            await http.close()

    anyio.run(main)


# ---------------------------------------------------------------------------- TLS
def test_tls_on_both_ports(tmp_path: Path) -> None:
    """HTTPS and gRPC over TLS with [kserve] tls_cert_file and tls_key_file: a client that
    trusts the certificate infers, a plaintext one gets nowhere."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem"),
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    cfg = tmp_path / "dlad.toml"
    cfg.write_text(NUMERIC_DEMO + '\n[kserve]\nenabled = true\ntls_cert_file = "cert.pem"\n'
                   'tls_key_file = "key.pem"\n')  # fmt: skip
    daemon = Daemon(load_config(cfg).plan(), endpoints=["tcp://127.0.0.1:0"],
                    kserve_ports={"http": 0, "grpc": 0})  # fmt: skip
    cert = tmp_path / "cert.pem"
    image = rgb(IMAGES[1])
    with serve_in_thread(daemon):
        assert daemon.kserve is not None
        assert daemon.kserve.http is not None
        assert daemon.kserve.grpc is not None
        http_port, grpc_port = daemon.kserve.http.port, daemon.kserve.grpc.port
        trusted = ssl.create_default_context(cafile=str(cert))
        reply = httpx.get(f"https://127.0.0.1:{http_port}/v2/health/ready", verify=trusted)
        assert reply.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=10)
        with pytest.raises(httpx.HTTPError):  # a certificate it does not trust
            httpx.get(f"https://127.0.0.1:{http_port}/v2/health/ready", timeout=10)
        client = grpcclient.InferenceServerClient(f"localhost:{grpc_port}", ssl=True,
                                                  root_certificates=str(cert))  # fmt: skip
        found = client.infer("demo", [grpc_input(image)]).as_numpy("DETECTIONS")
        np.testing.assert_array_equal(found, zmq_detections(daemon.bound[0], image))
        plain = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException):
            plain.is_server_live()
