"""specdec: exact speculative decoding on static-KV ONNX / TensorRT engines.

`import specdec` is light: the runtime (numpy, onnxruntime) loads on first use of `load` or `GenerationConfig`.
"""
from specdec.version import __version__

__all__ = ["GenerationConfig", "load", "__version__"]


def __getattr__(name):
    if name in ("GenerationConfig", "GenerationResult", "Generator", "load"):
        from specdec import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
