"""ONNX -> backend engines (TensorRT plans). Importing this package loads nothing heavy.

- `specdec.engines.trt_config`: build options, optimization profiles, plan names, manifest records and engine
  selection (stdlib only; the runtime uses it too).
- `specdec.engines.trt_compat`: every TensorRT 10-vs-11 difference, in one place.
- `specdec.engines.tensorrt`: `build_engine` / `build_bundle_engines` (needs TensorRT and a GPU).
- `specdec.engines.cuda_glue`: thin cuda-python helpers (device buffers, pinned buffers, stream, graphs).
"""
