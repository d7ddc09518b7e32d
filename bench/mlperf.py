"""MLPerf Inference's LoadGen against dlad: a system under test over the SDK.

    python bench/mlperf.py [--scenario SingleStream MultiStream Server Offline] [--accuracy]
        [--endpoint tcp://HOST:PORT | --engines numeric|timing] [--samples 300]
        [--duration-s 10] [--server-qps 100] [--server-latency-ms 50] [--out DIR]

LoadGen (``mlcommons-loadgen``, the load generator every MLPerf Inference submission runs)
drives the scenarios and writes its own logs and summary, with its validity verdict, under
``--out``/<scenario>-<mode>/. The system under test is a daemon reached through the SDK's
AsyncClient: each query sample is one INFER (MultiStream's 8 samples a query, and Offline's
samples, go as INFER_BATCH messages of up to 8 frames), and each sample's response is its
detections (N x 6 float32), which LoadGen's accuracy log records.

The samples are prep's held-out images: the demo model's validation set (300 images of the
synthetic-shapes dataset, the seed and generator settings of ``dlad/models/demo/images.json``),
regenerated here; COCO is not on the project's machines. ``--accuracy`` runs LoadGen's
AccuracyOnly mode over every sample and scores the logged detections with COCO mAP
(faster-coco-eval, as ``prep validate`` does) at the validation thresholds (conf 0.001, IoU
0.65). The daemon serves one class a box (YOLOv5's ``detect.py``); ``prep validate`` scores
multi-label candidates (YOLOv5's ``val.py``), so its figure for the same engine is the higher
(docs/BENCHMARKS.md §14).

Without ``--endpoint`` the bench starts a daemon: ``--engines numeric`` is the emulated Orin of
``etc/dlad.toml`` (two DLA cores computing the real INT8 outputs, and the emulated GPU);
``timing`` is two DLA cores in timing mode at 3.82 ms a frame (YOLOv5s-672 on an Orin,
published), which return no detections (performance only); ``gpu`` (a CUDA host, the device
machine: ``bench/h200_mlperf.sh``) is the two numeric DLA cores beside the real GPU running the
model (``engine = "torch"``).

Run lengths are shortened for a development machine (``--duration-s``, and at least 64
queries): an official run keeps LoadGen's defaults (600 s, and 1024 / 662 / 270,336 queries),
so a VALID verdict here is LoadGen's judgement of these settings, which the summary lists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "clients"), str(ROOT / "bench")]

import mlperf_loadgen as lg  # noqa: E402
from orin_config import demo_model, emulated_dlas, running_daemon  # noqa: E402

from dlad_client import AsyncClient, DladError  # noqa: E402

SCENARIOS = {
    "SingleStream": lg.TestScenario.SingleStream,
    "MultiStream": lg.TestScenario.MultiStream,
    "Server": lg.TestScenario.Server,
    "Offline": lg.TestScenario.Offline,
}
CONF, IOU, MAX_DET = 0.001, 0.65, 300  # prep validate's thresholds (presets/demo.toml)
BATCH = 8  # frames an INFER_BATCH carries here (MultiStream's samples a query)
NUMERIC = """[frontend]
endpoints = ["{endpoint}"]
[metrics]
enabled = false
[devices.dla0]
kind = "dla"
core = 0
queue_depth = 16
[devices.dla1]
kind = "dla"
core = 1
queue_depth = 16
[devices.gpu]
kind = "gpu"
queue_depth = 32
max_batch = 8
""" + demo_model(["dla0", "dla1", "gpu"])


def held_out(count: int, workdir: Path) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The demo model's held-out images (decoded RGB) and their COCO ground truth."""
    from PIL import Image

    from prep.data.synth import SynthConfig, generate_dataset

    info = json.loads((ROOT / "dlad/models/demo/images.json").read_text())["info"]
    config = SynthConfig(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in info["config"].items()})  # fmt: skip
    gt_path = generate_dataset(workdir, count, int(info["seed"]), config)
    gt = json.loads(gt_path.read_text())
    images = [np.asarray(Image.open(workdir / "images" / im["file_name"]).convert("RGB"))
              for im in gt["images"]]  # fmt: skip
    return images, gt


class SystemUnderTest:
    """LoadGen's SUT: queries go to the daemon from an event loop of their own (LoadGen calls
    from its threads); each sample completes with its detections, or empty on an error."""

    def __init__(self, endpoint: str, images: Sequence[np.ndarray]) -> None:
        self.images = images
        self.errors: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._stop = asyncio.Event()
        entered = threading.Event()

        async def hold() -> None:  # the client lives in one task, from enter to exit
            async with AsyncClient(endpoint, timeout_s=120.0, max_in_flight=64) as client:
                self.client = client
                entered.set()
                await self._stop.wait()

        self._held = asyncio.run_coroutine_threadsafe(hold(), self.loop)
        if not entered.wait(30):
            self._held.result(0)  # its error
        self.sut = lg.ConstructSUT(self.issue, self.flush)

    def issue(self, samples: Sequence[Any]) -> None:
        chunks = [samples] if len(samples) == 1 else [
            samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]  # fmt: skip
        for chunk in chunks:
            asyncio.run_coroutine_threadsafe(self._run(chunk), self.loop)

    def flush(self) -> None:
        pass

    async def _run(self, samples: Sequence[Any]) -> None:
        images = [self.images[s.index] for s in samples]
        settings = {"conf": CONF, "iou": IOU, "max_det": MAX_DET}
        try:
            if len(images) == 1:
                found: list[Any] = [await self.client.detect(images[0], **settings)]
            else:
                found = await self.client.detect_batch(images, **settings)
        except DladError as exc:
            found = [exc] * len(samples)
        responses, keep = [], []
        for sample, result in zip(samples, found, strict=True):
            if isinstance(result, DladError):
                name = type(result).__name__
                self.errors[name] = self.errors.get(name, 0) + 1
                data = np.zeros((0, 6), "<f4")
            else:
                data = np.ascontiguousarray(result.detections, "<f4")
            keep.append(data)
            address, _ = data.__array_interface__["data"]
            responses.append(lg.QuerySampleResponse(sample.id, address, data.nbytes))
        lg.QuerySamplesComplete(responses)  # LoadGen copies the data before it returns

    def close(self) -> None:
        lg.DestroySUT(self.sut)
        self.loop.call_soon_threadsafe(self._stop.set)
        self._held.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def settings_for(scenario: str, args: argparse.Namespace, accuracy: bool) -> Any:
    s = lg.TestSettings()
    s.scenario = SCENARIOS[scenario]
    s.mode = lg.TestMode.AccuracyOnly if accuracy else lg.TestMode.PerformanceOnly
    s.min_duration_ms = int(args.duration_s * 1000)
    s.min_query_count = 64
    s.performance_sample_count_override = args.samples
    # what LoadGen plans a run's queries by: far above the real latency, a run ends before
    # its min_duration (INVALID)
    s.single_stream_expected_latency_ns = int(args.single_stream_ms * 1e6)
    s.multi_stream_samples_per_query = BATCH
    s.multi_stream_expected_latency_ns = int(args.multi_stream_ms * 1e6)
    s.server_target_qps = args.server_qps
    s.server_target_latency_ns = int(args.server_latency_ms * 1e6)
    s.offline_expected_qps = args.offline_qps
    return s


def summary_lines(text: str) -> dict[str, str]:
    """LoadGen's summary as {field: value}, in its order (``Result is: VALID``, the scenario's
    metric, the checks, the latency percentiles, the settings used)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lstrip("* ").strip()
        if sep and key and value.strip():
            out.setdefault(key, value.strip())
    return out


def score(accuracy_log: Path, gt: dict[str, Any]) -> float:
    """COCO mAP@[.5:.95] of the detections LoadGen logged, against ``gt``."""
    from prep.evaluate import detections_to_coco, evaluate_detections

    categories = [c["id"] for c in gt["categories"]]
    ids = [im["id"] for im in gt["images"]]
    detections: list[dict[str, Any]] = []
    for entry in json.loads(accuracy_log.read_text()):
        rows = np.frombuffer(bytes.fromhex(entry["data"]), "<f4").reshape(-1, 6)
        detections += detections_to_coco(ids[entry["qsl_idx"]], rows, categories)
    return evaluate_detections(gt, detections).map50_95


def run(scenario: str, accuracy: bool, args: argparse.Namespace, endpoint: str, *,
        images: list[np.ndarray], gt: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    mode = "accuracy" if accuracy else "performance"
    out = args.out / f"{scenario}-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    log = lg.LogSettings()
    log.log_output.outdir = str(out)
    log.log_output.copy_summary_to_stdout = False
    sut = SystemUnderTest(endpoint, images)
    qsl = lg.ConstructQSL(len(images), len(images), lambda _: None, lambda _: None)
    t0 = time.perf_counter()
    try:
        lg.StartTestWithLogSettings(sut.sut, qsl, settings_for(scenario, args, accuracy), log)
    finally:
        lg.DestroyQSL(qsl)
        sut.close()
    wall = round(time.perf_counter() - t0, 1)
    row: dict[str, Any] = {"scenario": scenario, "mode": mode, "errors": sut.errors,
                           "wall_s": wall, "logs": str(out)}  # fmt: skip
    if accuracy:
        row["map50_95"] = score(out / "mlperf_log_accuracy.json", gt)
    else:
        fields = summary_lines((out / "mlperf_log_summary.txt").read_text())
        names = list(fields)
        metric = names[names.index("Mode") + 1]  # the scenario's figure, before the verdict
        row |= {"result": fields["Result is"], "metric": metric, "value": fields[metric]}
        row |= {k: fields[k] for k in names if "satisfied" in k}
        row |= {f"p{q}_ms": round(int(fields[f"{q}.00 percentile latency (ns)"]) / 1e6, 2)
                for q in ("50", "90", "99")}  # fmt: skip
        row["qps"] = fields.get("QPS w/o loadgen overhead") or fields.get("Samples per second")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--accuracy", action="store_true", help="AccuracyOnly too, scored with mAP")
    p.add_argument("--endpoint", help="a running daemon (else one is started)")
    p.add_argument("--engines", choices=["numeric", "timing", "gpu"], default="numeric")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--server-qps", type=float, default=100.0)
    p.add_argument("--server-latency-ms", type=float, default=50.0)
    p.add_argument(
        "--offline-qps",
        type=float,
        default=200.0,
        help="the samples/s expected (LoadGen issues min_duration's worth)",
    )
    p.add_argument(
        "--single-stream-ms",
        type=float,
        default=10.0,
        help="SingleStream's expected latency (LoadGen plans the run by it)",
    )
    p.add_argument(
        "--multi-stream-ms", type=float, default=50.0, help="MultiStream's expected latency a query"
    )
    p.add_argument("--out", type=Path, default=Path("runs/mlperf"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        images, gt = held_out(args.samples, Path(tmp))
    if args.engines == "numeric":
        config = NUMERIC
    elif args.engines == "timing":
        config = ('[frontend]\nendpoints = ["{endpoint}"]\n[metrics]\nenabled = false\n'
                  "[pre_post]\nenabled = false\n" + emulated_dlas(3820.0, 32)
                  + demo_model(["dla0", "dla1"]))  # fmt: skip
    else:
        config = torch_gpu_pool(args.out)
    rows = []
    with contextlib_daemon(args, config) as endpoint:
        for scenario in args.scenario:
            rows.append(run(scenario, False, args, endpoint, images=images, gt=gt))
            print(json.dumps(rows[-1]), flush=True)
        if args.accuracy:
            rows.append(run(args.scenario[0], True, args, endpoint, images=images, gt=gt))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": rows}, indent=1))  # fmt: skip


def torch_gpu_pool(out: Path) -> str:
    """The config of a CUDA host: the two DLA cores emulated, computing the real INT8 outputs,
    and the GPU running the demo model for real (its torch program, exported here, as
    ``bench/h200_pool.py`` does), pre/post-processing as CUDA kernels."""
    from dlad.models import DEMO
    from prep.torch_export import export_torch

    out.mkdir(parents=True, exist_ok=True)
    program = export_torch(DEMO / "fp16_heads.dla0.emu", out / "demo.pt2", max_batch=16)
    return NUMERIC.replace("max_batch = 8\n", 'max_batch = 16\nengine = "torch"\n').replace(
        'core1 = "bundled:demo/fp16_heads.dla1.emu"\n',
        f'core1 = "bundled:demo/fp16_heads.dla1.emu"\ntorch = "{program}"\n',
    )


def contextlib_daemon(args: argparse.Namespace, config: str) -> Any:
    """The daemon to measure: ``--endpoint``'s, or one started for the run."""
    import contextlib

    if args.endpoint:
        return contextlib.nullcontext(args.endpoint)

    @contextlib.contextmanager
    def started() -> Any:
        args.out.mkdir(parents=True, exist_ok=True)
        with running_daemon(config, args.out / "dlad.log") as (_, endpoint):
            yield endpoint

    return started()


if __name__ == "__main__":
    main()
