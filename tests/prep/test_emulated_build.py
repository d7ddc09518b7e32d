"""The emulated loadables built from a real (smoke) chain: descriptors, scales, per-core files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dlad.loadable import DataType, LoadableCoreError, TensorFormat, read_loadable
from prep.cli import main
from prep.emulated_build import HEAD_VARIANTS, LAST_C3_NODES

# The smoke chain (train, QAT, export, translate, build) runs once in the fixture; on two loaded
# cores it can take minutes, so the hang guard is generous (it is not a timing assertion).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("chain")
    assert main(["all", "--preset", "smoke", "--workdir", str(work), "-q"]) == 0
    return work


def test_variants_and_descriptors(chain_dir: Path) -> None:
    build = chain_dir / "build"
    for v in HEAD_VARIANTS:
        for core in (0, 1):
            lo = read_loadable(build / f"{v.name}.dla{core}.emu", expect_core=core)
            assert lo.heads == v.heads
            (inp,) = lo.inputs
            assert inp.tensor_format == TensorFormat.DLA_HWC4
            assert inp.data_type == DataType.INT8
            assert (inp.c, inp.h, inp.w) == (3, 128, 128)
            assert inp.size == 128 * 128 * 4
            assert inp.scale == pytest.approx(lo.input_scale)
            for out, stride in zip(lo.outputs, (8, 16, 32), strict=True):
                assert (out.c, out.h, out.w) == (3 * (5 + 8), 128 // stride, 128 // stride)
                if v.heads == "int8":
                    assert out.tensor_format == TensorFormat.CHW32
                    assert out.size == -(-out.c // 32) * out.h * out.w * 32
                    assert lo.output_scales[out.name] > 0
                else:
                    assert out.tensor_format == TensorFormat.CHW16
                    assert out.size == -(-out.c // 16) * out.h * out.w * 16 * 2
            assert set(v.extra_fp16) <= set(lo.fp16_nodes)
            assert lo.latency_us > 0
    with pytest.raises(LoadableCoreError):
        read_loadable(build / "int8_heads.dla1.emu", expect_core=0)


def test_last_c3_variant_marks_its_nodes(chain_dir: Path) -> None:
    lo = read_loadable(chain_dir / "build" / "fp16_heads_last_c3.dla0.emu")
    assert set(LAST_C3_NODES) <= set(lo.fp16_nodes)


def test_input_scale_matches_the_cache(chain_dir: Path) -> None:
    cache = (
        (chain_dir / "translate" / "model_precision_config_calib.cache").read_text().splitlines()
    )
    images = next(line for line in cache if line.startswith("images: "))
    scale = np.frombuffer(bytes.fromhex(images.split(": ")[1].rjust(8, "0")), ">f4")[0]
    lo = read_loadable(chain_dir / "build" / "int8_heads.dla0.emu")
    assert lo.input_scale == pytest.approx(float(scale), rel=1e-6)
