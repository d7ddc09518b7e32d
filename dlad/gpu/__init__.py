"""GPU pre- and post-processing: CUDA C kernels compiled with NVRTC through cuda-python, driven
on CUDA streams and chained to the DLA tasks with fences. Nothing here imports torch or CuPy,
and nothing imports cuda-python until a GPU is asked for (:func:`dlad.gpu.driver.probe`)."""
