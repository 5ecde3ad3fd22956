"""The cuda backend: specdec's own kernels on an NVIDIA GPU (specdec.cuda), over the native weights a bundle carries
(bf16 / f16 / f32 rows, Q4_1 blocks, an int4-q41 draft's pairs), uploaded once in their own layout.

- Static KV [L, slots, Hkv, S, D] fp32 on the device; rollback is the caller passing a smaller cache_len.
- Each call shape of the decode loop (rows, tokens, last-only) is a CUDA graph, captured at its first use and
  replayed with its inputs written through a pinned buffer; prefill chunks longer than that run eagerly on cuBLAS.
- Logits stay on the device: a call returns DeviceLogits, whose argmax came back with it; the logits cross to the
  host only where something reads them (sampled requests).
- An int4-q41 draft runs beside its target on the same stream and on the target's KV (as native's draft does), with
  fp32 activations: any draft is exact, and its q is the distribution it was sampled from.
- No PyTorch; CuPy is imported at open (the [cuda] extra).

CudaOptions.kernels chooses the kernel set: the GPU's (the default) or the numpy references, which run the same
orchestration on a CPU for the tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.weights_file import Pages
from specdec.errors import BackendError, CapacityError
from specdec.manifest import ModelEntry
from specdec.native.core import FamilyFeature
from specdec.native.weights import LINEARS
from specdec.runtime.backend import Backend, bounds, check_capacity, check_tokens
from specdec.runtime.config import BackendName, Device
from specdec.runtime.forward import Capabilities, ForwardRequest, Output
from specdec.runtime.kernel_backend import KernelBackend

MAX_HEAD_DIM = 256  # kernels.cu's attention holds D / 32 values a lane in 8 registers
MEMORY_MARGIN = 256 << 20  # left free on the GPU for the CUDA context, cuBLAS and CuPy's pool


@dataclass(frozen=True)
class CudaOptions:
    device: int = 0
    graphs: bool = True  # False: launch every kernel on every call (to measure what graphs buy)
    fused: bool = True  # False: RMSNorm and SiLU as kernels of their own (to measure what the fusions buy)
    kernels: type | None = None  # the kernel set's class; None: specdec.cuda.device.CupyKernels

    def __post_init__(self):
        if isinstance(self.device, bool) or not isinstance(self.device, int) or self.device < 0:
            raise BackendError(f"cuda device index {self.device!r} is not a GPU index", "pass device='cuda:N'")


def device_index(device: str) -> int:
    """'cuda' or 'cuda:N' -> N."""
    _, _, index = device.partition(":")
    if index and not index.isdigit():
        raise BackendError(f"device={device!r} names no GPU", "pass device='cuda:0' (or another index)")
    return int(index or 0)


class CudaBackend(KernelBackend):
    name = BackendName.CUDA
    devices = (Device.CUDA,)
    exact_prefix_kv = False  # a prefill chunk's products run on cuBLAS, a verify pass's on kernels.cu
    capabilities = Capabilities(frozenset({Output.LOGITS, Output.FEATURES, Output.GREEDY_CHAIN}), feature_layers=None)
    unsupported = frozenset(FamilyFeature)  # kernels.cu runs the LLaMA layout on q41, q80 and row weights
    other_backends = "use backend='native' (on the CPU) or 'onnxruntime'"

    def __init__(self, root: Path, entry: ModelEntry, options: CudaOptions = CudaOptions(),
                 target: "CudaBackend | None" = None):
        super().__init__(root, entry, target)
        self.options = options
        self.kernels = None  # a draft's are its target's
        self.defaults = None  # the manifest's γ_max and prefill chunk, read at open
        self.memory = {}  # bytes the engine holds, by part (weights, kv, workspace)

    @classmethod
    def for_target(cls, root: Path, entry: ModelEntry, device: str, threads: int | None) -> "CudaBackend":
        return cls(root, entry, CudaOptions(device=device_index(device)))

    @classmethod
    def for_draft(cls, root: Path, draft: ModelEntry, threads: int | None, target: Backend) -> "CudaBackend":
        return cls(root, draft, target.options, target=target)

    # ---- lifetime ----
    def open(self) -> "CudaBackend":
        from specdec.manifest import read_manifest

        self.defaults = read_manifest(self.root).defaults
        if self.entry.dims.head_dim > MAX_HEAD_DIM:
            raise BackendError(f"the {self.entry.role}'s head size is {self.entry.dims.head_dim}; the cuda kernels take "
                               f"at most {MAX_HEAD_DIM}", self.other_backends)
        return super().open()

    def _open_target(self, record):
        from specdec.native.weights import target_weights

        weights = target_weights(self.root, record, self.entry.dims, Pages.SHARED)  # mapped: uploaded, then dropped
        self.check_family(weights)
        self.kernels = self._kernels()
        return self._model(weights, None, None)

    def _open_draft(self, record, target_model):
        from specdec.native.weights import draft_weights

        self.kernels = self.target.kernels
        draft = draft_weights(self.root, record, self.entry.dims, target_model.weights, Pages.SHARED)
        return self._model(target_model.weights, draft, target_model)

    def _kernels(self):
        from specdec.cuda.device import CupyKernels

        kernel_set = self.options.kernels or CupyKernels
        rows = self.graph_rows()
        return kernel_set(self.options.device, few_rows=rows) if kernel_set is CupyKernels else kernel_set(rows)

    def graph_rows(self) -> int:
        """Rows of the largest call the decode loop makes: every slot verifying γ_max drafts."""
        return self.max_batch * (self.defaults.gamma_max + 1)

    def _model(self, weights, draft, target):
        from specdec.cuda.model import CudaModel

        model = CudaModel(self.kernels, weights, self.entry.dims, self.max_seq_len, self.max_batch,
                          self.graph_rows(), draft=draft, kv_owner=target, graphs=self.options.graphs,
                          fused=self.options.fused)
        self._check_memory(model)
        return model.open(target)

    def _check_memory(self, model) -> None:
        """Refuse at open what would not fit: weights, KV for max_batch slots, workspaces, cuBLAS's fp32 copy."""
        kernels, chunk = self.kernels, self.max_batch * self.defaults.max_prefill_chunk
        shared, limit = kernels.attention_shared(self.max_seq_len, self.entry.dims.head_dim), kernels.max_shared
        if shared > limit:
            raise CapacityError(f"attention over S={self.max_seq_len} slots needs {shared} bytes of shared memory a "
                                f"block; this GPU gives {limit}", "re-export with a smaller --max-seq-len")
        widest = 4 * max(w.shape[0] * w.shape[1] * (32 if w.dtype.names else 1)  # cuBLAS's fp32 copy of one weight
                         for w in [model.weights.head, *(getattr(layer, name) for layer in model.weights.layers
                                                         for name in LINEARS)])
        self.memory = {"weights": model.weight_bytes(),
                       "kv": model.kv_bytes(self.max_batch) if self.target is None else 0,
                       "workspace": model.workspace_bytes(chunk) + widest}
        free = kernels.free_bytes()
        need = sum(self.memory.values()) + MEMORY_MARGIN
        if free is not None and need > free:
            parts = ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in self.memory.items())
            raise CapacityError(f"the {self.entry.role} needs {need / 2**20:.0f} MiB of GPU memory ({parts}, "
                                f"{MEMORY_MARGIN >> 20} MiB margin); cuda:{self.options.device} has "
                                f"{free / 2**20:.0f} MiB free",
                                "re-export with a smaller --max-batch or --max-seq-len, or free the GPU")

    @property
    def kv_layout(self) -> str | None:
        return None  # KV lives on the device


    def _check_call(self, request: ForwardRequest) -> None:
        self._check_positions(request.cache_len, request.input_ids.shape[1])

    def propose_greedy(self, tokens: np.ndarray, cache_len: np.ndarray, slots: np.ndarray, steps: int) -> np.ndarray:
        """`steps` greedy draft tokens for each row, in one graph (each step's argmax feeds the next on the device):
        tokens [B] (each row's last chosen token, not yet fed) at positions cache_len[b] of slots[b] -> [B, steps].
        The same tokens as `steps` one-token forwards and their argmax; K/V land at [cache_len[b], + steps)."""
        slots = self.check_call(np.asarray(tokens, np.int64).reshape(-1, 1), cache_len, slots)
        check_capacity(cache_len, steps, self.max_seq_len)
        check_tokens(tokens, self.vocab_size)
        self._check_positions(cache_len, steps)
        return self.model.chain(tokens, cache_len, slots, steps)

    def _check_positions(self, cache_len: np.ndarray, steps: int) -> None:
        end, table = bounds(cache_len)[1] + steps, self.model.weights.max_position
        if end > table:
            raise CapacityError(f"positions up to {end} pass the rotary table's {table}",
                                "re-export with a larger --max-seq-len")

    def chains(self, rows: int, steps: int) -> bool:
        """Whether propose_greedy takes `rows` rows of `steps` steps in one graph."""
        return rows * steps <= self.graph_rows() and rows <= self.max_batch

    @property
    def graphs(self):
        """The model's GraphCache (captures, replays, shapes)."""
        return self.model.graphs

    def _release(self) -> None:
        if self.model is not None:
            self.model.close()
        if self.kernels is not None and self.target is None:
            self.kernels.close()
        self.kernels = None

