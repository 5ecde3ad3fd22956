"""specdec's own GPU engine: CUDA kernels (kernels.cu, compiled through NVRTC by CuPy), CUDA graphs per call shape,
pinned buffers, and a numpy reference of every kernel (reference.py) that CI runs in their place. No PyTorch.
The backend around it is specdec.runtime.cuda_backend."""
