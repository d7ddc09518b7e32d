"""dlad: serve YOLOv5-family detection on a Jetson Orin's DLA cores and GPU.

The daemon never imports torch, onnx or tensorrt at import time (see ``docs/``)."""

__version__ = "0.1.0"
