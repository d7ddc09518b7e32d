"""prep: offline model preparation for dlad.

QAT of a YOLOv5-family detector -> ONNX with Q/DQ -> Q/DQ translator (PTQ ONNX, scales JSON,
TensorRT calibration cache) -> DLA loadables -> accuracy validation. Heavy dependencies (torch,
onnx, modelopt, tensorrt) are imported inside the functions that need them, so ``prep --help``
runs anywhere.
"""
