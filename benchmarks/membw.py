"""Plain decoding against the memory-bandwidth floor: bytes one decode step reads / read bandwidth of this machine.

    python benchmarks/membw.py BUNDLE [--gib 1.0] [--repeats 5] [--out benchmarks/results/membw.md]

Read bandwidth two ways, each the best of `repeats`: (a) numpy XOR-reductions of a buffer far larger than the
caches, viewed as uint64 (one cheap op per 8 bytes: the loop waits on memory), split over one thread per core (numpy
drops the GIL in the reduction); (b) onnxruntime's own fp32 GEMV (MatMul
[1, K] x [K, N] with a constant weight of the same size; the runtime's session options), the kernel that reads a
plain-decoding step's weights. Bytes a step reads: every initializer the step's kernels touch (all weights except
an embedding table, of which one row is read), plus the valid KV (K and V of every layer at the given cache length).
The floor is bytes / bandwidth. Prints markdown; no assertions (not a test).
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import numpy as np


def numpy_read_gbs(gib: float, repeats: int) -> float:
    """Best aggregate read bandwidth (GB/s) of one XOR-reducing thread per core over one large uint64 buffer."""
    cores = len(os.sched_getaffinity(0))
    data = np.ones(int(gib * 2**30) // 8, dtype=np.uint64)
    parts = np.array_split(data, cores)
    best = 0.0
    for _ in range(repeats):
        threads = [threading.Thread(target=np.bitwise_xor.reduce, args=(part,)) for part in parts]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        best = max(best, data.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def gemv_read_gbs(gib: float, repeats: int) -> float:
    """Best bandwidth (GB/s) of onnxruntime's fp32 MatMul at M = 1 over a constant [K, N] weight of `gib`."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from specdec.runtime.backend import session_options

    k = 1024
    n = int(gib * 2**30) // 4 // k
    weight = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    x = np.ones((1, k), np.float32)
    session.run(None, {"x": x})
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        session.run(None, {"x": x})
        best = max(best, weight.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def step_bytes(bundle: Path, role: str, cache_len: int) -> tuple[int, int]:
    """(weight bytes a T = 1 step reads, KV bytes at `cache_len`) of a bundle model."""
    import onnx

    from specdec.manifest import read_manifest

    entry = read_manifest(bundle).models[role]
    model = onnx.load(str(bundle / entry.onnx_path), load_external_data=False)
    sizes = {init.name: int(np.prod(init.dims)) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
             for init in model.graph.initializer}
    # a Gather reads one row per token: its table counts only where another kernel reads it whole (a tied head)
    read = {name for node in model.graph.node if node.op_type != "Gather" for name in node.input if name in sizes}
    weights = sum(sizes[name] for name in read)
    dims = entry.dims
    kv = 2 * dims.num_layers * dims.num_kv_heads * cache_len * dims.head_dim * 4
    return weights, kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--role", default="target")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-len", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=None, help="measured plain TPOT to set against the floor")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    numpy_gbs, gemv_gbs = numpy_read_gbs(args.gib, args.repeats), gemv_read_gbs(args.gib, args.repeats)
    weights, kv = step_bytes(args.bundle, args.role, args.cache_len)
    total = weights + kv
    lines = [f"Memory-bandwidth floor of one decode step ({args.bundle.name}/{args.role}, cache length {args.cache_len}; "
             f"{len(os.sched_getaffinity(0))} CPUs)", "",
             "| quantity | value |", "|---|---|",
             f"| weight bytes read per step | {weights / 1e6:.1f} MB |", f"| KV bytes read per step | {kv / 1e6:.1f} MB |",
             f"| read bandwidth, numpy XOR-reduce, one thread per core | {numpy_gbs:.1f} GB/s |",
             f"| read bandwidth, onnxruntime fp32 GEMV | {gemv_gbs:.1f} GB/s |",
             f"| floor at numpy bandwidth | {total / numpy_gbs / 1e6:.1f} ms |",
             f"| floor at GEMV bandwidth | {total / gemv_gbs / 1e6:.1f} ms |"]
    if args.step_ms:
        lines.append(f"| measured step | {args.step_ms:.1f} ms ({total / args.step_ms / 1e6:.1f} GB/s effective; "
                     f"{total / max(numpy_gbs, gemv_gbs) / 1e6 / args.step_ms:.0%} of the best bandwidth) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
