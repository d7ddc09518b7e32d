"""QAT on a CUDA device: calibration, fine-tuning and export as the `full` preset runs them."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from prep import qat
from prep.export import export_onnx
from prep.model import YOLOv5

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none: run on the H200)"
    ),
]


def test_calibrate_finetune_export_on_cuda(warm_model: YOLOv5, tmp_path: Path) -> None:
    qmodel, _ = qat.quantize(warm_model, qat.QATConfig())
    qmodel.to("cuda")
    gen = torch.Generator().manual_seed(5)
    data = [torch.rand(2, 3, 64, 64, generator=gen).cuda() for _ in range(2)]
    assert qat.calibrate(qmodel, data) > 0
    amaxes = [m.amax for m in qmodel.modules() if hasattr(m, "_amax")]
    assert amaxes
    assert all(a.device.type == "cuda" for a in amaxes)
    teacher = copy.deepcopy(warm_model).fuse().cuda()
    it = iter(data * 4)
    cfg = qat.QATConfig(epochs=1, iters_per_epoch=4, lr=1e-5)
    history = qat.finetune(qmodel, teacher, lambda: next(it), cfg)
    assert history
    assert torch.isfinite(torch.tensor(history[0]["loss"]))
    qat.refresh_weight_amax(qmodel)
    qmodel.cpu()
    export_onnx(qmodel, tmp_path / "q.onnx", 64)
    assert (tmp_path / "q.onnx").stat().st_size > 0
