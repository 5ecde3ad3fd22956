"""The lowerings of the ONNX contract (docs/export.md) as objects. Each owns its I/O names and dtypes, the numpy +
onnxruntime driver that the backends, the export's parity check and the calibration reader all use, and what it
accepts (TensorRT, quantization methods). No other code compares lowering names: it asks `lowering_for(name)`.

- `plain`: standard ONNX ops; past_keys / past_values [L, B, Hkv, S, D] are read only and new_* [L, B, Hkv, T, D]
  come back, which the driver writes at [cache_len[b], cache_len[b] + T). The reference and the TensorRT input.
- `gqa`: com.microsoft GroupQueryAttention over per-layer buffers [B, Hkv, S, D] bound as both past and present,
  so the op writes the new K/V in place and reads only the valid length; logits only at `logit_positions`.
  onnxruntime's CPU kernel needs B = 1 when T > 1 with a past, so the driver runs such calls row by row; T = 1
  calls of several rows run as one batch (one read of the weights for all rows).

A driver serves KV *slots* 0..batch-1 (set by `reset`). A call lists the slots its rows use (default 0..B-1);
the other slots keep their KV below their committed length. Where a whole-batch run must include an unlisted
slot (a hole), the hole is fed a pad token at a position no committed KV uses, or its write-back is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.errors import ConfigError, EngineBuildError, ManifestError
from specdec.manifest import MODELOPT_METHODS, Dtype, LoweringName, ModelDims, TensorSpec

KV_NUMPY = {Dtype.FLOAT32: np.float32, Dtype.FLOAT16: np.float16}  # the one KV dtype map (no bfloat16 on the CPU)
PAD_ID = 0
FEATURES = "features"  # the optional output [B, T, F, H]: every fed token's hidden state after each of F layers


def kv_numpy_dtype(kv_dtype: str):
    """The numpy dtype of a manifest KV dtype, or ConfigError where onnxruntime's CPU EP has no kernels."""
    if kv_dtype not in KV_NUMPY:
        raise ConfigError(f"KV dtype {kv_dtype} has no onnxruntime CPU kernels",
                          "export with --dtype fp32 (or fp16) for the onnxruntime CPU backend; --weights bf16 keeps "
                          "bf16 weights in an fp32 graph, which the native engine runs from 2-byte rows")
    return KV_NUMPY[kv_dtype]


def _slots(slots, rows: int) -> np.ndarray:
    return np.arange(rows, dtype=np.int64) if slots is None else np.asarray(slots, dtype=np.int64)


def _is_identity(slots: np.ndarray, batch: int) -> bool:
    return len(slots) == batch and bool((slots == np.arange(batch)).all())


@dataclass(frozen=True)
class Geometry:
    """What a driver needs to know of its model."""

    dims: ModelDims
    max_seq_len: int
    kv_dtype: str

    @property
    def kv_shape(self) -> tuple:  # one layer, one row: [Hkv, S, D]
        return (self.dims.num_kv_heads, self.max_seq_len, self.dims.head_dim)


class PlainDriver:
    """Static KV [L, batch, Hkv, S, D] in numpy; every call runs the whole batch (holes skip the write-back)."""

    def __init__(self, session, geometry: Geometry):
        self.session = session
        self.geometry = geometry
        self.keys = self.values = None
        self.features = _has_features(session)

    def reset(self, batch: int) -> None:
        g = self.geometry
        shape = (g.dims.num_layers, batch, *g.kv_shape)  # [L, B, Hkv, S, D]
        if self.keys is None or self.keys.shape != shape:
            dtype = kv_numpy_dtype(g.kv_dtype)
            self.keys, self.values = np.zeros(shape, dtype), np.zeros(shape, dtype)

    def _whole(self, input_ids: np.ndarray, cache_len: np.ndarray, slots: np.ndarray) -> tuple:
        # -> ids [batch, T], cache_len [batch]; holes get pads at 0 and their write-back is skipped
        batch = self.keys.shape[1]
        if _is_identity(slots, batch):
            return input_ids, cache_len
        ids = np.full((batch, input_ids.shape[1]), PAD_ID, dtype=np.int64)
        lens = np.zeros(batch, dtype=np.int64)
        ids[slots], lens[slots] = input_ids, cache_len
        return ids, lens

    def feeds(self, input_ids: np.ndarray, cache_len: np.ndarray) -> dict:
        """The inputs a call would get, with copies of the KV (calibration keeps them)."""
        return {"input_ids": input_ids, "cache_len": cache_len, "past_keys": self.keys.copy(),
                "past_values": self.values.copy()}

    def copy_kv(self, source: "PlainDriver", slot: int, start: int, stop: int) -> None:
        """Positions [start, stop) of `slot` from another model's driver (its first L layers)."""
        layers = self.geometry.dims.num_layers
        self.keys[:, slot, :, start:stop] = source.keys[:layers, slot, :, start:stop]
        self.values[:, slot, :, start:stop] = source.values[:layers, slot, :, start:stop]

    def run(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False, slots=None,
            features: bool = False) -> np.ndarray | tuple:
        # input_ids: [B, T]; cache_len: [B] -> logits [B, T, V] ([B, 1, V] if last_only); with features (the graph
        # has them): (logits, features [B, T, F, H])
        slots = _slots(slots, len(input_ids))
        ids, lens = self._whole(input_ids, cache_len, slots)
        feeds = {"input_ids": ids, "cache_len": lens, "past_keys": self.keys, "past_values": self.values}
        names = ["logits", "new_keys", "new_values"] + ([FEATURES] if features else [])
        outputs = self.session.run(names, feeds)  # new_*: [L, batch, Hkv, T, D]
        logits, new_keys, new_values = outputs[:3]
        steps = ids.shape[1]
        for slot, start in zip(slots.tolist(), cache_len.tolist()):
            self.keys[:, slot, :, start : start + steps] = new_keys[:, slot]
            self.values[:, slot, :, start : start + steps] = new_values[:, slot]
        logits = logits[:, -1:] if last_only else logits
        chosen = (lambda out: out) if _is_identity(slots, len(ids)) else (lambda out: out[slots])  # noqa: E731
        return (chosen(logits), chosen(outputs[3])) if features else chosen(logits)


class GqaDriver:
    """Per-layer buffers [batch, Hkv, S, D] updated in place by GroupQueryAttention through IO binding.

    T > 1: one run per row, on a binding of that row's slice [1, Hkv, S, D]. T = 1 with several rows: one run
    over the slots 0..max(slot), holes fed a pad at their high-water mark (min(written, S - 1)), which is at or
    past any committed length, so no valid KV is touched."""

    def __init__(self, session, geometry: Geometry):
        self.session = session
        self.geometry = geometry
        self.buffers = []  # 2L arrays [batch, Hkv, S, D]: keys of layers 0..L-1, then values
        self.bindings = {}  # ("row", slot) or ("rows", n) -> IO binding with the KV bound
        self.written = np.zeros(0, dtype=np.int64)  # [batch] high-water mark of written positions per slot
        self.features = _has_features(session)  # the graph's features output, or None

    def reset(self, batch: int) -> None:
        g = self.geometry
        shape = (batch, *g.kv_shape)
        if not self.buffers or self.buffers[0].shape != shape:
            dtype = kv_numpy_dtype(g.kv_dtype)
            self.buffers = [np.zeros(shape, dtype) for _ in range(2 * g.dims.num_layers)]
            self.bindings = {}
        self.written = np.zeros(batch, dtype=np.int64)

    def _names(self) -> list:
        layers = self.geometry.dims.num_layers
        return [f"past_{kind}.{i}" for kind in ("key", "value") for i in range(layers)]

    def _binding(self, rows: slice):
        key = (rows.start, rows.stop)
        binding = self.bindings.get(key)
        if binding is None:
            import onnxruntime as ort

            binding = self.session.io_binding()
            for name, buffer in zip(self._names(), self.buffers):
                value = ort.OrtValue.ortvalue_from_numpy(buffer[rows])  # a view: the op writes the buffer
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(name.replace("past_", "present_"), value)
            self.bindings[key] = binding
        return binding

    def _run(self, binding, ids: np.ndarray, cache_len: np.ndarray, positions: np.ndarray) -> tuple:
        # -> (logits [n, N, V], features [n, T, F, H] or None). The logits go straight into a new array bound as the
        # output: no OrtValue wrappers for the 2L KV outputs (get_outputs() builds one per output, a cost per call that
        # grows with the layers), and no copy (`python benchmarks/step.py BUNDLE --backends onnxruntime` times the
        # step). A graph's features are always bound anew: a binding outlives the arrays it held.
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("cache_len", cache_len)
        binding.bind_cpu_input("logit_positions", positions)
        logits = np.empty((len(ids), len(positions), self.geometry.dims.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        features = None
        if self.features is not None:
            features = np.empty((*ids.shape, *self.features), np.float32)
            binding.bind_output(FEATURES, "cpu", 0, np.float32, list(features.shape), features.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits, features

    def feeds(self, input_ids: np.ndarray, cache_len: np.ndarray) -> dict:
        """The inputs of a one-row call on slot 0, with copies of its KV (calibration keeps them)."""
        steps = input_ids.shape[1]
        kv = {name: buffer[:1].copy() for name, buffer in zip(self._names(), self.buffers)}
        return {"input_ids": input_ids, "cache_len": cache_len,
                "logit_positions": np.arange(steps, dtype=np.int64), **kv}

    def copy_kv(self, source: "GqaDriver", slot: int, start: int, stop: int) -> None:
        """Positions [start, stop) of `slot` from another model's driver (its first L layers)."""
        layers, theirs = self.geometry.dims.num_layers, source.geometry.dims.num_layers
        for i in range(layers):
            self.buffers[i][slot, :, start:stop] = source.buffers[i][slot, :, start:stop]
            self.buffers[layers + i][slot, :, start:stop] = source.buffers[theirs + i][slot, :, start:stop]
        self.written[slot] = max(int(self.written[slot]), stop)

    def run(self, input_ids: np.ndarray, cache_len: np.ndarray, last_only: bool = False, slots=None,
            features: bool = False) -> np.ndarray | tuple:
        # input_ids: [B, T]; cache_len: [B] -> logits [B, T, V] ([B, 1, V] if last_only); with features (the graph
        # has them): (logits, features [B, T, F, H])
        rows, steps = input_ids.shape
        slots = _slots(slots, rows)
        positions = np.array([steps - 1] if last_only else np.arange(steps), dtype=np.int64)
        np.maximum.at(self.written, slots, cache_len + steps)
        if steps == 1 and rows > 1:
            out = [self._run_batched(input_ids, cache_len, slots, positions)]
        else:
            out = [self._run(self._binding(slice(s, s + 1)), input_ids[b : b + 1], cache_len[b : b + 1], positions)
                   for b, s in enumerate(slots.tolist())]
        logits = out[0][0] if len(out) == 1 else np.concatenate([o[0] for o in out])
        if not features:
            return logits
        return logits, out[0][1] if len(out) == 1 else np.concatenate([o[1] for o in out])

    def _run_batched(self, input_ids, cache_len, slots, positions) -> tuple:
        count = int(slots.max()) + 1
        ids = np.full((count, 1), PAD_ID, dtype=np.int64)
        lens = np.minimum(self.written[:count], self.geometry.max_seq_len - 1)  # holes: past any committed KV
        ids[slots], lens[slots] = input_ids, cache_len
        logits, features = self._run(self._binding(slice(0, count)), ids, lens, positions)
        return logits[slots], None if features is None else features[slots]  # [n, 1, V], [n, 1, F, H]


ORT_TYPES = {"int64": "tensor(int64)", Dtype.FLOAT32: "tensor(float)", Dtype.FLOAT16: "tensor(float16)",
             Dtype.BFLOAT16: "tensor(bfloat16)"}  # a TensorSpec's dtype -> onnxruntime's NodeArg.type


def _mismatch(role: str, kind: str, spec: TensorSpec, arg) -> str | None:
    """Why a graph's input or output (an onnxruntime NodeArg, or None) differs from the manifest's spec."""
    if arg is None:
        return f"the {role} graph has no {kind} {spec.name}"
    shape = arg.shape
    same = len(shape) == len(spec.shape) and all(
        not (isinstance(want, int) and isinstance(dim, int)) or want == dim for want, dim in zip(spec.shape, shape))
    if not same:
        return f"the {role} graph's {kind} {spec.name} has shape {shape}; the manifest describes {spec.shape}"
    if ORT_TYPES.get(spec.dtype, arg.type) != arg.type:
        return f"the {role} graph's {kind} {spec.name} is {arg.type}; the manifest describes {spec.dtype}"
    return None


def _has_features(session) -> tuple | None:
    """(F, H) of a graph's features output, or None where it has none."""
    for output in session.get_outputs():
        if output.name == FEATURES:
            return tuple(output.shape[2:])
    return None


class Lowering:
    """One lowering of the contract; see the module docstring."""

    name = ""
    tensorrt = False  # TensorRT parses the graph
    contrib_ops = False  # the graph uses onnxruntime com.microsoft ops
    driver_class = PlainDriver

    def io_names(self, num_layers: int, features: bool = False) -> tuple[list, list]:
        """Input and output names; with `features`, the outputs end in FEATURES."""
        raise NotImplementedError

    def io_specs(self, dims: ModelDims, max_seq_len: int, kv_dtype: str, feature_layers=()) -> tuple[list, list]:
        """The named inputs and outputs with their dtypes and shapes; a `features` output [B, T, F, H] where the
        graph returns the hidden states of F layers."""
        inputs, outputs = self._specs(dims, max_seq_len, kv_dtype)
        if feature_layers:
            outputs.append(TensorSpec(FEATURES, "float32", ["B", "T", len(feature_layers), dims.hidden_size]))
        return inputs, outputs

    def _specs(self, dims: ModelDims, max_seq_len: int, kv_dtype: str) -> tuple[list, list]:
        raise NotImplementedError

    def driver(self, session, dims: ModelDims, max_seq_len: int, kv_dtype: str):
        return self.driver_class(session, Geometry(dims, max_seq_len, kv_dtype))

    def check_session(self, session, dims: ModelDims, max_seq_len: int, kv_dtype: str, role: str,
                      feature_layers=()) -> None:
        """The graph's inputs and outputs must be the ones the manifest describes: names, element types (the KV
        dtype) and static dims (S, heads, head size, the vocabulary of the logits, the features' layers)."""
        specs_in, specs_out = self.io_specs(dims, max_seq_len, kv_dtype, feature_layers)
        graph_in = {i.name: i for i in session.get_inputs()}
        graph_out = {o.name: o for o in session.get_outputs()}
        extra = sorted(set(graph_in) - {spec.name for spec in specs_in})
        problems = [f"the {role} graph has inputs the manifest does not describe: {extra[:3]} (num_layers "
                    f"{dims.num_layers})"] if extra else []
        for kind, specs, graph in (("input", specs_in, graph_in), ("output", specs_out, graph_out)):
            problems += [_mismatch(role, kind, spec, graph.get(spec.name)) for spec in specs]
        problems = [p for p in problems if p]
        if problems:
            raise ManifestError(f"{problems[0]} (vocab_size {dims.vocab_size}, kv_dtype {kv_dtype}, max_seq_len "
                                f"{max_seq_len}, lowering {self.name})",
                                "the manifest does not match its graph (edited or mixed bundles); re-export the bundle")

    def check_quantization(self, method: str, backend: str, standard_onnx: bool) -> None:
        """ModelOpt and a back end that reads standard ONNX only (standard_onnx: TensorRT) stop at contrib ops; raise
        ConfigError where this graph has them."""
        if self.contrib_ops and (standard_onnx or method in MODELOPT_METHODS):
            who = f"the {backend} back end" if standard_onnx else "ModelOpt"
            raise ConfigError(f"{method} for {who} needs the plain lowering; this graph is {self.name} "
                              "(onnxruntime contrib ops)", "export with specdec-export --lowering plain, then quantize that")

    def check_tensorrt(self, role: str) -> None:
        if not self.tensorrt:
            raise EngineBuildError(
                f"{role} carries the {self.name!r} lowering (onnxruntime contrib ops), not TensorRT input",
                "export with --lowering plain (the default when --engine tensorrt is given)",
            )

    def calibration_batch(self, batch: int) -> None:
        """Raise where the graph cannot take a calibration batch of this size."""


class PlainLowering(Lowering):
    name = LoweringName.PLAIN
    tensorrt = True

    def io_names(self, num_layers: int, features: bool = False) -> tuple[list, list]:
        outputs = ["logits", "new_keys", "new_values"] + ([FEATURES] if features else [])
        return ["input_ids", "cache_len", "past_keys", "past_values"], outputs

    def _specs(self, dims: ModelDims, max_seq_len: int, kv_dtype: str) -> tuple[list, list]:
        past = [dims.num_layers, "B", dims.num_kv_heads, max_seq_len, dims.head_dim]
        new = [dims.num_layers, "B", dims.num_kv_heads, "T", dims.head_dim]
        inputs = [TensorSpec("input_ids", "int64", ["B", "T"]), TensorSpec("cache_len", "int64", ["B"]),
                  TensorSpec("past_keys", kv_dtype, past), TensorSpec("past_values", kv_dtype, past)]
        outputs = [TensorSpec("logits", "float32", ["B", "T", dims.vocab_size]),
                   TensorSpec("new_keys", kv_dtype, new), TensorSpec("new_values", kv_dtype, new)]
        return inputs, outputs


class GqaLowering(Lowering):
    name = LoweringName.GQA
    contrib_ops = True
    driver_class = GqaDriver

    def io_names(self, num_layers: int, features: bool = False) -> tuple[list, list]:
        layers = range(num_layers)
        inputs = ["input_ids", "cache_len", "logit_positions"]
        inputs += [f"past_key.{i}" for i in layers] + [f"past_value.{i}" for i in layers]
        outputs = ["logits"] + [f"present_key.{i}" for i in layers] + [f"present_value.{i}" for i in layers]
        return inputs, outputs + ([FEATURES] if features else [])

    def _specs(self, dims: ModelDims, max_seq_len: int, kv_dtype: str) -> tuple[list, list]:
        names_in, names_out = self.io_names(dims.num_layers)  # [B, Hkv, S, D] each
        cache = ["B", dims.num_kv_heads, max_seq_len, dims.head_dim]
        inputs = [TensorSpec("input_ids", "int64", ["B", "T"]), TensorSpec("cache_len", "int64", ["B"]),
                  TensorSpec("logit_positions", "int64", ["N"])] + [TensorSpec(n, kv_dtype, cache) for n in names_in[3:]]
        outputs = [TensorSpec("logits", "float32", ["B", "N", dims.vocab_size])]
        return inputs, outputs + [TensorSpec(n, kv_dtype, cache) for n in names_out[1:]]

    def calibration_batch(self, batch: int) -> None:
        if batch != 1:
            raise ConfigError(f"calibration batch {batch} with the gqa lowering", "use batch 1 for gqa graphs")


LOWERINGS = {lowering.name: lowering for lowering in (PlainLowering(), GqaLowering())}
assert tuple(LOWERINGS) == tuple(LoweringName), "specdec.manifest.LoweringName names the lowerings of this module"


def lowering_for(name: str) -> Lowering:
    """The Lowering called `name` (a manifest's or an option's value)."""
    if name not in LOWERINGS:
        raise ManifestError(f"lowering {name!r} is unknown", f"one of {', '.join(LOWERINGS)}; re-export the bundle")
    return LOWERINGS[name]
