"""The cudla backend: cuDLA standalone mode with NvSciBuf / NvSciSync, bound through ctypes.

``abi`` declares the C ABI and loads the libraries, ``nvsci`` wraps NvSciBuf / NvSciSync,
``backend`` implements the device interface (:class:`~dlad.devices.cudla.backend.CudlaDlaCore`:
the core, task submission, completion and teardown) from ``modules`` (loadables and their I/O
descriptors), ``memory`` (NvSciBuf I/O buffers) and ``fences`` (NvSciSync fences), all
re-exported by ``backend``; ``probe`` reports the platform, ``selftest`` exercises every call
once on an Orin, and ``cuda_interop`` imports the NvSci objects into CUDA for GPU
post-processing. Nothing heavy is imported here; ``docs/jetson.md`` is the user's guide.
"""
