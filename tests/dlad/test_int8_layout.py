"""Host-independent INT8: the emulated core's sums are exact on this host, whatever its CPU, and
the cases that prove it fail where the old (uint8 x int8) layout saturates.

The cases (``tests/dlad/int8_cases.py``) are a 3x3 and a 1x1 convolution and a matmul whose
adjacent uint8 x int8 product pairs exceed int16 and whose int32 sums exceed 32767, against an
exact integer reference. They run here on the operands the engine takes (``auto``), on the
re-encoded uint8 x uint8 operands, and on the old uint8 x int8 ones, which must be exact exactly
where the probe says so. Under valgrind (which shows programs an AVX2 CPU without AVX-512 or
VNNI) the old layout must fail them and ``auto`` must still pass: so the test can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from dlad.devices import int8_layout
from dlad.devices.int8_layout import (
    open_session,
    select_kernel_path,
    u8s8_is_exact,
    weights_to_uint8,
)
from tests.dlad.int8_cases import INT16_MAX, Case, cases, mismatches

ROOT = Path(__file__).resolve().parents[2]
CASES = cases()


def _fused_ops(model: bytes) -> set[str]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimized.onnx"
        opts.optimized_model_filepath = str(path)
        ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        return {n.op_type for n in onnx.load(str(path)).graph.node}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cases_overflow_int16_pairs_and_run_on_integer_kernels(case: Case) -> None:
    """The cases are hard enough to catch a saturating kernel, and are not computed in float."""
    assert case.max_pair > INT16_MAX
    assert case.max_acc > INT16_MAX
    assert case.op in _fused_ops(case.model)
    assert case.op in _fused_ops(weights_to_uint8(case.model))


@pytest.mark.parametrize("operands", ["auto", "u8u8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sums_are_exact(case: Case, operands: int8_layout.OperandsChoice) -> None:
    assert mismatches(case, operands) == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_old_layout_is_exact_only_where_the_probe_says(case: Case) -> None:
    wrong = mismatches(case, "u8s8")
    if u8s8_is_exact():
        assert wrong == 0
    else:  # an AVX2 / AVX-512 CPU without VNNI: vpmaddubsw saturates
        assert wrong > 0


def test_auto_takes_the_fast_exact_operands() -> None:
    path = select_kernel_path("auto")
    assert path.exact
    assert path.operands == ("u8s8" if u8s8_is_exact() else "u8u8")
    assert path.runtime == f"onnxruntime {ort.__version__}"
    summary = path.summary()
    assert path.operands in summary
    assert "exact int32 sums" in summary
    assert json.loads(json.dumps(path.to_dict()))["operands"] == path.operands
    forced = select_kernel_path("u8u8")
    assert (forced.operands, forced.exact, forced.reason) == ("u8u8", True, "asked for")
    with pytest.raises(ValueError, match="operands must be"):
        select_kernel_path("s8s8")  # type: ignore[arg-type]


def test_no_exact_operands_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_layout, "_probe_cached", lambda operands: ("conv3x3",))
    with pytest.raises(int8_layout.NoExactKernelError, match="neither"):
        select_kernel_path("auto")
    path = select_kernel_path("u8s8")
    assert not path.exact
    assert "NOT exact" in path.summary()


def test_reencoding_keeps_every_value_and_touches_weights_only() -> None:
    case = CASES[0]
    before = {i.name: i for i in onnx.load_from_string(case.model).graph.initializer}
    after = {
        i.name: i for i in onnx.load_from_string(weights_to_uint8(case.model)).graph.initializer
    }
    assert before.keys() == after.keys()
    for name in ("w", "wz"):
        assert after[name].data_type == TensorProto.UINT8
        old = numpy_helper.to_array(before[name]).astype(np.int16)
        np.testing.assert_array_equal(
            numpy_helper.to_array(after[name]).astype(np.int16) - 128, old
        )
    for name in before.keys() - {"w", "wz"}:  # activation scales and zero points, output scale
        assert before[name] == after[name]
    with pytest.raises(ValueError, match="not an ONNX model"):
        weights_to_uint8(b"\x08\x07garbage")


def test_session_on_reencoded_weights() -> None:
    path = select_kernel_path("u8u8")
    session = open_session(CASES[2].model, threads=1, kernel=path)
    (got,) = session.run(None, {"x": CASES[2].x})
    np.testing.assert_array_equal(got, CASES[2].want)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.timeout(600)
def test_old_layout_fails_on_an_avx2_cpu_without_vnni() -> None:
    """valgrind's CPU is an AVX2 one without AVX-512 or VNNI, whatever the host: onnxruntime
    there takes its saturating vpmaddubsw kernels for uint8 x int8."""
    proc = subprocess.run(
        ["valgrind", "-q", "--tool=none", sys.executable, "-m", "tests.dlad.int8_cases"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["auto"] == "u8u8"
    assert all(v == 0 for v in report["mismatches"]["auto"].values())
    assert all(v == 0 for v in report["mismatches"]["u8u8"].values())
    assert all(v > 0 for v in report["mismatches"]["u8s8"].values()), report


def test_a_probe_onnxruntime_cannot_run_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. an onnxruntime older than the graph's IR version: an error that names the probe,
    which the engine turns into its EngineConfigError (and the daemon into a load failure)."""
    name, model, feed = int8_layout._probe_models()[0]
    broken = onnx.load_from_string(model)
    broken.ir_version = 99
    monkeypatch.setattr(
        int8_layout, "_probe_models", lambda: [(name, broken.SerializeToString(), feed)]
    )
    with pytest.raises(int8_layout.NoExactKernelError, match=f"probe '{name}'"):
        int8_layout._probe("u8s8")


def test_probes_are_readable_by_older_onnxruntime() -> None:
    for _, model, _ in int8_layout._probe_models():
        assert onnx.load_from_string(model).ir_version == 8
    assert all(onnx.load_from_string(c.model).ir_version == 8 for c in CASES)
