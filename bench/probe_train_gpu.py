import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from prep.loss import YoloLoss
from prep.model import YOLOv5
from prep.train import TrainConfig, augment, collate_targets

dev = torch.device("cuda")
for bs in (64, 128):
    m = YOLOv5("s", 8).to(dev).train()
    crit = YoloLoss(m.detect.anchors, 8, 640).to(dev)
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    imgs = np.random.default_rng(0).integers(0, 255, (bs, 640, 640, 3), np.uint8)
    labels = [np.array([[1, 0.5, 0.5, 0.2, 0.2]] * 5, np.float32)] * bs
    gen = torch.Generator().manual_seed(0)
    cfg = TrainConfig()
    for i in range(25):
        if i == 5:
            torch.cuda.synchronize()
            t0 = time.time()
        x = torch.from_numpy(imgs).to(dev).permute(0, 3, 1, 2).float().div_(255)
        t = collate_targets(labels).to(dev)
        x, t = augment(x, t, cfg, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            heads = m(x)
        loss, _ = crit([h.float() for h in heads], t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / 20
    print(f"bs {bs}: {dt * 1000:.0f} ms/step, {bs / dt:.0f} img/s", flush=True)
