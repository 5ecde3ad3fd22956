"""What hand-written kernels on the target's own 4-bit grid would buy: a whole SmolLM2 target step with the
linear layers as Q4_1 x fp32 and the tied LM head as Q8_0 x fp32 (benchmarks/native/q41.c, AVX2 + FMA, OpenMP),
numpy around them, against the bundle's onnxruntime target (fp32 weights) in the same process.

    python benchmarks/native_step.py bundles/smollm2-q41 --out benchmarks/results/issue11/native

The default model's GGUF stores every linear weight as Q4_1 and the embedding as Q8_0, so the fp32 target's
weights lie exactly on those grids (checked here: the grid error must be 0): the kernels compute the same
function as the fp32 MatMuls, with activations in fp32 and another summation order. Checked against PyTorch
(logits at the last prompt position, greedy tokens) and against the onnxruntime target (logits after the same
prefill). Then T = 1 and T = 5 calls at one cache length, blocks of calls interleaved between the engines, and
the kernels alone. Needs gcc, an AVX2 + FMA CPU and the export extra (torch, transformers). Not a test; it
asserts nothing and writes native.md.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BLOCK4 = np.dtype([("d", "<f4"), ("m", "<f4"), ("qs", "u1", 16)])  # q41.c's blk4
BLOCK8 = np.dtype([("d", "<f4"), ("qs", "i1", 32)])  # q41.c's blk8


def build_kernels(threads: int) -> ctypes.CDLL:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # read when libgomp loads
    lib = Path(tempfile.mkdtemp()) / "libq41.so"
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(HERE / "native" / "q41.c"),
                    "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def q41_blocks(weight: np.ndarray) -> tuple[np.ndarray, float]:
    """weight [N, K] -> (blocks [N, K/32] of BLOCK4, max |w − d·q − m| / d)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // 32, 32)
    low = blocks.min(-1)
    step = (blocks.max(-1) - low) / 15
    step = np.where(step > 0, step, 1).astype(np.float32)
    codes = np.rint((blocks - low[..., None]) / step[..., None])
    error = float((np.abs(codes * step[..., None] + low[..., None] - blocks) / step[..., None]).max())
    out = np.zeros((n, k // 32), BLOCK4)
    out["d"], out["m"] = step, low
    codes = codes.astype(np.uint8)
    out["qs"] = codes[..., :16] | (codes[..., 16:] << 4)
    return out, error


def q8_blocks(weight: np.ndarray) -> tuple[np.ndarray, float]:
    """weight [N, K] -> (blocks [N, K/32] of BLOCK8, max |w − d·q| / d)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // 32, 32)
    step = np.abs(blocks).max(-1) / 127
    step = np.where(step > 0, step, 1).astype(np.float32)
    codes = np.rint(blocks / step[..., None])
    error = float((np.abs(codes * step[..., None] - blocks) / step[..., None]).max())
    out = np.zeros((n, k // 32), BLOCK8)
    out["d"], out["qs"] = step, codes.astype(np.int8)
    return out, error


class NativeTarget:
    """One row of SmolLM2 (LLaMA layout) on the kernels: static KV [L, Hkv, S, D], new K/V written at pos."""

    def __init__(self, lib, state: dict, config, max_seq_len: int):
        self.lib, self.config = lib, config
        self.layers, self.errors = [], []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append({
                "n1": state[p + "input_layernorm.weight"], "n2": state[p + "post_attention_layernorm.weight"],
                "qkv": self._q41(np.concatenate([state[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])),
                "o": self._q41(state[p + "self_attn.o_proj.weight"]),
                "gu": self._q41(np.concatenate([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])),
                "down": self._q41(state[p + "mlp.down_proj.weight"])})
        self.embedding = state["model.embed_tokens.weight"]
        self.head, error = q8_blocks(self.embedding)
        self.errors.append(error)
        self.final_norm = state["model.norm.weight"]
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        theta = (config.rope_scaling or {}).get("rope_theta") or config.rope_theta
        self.inv_freq = (1.0 / theta ** (np.arange(0, self.head_dim, 2, dtype=np.float32) / self.head_dim)).astype(np.float32)
        shape = (config.num_hidden_layers, self.kv_heads, max_seq_len, self.head_dim)
        self.keys, self.values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    def _q41(self, weight):
        blocks, error = q41_blocks(weight)
        self.errors.append(error)
        return blocks

    def matmul(self, x: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        # x: [M, K] float32 -> [M, N]
        x = np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty((x.shape[0], blocks.shape[0]), np.float32)
        kernel = self.lib.q41_gemm if blocks.dtype == BLOCK4 else self.lib.q8_gemm
        kernel(x.ctypes.data_as(ctypes.c_void_p), x.shape[0], x.shape[1], blocks.ctypes.data_as(ctypes.c_void_p),
               y.ctypes.data_as(ctypes.c_void_p), blocks.shape[0])
        return y

    def norm(self, x, weight):  # x: [T, H]
        return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.rms_norm_eps)) * weight

    def rope(self, x, cos, sin):  # x: [T, heads, D]; cos, sin: [T, 1, D/2]
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def forward(self, tokens: list, pos: int) -> np.ndarray:
        """tokens at positions pos.. -> logits [T, V]."""
        t, h, kv, d = len(tokens), self.heads, self.kv_heads, self.head_dim
        positions = np.arange(pos, pos + t)
        end = pos + t
        freqs = positions[:, None].astype(np.float32) * self.inv_freq  # [T, D/2]
        cos, sin = np.cos(freqs)[:, None], np.sin(freqs)[:, None]
        mask = np.where(np.arange(end)[None, :] <= positions[:, None], 0.0, -np.inf).astype(np.float32)  # [T, end]
        x = self.embedding[tokens].astype(np.float32)  # [T, H]
        for layer, w in enumerate(self.layers):
            qkv = self.matmul(self.norm(x, w["n1"]), w["qkv"])
            q = self.rope(qkv[:, : h * d].reshape(t, h, d), cos, sin)
            self.keys[layer, :, pos:end] = self.rope(qkv[:, h * d : (h + kv) * d].reshape(t, kv, d), cos, sin).transpose(1, 0, 2)
            self.values[layer, :, pos:end] = qkv[:, (h + kv) * d :].reshape(t, kv, d).transpose(1, 0, 2)
            q = q.reshape(t, kv, h // kv, d).transpose(1, 2, 0, 3)  # [Hkv, group, T, D]
            scores = q @ self.keys[layer, :, None, :end].transpose(0, 1, 3, 2) * (1.0 / d ** 0.5) + mask  # [Hkv, g, T, end]
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            attended = (scores @ self.values[layer, :, None, :end]).transpose(2, 0, 1, 3).reshape(t, h * d)
            x = x + self.matmul(attended, w["o"])
            gate, up = np.split(self.matmul(self.norm(x, w["n2"]), w["gu"]), 2, axis=-1)
            x = x + self.matmul(gate / (1 + np.exp(-gate)) * up, w["down"])
        return self.matmul(self.norm(x, self.final_norm), self.head)

    def kernels_only(self, rows: int) -> None:
        """The step's 121 kernel calls on constant inputs, nothing around them."""
        x = {k: np.ones((rows, k), np.float32) for k in (self.config.hidden_size, self.config.intermediate_size)}
        for w in self.layers:
            for name in ("qkv", "o", "gu", "down"):
                self.matmul(x[w[name].shape[1] * 32], w[name])
        self.matmul(x[576], self.head)


PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def check_parity(native: NativeTarget, model, tokenizer, ort_target, new_tokens: int) -> list:
    """-> report lines: logits against PyTorch and onnxruntime after the same prompt, greedy tokens against torch."""
    import torch

    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0, -1].numpy()
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):]
    ours = native.forward(prompt, 0)[-1]
    ort_target.reset(1)
    theirs = ort_target.forward(np.array([prompt], np.int64), np.array([0], np.int64))[0, -1]
    tokens, pos = [int(ours.argmax())], len(prompt)
    while len(tokens) < new_tokens:
        tokens.append(int(native.forward([tokens[-1]], pos)[-1].argmax()))
        pos += 1
    same = sum(a == b for a, b in zip(tokens, generated.tolist()))
    scale = float(np.abs(reference).max())
    return [f"- prompt of {len(prompt)} tokens (chat template): max |logit difference| at its last position, "
            f"native − PyTorch {np.abs(ours - reference).max():.2e}, onnxruntime target − PyTorch "
            f"{np.abs(theirs - reference).max():.2e}, native − onnxruntime {np.abs(ours - theirs).max():.2e} "
            f"(max |logit| {scale:.1f})",
            f"- greedy continuation, {new_tokens} tokens: {same} identical to PyTorch `generate` "
            f"({'all' if same == new_tokens else 'not all'})"]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def measure(native: NativeTarget, ort_models: dict, cache_len: int, repeats: int, block: int) -> dict:
    cases = {("native kernels + numpy", "target", 1): lambda: native.forward([5], cache_len),
             ("native kernels + numpy", "target", 5): lambda: native.forward([5] * 5, cache_len),
             ("native kernels alone", "target", 1): lambda: native.kernels_only(1),
             ("native kernels alone", "target", 5): lambda: native.kernels_only(5)}
    for role, backend in ort_models.items():
        backend.reset(1)
        for steps in (1, 5) if role == "target" else (1,):
            ids = np.full((1, steps), 5, np.int64)
            cases[("onnxruntime", role, steps)] = lambda b=backend, i=ids: b.forward(i, np.array([cache_len], np.int64))
    samples = {key: [] for key in cases}
    for call in cases.values():
        call()  # warm-up
    for _ in range(repeats):
        for key, call in cases.items():
            samples[key] += [timed(call) for _ in range(block)]
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", type=Path, help="a bundle exported from the default model (make demo's)")
    parser.add_argument("--cache-len", type=int, default=300, help="cache length of the timed calls")
    parser.add_argument("--repeats", type=int, default=8, help="rounds over the engines")
    parser.add_argument("--block", type=int, default=4, help="calls per engine in a round")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens compared with PyTorch")
    parser.add_argument("--out", type=Path, default=None, help="folder for native.md (default: print only)")
    args = parser.parse_args()
    import torch

    from specdec.export.sources import default_source, load_model, load_tokenizer
    from specdec.manifest import read_manifest
    from specdec.runtime.backend import cpu_count
    from specdec.runtime.ort_backend import OrtBackend

    manifest = read_manifest(args.bundle)
    source = default_source()
    if manifest.target.source.sha256 != source.describe().sha256:
        raise SystemExit(f"{args.bundle} was not exported from the default model ({source.name}); "
                         "Hint: run it on make demo's bundle")
    threads = cpu_count()
    lib = build_kernels(threads)
    model = load_model(source, torch.float32)
    tokenizer = load_tokenizer(source)
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    native = NativeTarget(lib, state, model.config, manifest.target.max_seq_len)
    if max(native.errors) > 0:
        raise SystemExit(f"the weights are not on the Q4_1 / Q8_0 grids (max error {max(native.errors)} steps)")
    ort_models = {role: OrtBackend(args.bundle, manifest.models[role], threads).open() for role in ("target", "draft")}
    lines = check_parity(native, model, tokenizer, ort_models["target"], args.new_tokens)
    samples = measure(native, ort_models, args.cache_len, args.repeats, args.block)
    lines += ["", f"T = 1 and T = 5 calls at cache length {args.cache_len}, {args.repeats} rounds of {args.block} calls "
              f"per engine, interleaved; {threads} threads everywhere (OpenMP in the kernels, onnxruntime's "
              "intra-op pool as specdec sets it).", "",
              "| engine | model | T | min ms | median ms |", "|---|---|---|---|---|"]
    for (engine, role, steps), values in samples.items():
        lines.append(f"| {engine} | {role} | {steps} | {min(values):.1f} | {statistics.median(values):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python benchmarks/native_step.py", str(args.bundle), "--cache-len", str(args.cache_len)])
        (args.out / "native.md").write_text(f"# Native Q4_1 kernels against onnxruntime\n\n`{command}`\n\n{text}")


if __name__ == "__main__":
    main()
