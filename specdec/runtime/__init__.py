"""The lean runtime: numpy + onnxruntime (or TensorRT); never imports torch or transformers."""
from specdec.runtime.config import GenerationConfig
from specdec.runtime.generator import GenerationResult, Generator, load

__all__ = ["GenerationConfig", "GenerationResult", "Generator", "load"]
