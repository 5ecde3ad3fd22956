"""specdec: exact speculative decoding on static-KV ONNX / TensorRT engines."""
__version__ = "0.1.0"
