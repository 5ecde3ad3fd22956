"""specdec: exact speculative decoding on static-KV ONNX / TensorRT engines.

`import specdec` is light: the runtime (numpy, onnxruntime) loads on first use of `load` or `GenerationConfig`.
"""
__version__ = "0.1.0"

__all__ = ["GenerationConfig", "load", "__version__"]


def __getattr__(name):
    if name in ("GenerationConfig", "GenerationResult", "Generator", "load"):
        from specdec import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
