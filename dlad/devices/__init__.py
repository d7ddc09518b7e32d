"""Device backends: one module per backend, each owning its accelerator (see ``DESIGN.md`` §1, §4).

``int8_engine`` is the numeric engine of the emulated DLA core: it runs a loadable's INT8 graph
(generated offline by ``prep.emulate_graph``) on onnxruntime's CPU INT8 kernels, consuming the
DLA's ``DLA_HWC4`` int8 input bytes and producing its ``CHW32`` int8 / ``CHW16`` fp16 output
bytes. Nothing here imports onnxruntime (or any other heavy package) at import time.
"""
