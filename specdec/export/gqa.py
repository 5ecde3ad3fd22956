"""The onnxruntime lowering: attention as com.microsoft GroupQueryAttention over a shared, in-place KV buffer.

Same model, same contract semantics as the plain graph (positions cache_len + arange(T), slot s < cache_len
visible, causal among new tokens), but:
  inputs   input_ids [B, T], cache_len [B], logit_positions [N] (which of the T positions get logits),
           past_key.i / past_value.i [B, Hkv, S, D] for every layer i
  outputs  logits [B, N, V], present_key.i / present_value.i [B, Hkv, S, D]
Bind past and present to the same buffer (IO binding) and GroupQueryAttention writes the new K/V in place and
reads only the valid length; where the rotary embedding covers the whole head, GroupQueryAttention applies it
too (from cos/sin caches), and RMSNorm becomes SimplifiedLayerNormalization. onnxruntime's CPU kernel needs
B = 1 when T > 1 with a past, so the runtime runs rows one at a time.
Where the family allows, each layer is few, large kernels (fewer thread-pool hand-offs per step on a CPU): q, k
and v as one MatMul whose packed output GroupQueryAttention takes whole; gate and up as one MatMul and a Split;
every residual Add fused into the next norm (SkipSimplifiedLayerNormalization, whose fourth output is the sum).
"""
from __future__ import annotations

import torch

from specdec.export.architectures import GeluApproximation
from specdec.export.static_model import StaticKVDecoder

STAGING_DOMAIN = "specdec.lowering"  # onnxscript has no schema for contrib ops: emit here, then rename
TARGET_DOMAINS = {"GroupQueryAttention": "com.microsoft", "SimplifiedLayerNormalization": "",
                  "SkipSimplifiedLayerNormalization": "com.microsoft", "FastGelu": "com.microsoft",
                  "Gelu": "com.microsoft"}


def _rotate(x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, start: int) -> torch.Tensor:
    # x: [T, N, D] at positions start.. ; caches: [S, D/2] (non-interleaved halves)
    steps, half = x.shape[0], x.shape[-1] // 2
    cos = cos_cache[start : start + steps, None].repeat(1, 1, 2)  # [T, 1, D]
    sin = sin_cache[start : start + steps, None].repeat(1, 1, 2)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attend_row(q, k, v, past_k, past_v, start, num_heads, kv_num_heads, scale, window):
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; past_*: [Hkv, S, D] (written in place) -> [T, Hq*D]; window: keys a query
    # sees, itself included (0: every earlier key)
    steps = q.shape[0]
    past_k[:, start : start + steps] = k.transpose(0, 1)
    past_v[:, start : start + steps] = v.transpose(0, 1)
    keys = past_k[:, : start + steps].repeat_interleave(num_heads // kv_num_heads, 0)  # [Hq, L, D]
    values = past_v[:, : start + steps].repeat_interleave(num_heads // kv_num_heads, 0)
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * scale  # [Hq, T, L]
    distance = (start + torch.arange(steps))[:, None] - torch.arange(start + steps)[None, :]  # query - key position
    causal = (distance >= 0) & (distance < window) if window > 0 else distance >= 0
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs @ values).transpose(0, 1).reshape(steps, -1)


@torch.library.custom_op("specdec::gqa", mutates_args=())
def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        seqlens_k: torch.Tensor, total_len: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
        num_heads: int, kv_num_heads: int, scale: float, do_rotary: int, window: int = 0
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager reference of GroupQueryAttention: BSH q/k/v, BNSH caches of length S, row b writing at
    seqlens_k[b] + 1 - T; with do_rotary, q and k are rotated at their positions first; with a window, a query sees
    the `window` keys up to its own."""
    batch, steps, _ = q.shape
    head_dim = past_k.shape[-1]
    present_k, present_v = past_k.clone(), past_v.clone()
    out = torch.empty_like(q)
    for row in range(batch):
        start = int(seqlens_k[row]) + 1 - steps
        query = q[row].view(steps, num_heads, head_dim)
        key = k[row].view(steps, kv_num_heads, head_dim)
        if do_rotary:
            query, key = (_rotate(t, cos_cache, sin_cache, start) for t in (query, key))
        value = v[row].view(steps, kv_num_heads, head_dim)
        out[row] = _attend_row(query, key, value, present_k[row], present_v[row], start, num_heads, kv_num_heads, scale,
                               window)
    return out, present_k, present_v


@gqa.register_fake
def _gqa_fake(q, k, v, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache, num_heads, kv_num_heads, scale,
              do_rotary, window=0):
    return torch.empty_like(q), torch.empty_like(past_k), torch.empty_like(past_v)


@torch.library.custom_op("specdec::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Eager reference of SimplifiedLayerNormalization (RMSNorm over the last axis, computed in float32)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("specdec::gelu", mutates_args=())
def gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """Eager reference of onnxruntime's FastGelu (approximate "tanh") and Gelu ("none": the exact erf form)."""
    return torch.nn.functional.gelu(x, approximate=approximate)


@gelu.register_fake
def _gelu_fake(x, approximate):
    return torch.empty_like(x)


@torch.library.custom_op("specdec::gqa_packed", mutates_args=())
def gqa_packed(qkv: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, seqlens_k: torch.Tensor,
               total_len: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, num_heads: int,
               kv_num_heads: int, scale: float, do_rotary: int, window: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupQueryAttention with q, k and v packed in one input: qkv [B, T, (Hq + 2 Hkv) D] -> out [B, T, Hq D]."""
    head_dim = past_k.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, kv_num_heads * head_dim, kv_num_heads * head_dim], dim=-1)
    return gqa(q.contiguous(), k.contiguous(), v.contiguous(), past_k, past_v, seqlens_k, total_len, cos_cache,
               sin_cache, num_heads, kv_num_heads, scale, do_rotary, window)


@gqa_packed.register_fake
def _gqa_packed_fake(qkv, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache, num_heads, kv_num_heads, scale,
                     do_rotary, window=0):
    out = qkv.new_empty(*qkv.shape[:-1], num_heads * past_k.shape[-1])
    return out, torch.empty_like(past_k), torch.empty_like(past_v)


@torch.library.custom_op("specdec::skip_rms_norm", mutates_args=())
def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager reference of SkipSimplifiedLayerNormalization: (RMSNorm(x + skip) * weight, x + skip)."""
    total = x + skip
    return rms_norm(total, weight, eps), total


@skip_rms_norm.register_fake
def _skip_rms_norm_fake(x, skip, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _register_staging_schemas() -> None:
    """Give onnxscript schemas for the staged ops (onnx ships none for onnxruntime's contrib ops)."""
    import onnx

    schema, param = onnx.defs.OpSchema, onnx.defs.OpSchema.FormalParameter
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    attr, kinds = onnx.defs.OpSchema.Attribute, onnx.defs.OpSchema.AttrType
    floats = ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")
    if not onnx.defs.has("GroupQueryAttention", STAGING_DOMAIN):
        # GroupQueryAttention's inputs: (name, its type: T float / M int32, optional)
        inputs = (("q", "T", False), ("k", "T", True), ("v", "T", True), ("past_k", "T", False),
                  ("past_v", "T", False), ("seqlens_k", "M", False), ("total_len", "M", False),
                  ("cos_cache", "T", True), ("sin_cache", "T", True))
        onnx.defs.register_schema(schema(
            "GroupQueryAttention", STAGING_DOMAIN, 1,
            inputs=[param(n, kind, param_option=optional if either else single) for n, kind, either in inputs],
            outputs=[param(n, "T") for n in ("out", "present_k", "present_v")],
            type_constraints=[floats, ("M", ["tensor(int32)"], "")],
            attributes=[attr(n, kinds.INT, "") for n in ("num_heads", "kv_num_heads", "do_rotary", "local_window_size")]
            + [attr("scale", kinds.FLOAT, "")],
        ))
    if not onnx.defs.has("SimplifiedLayerNormalization", STAGING_DOMAIN):
        onnx.defs.register_schema(schema(
            "SimplifiedLayerNormalization", STAGING_DOMAIN, 1, inputs=[param("x", "T"), param("w", "T")],
            outputs=[param("y", "T")], type_constraints=[floats],
            attributes=[attr("axis", kinds.INT, ""), attr("epsilon", kinds.FLOAT, "")],
        ))
    if not onnx.defs.has("SkipSimplifiedLayerNormalization", STAGING_DOMAIN):
        onnx.defs.register_schema(schema(
            "SkipSimplifiedLayerNormalization", STAGING_DOMAIN, 1,
            inputs=[param("x", "T"), param("skip", "T"), param("gamma", "T")],
            outputs=[param("y", "T"), param("mean", "U", param_option=optional),
                     param("inv_std_var", "U", param_option=optional), param("sum", "T", param_option=optional)],
            type_constraints=[floats, ("U", ["tensor(float)"], "")], attributes=[attr("epsilon", kinds.FLOAT, "")],
        ))
    for name in ("FastGelu", "Gelu"):
        if not onnx.defs.has(name, STAGING_DOMAIN):
            onnx.defs.register_schema(schema(name, STAGING_DOMAIN, 1, inputs=[param("x", "T")],
                                             outputs=[param("y", "T")], type_constraints=[floats]))


def gqa_translation():
    """torch.onnx custom translations: specdec::gqa -> GroupQueryAttention, specdec::rms_norm -> SLN."""
    import onnxscript

    _register_staging_schemas()
    staged = onnxscript.values.Opset(STAGING_DOMAIN, 1)

    def lower_gqa(q, k, v, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache, num_heads: int,
                  kv_num_heads: int, scale: float, do_rotary: int, window: int = 0):
        caches = (cos_cache, sin_cache) if do_rotary else (None, None)
        return staged.GroupQueryAttention(
            q, k, v, past_k, past_v, seqlens_k, total_len, *caches,
            num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, do_rotary=do_rotary,
            local_window_size=window if window > 0 else -1,  # keys a query sees, its own included (as onnxruntime's
            # CPU kernel counts them: tests/native/test_families.py checks it against the plain lowering's mask)
        )

    def lower_gqa_packed(qkv, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache, num_heads: int,
                         kv_num_heads: int, scale: float, do_rotary: int, window: int = 0):
        caches = (cos_cache, sin_cache) if do_rotary else (None, None)
        return staged.GroupQueryAttention(
            qkv, None, None, past_k, past_v, seqlens_k, total_len, *caches,
            num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, do_rotary=do_rotary,
            local_window_size=window if window > 0 else -1,
        )

    def lower_rms_norm(x, weight, eps: float):
        return staged.SimplifiedLayerNormalization(x, weight, axis=-1, epsilon=eps)

    def lower_skip_rms_norm(x, skip, weight, eps: float):
        normed, _, _, total = staged.SkipSimplifiedLayerNormalization(x, skip, weight, epsilon=eps, _num_outputs=4)
        return normed, total

    def lower_gelu(x, approximate: str):
        return staged.FastGelu(x) if approximate == GeluApproximation.TANH else staged.Gelu(x)

    ops = torch.ops.specdec
    return {ops.gqa.default: lower_gqa, ops.gqa_packed.default: lower_gqa_packed, ops.rms_norm.default: lower_rms_norm,
            ops.skip_rms_norm.default: lower_skip_rms_norm, ops.gelu.default: lower_gelu}


def move_to_target_domains(model) -> None:
    """Move the staged nodes of an onnx_ir model to their onnxruntime domains (done before saving)."""
    for node in model.graph.all_nodes():
        if node.domain == STAGING_DOMAIN:
            node.domain = TARGET_DOMAINS[node.op_type]
    model.opset_imports.pop(STAGING_DOMAIN, None)
    model.opset_imports["com.microsoft"] = 1


class GqaDecoder(StaticKVDecoder):
    """The decoder with GroupQueryAttention, fused norms, packed projections and per-layer, shared-buffer KV
    inputs/outputs."""

    def __init__(self, arch, max_seq_len: int, feature_layers: tuple = ()):
        super().__init__(arch, max_seq_len, feature_layers)
        self.fused_rotary = False
        positions = torch.arange(max_seq_len)[None]
        rotary = arch.rotary(torch.zeros(1, max_seq_len, arch.dims.hidden_size), positions)
        self.rotary_free = rotary is None  # learned positions (GPT-2): q, k and v pack with nothing to rotate
        # onnxruntime's fused rotary needs the whole head rotated and a head size that is a multiple of 16
        if rotary is not None and rotary[0].shape[-1] == arch.dims.head_dim and arch.dims.head_dim % 16 == 0:
            half = arch.dims.head_dim // 2
            self.register_buffer("cos_cache", rotary[0][0, :, :half].contiguous(), persistent=False)  # [S, D/2]
            self.register_buffer("sin_cache", rotary[1][0, :, :half].contiguous(), persistent=False)
            self.fused_rotary = True
        else:
            self.register_buffer("cos_cache", torch.zeros(1, 1), persistent=False)
            self.register_buffer("sin_cache", torch.zeros(1, 1), persistent=False)
        self.fused_norms = arch.rms_eps() is not None
        window = arch.sliding_window()  # one as long as S never masks a key: none in the graph
        self.window = window if window is not None and window < max_seq_len else 0
        self.packed = [self._pack(index, layer) for index, layer in enumerate(arch.layers())]

    def _pack(self, index: int, layer) -> dict:
        """Register layer `index`'s packed weights as buffers; -> which of them it has."""
        # unfused rotary needs q, k apart
        qkv = self.arch.packed_qkv(layer) if self.fused_rotary or self.rotary_free else None
        if qkv is not None:
            self.register_buffer(f"qkv_weight_{index}", qkv[0], persistent=False)
            self.register_buffer(f"qkv_bias_{index}", qkv[1], persistent=False)
        gate_up = self.arch.packed_gate_up(layer)
        if gate_up is not None:
            self.register_buffer(f"gate_up_weight_{index}", gate_up[0], persistent=False)
        return {"qkv": qkv is not None, "gate_up": gate_up[1:] if gate_up is not None else None}

    def norm(self, module, x):
        eps = self.arch.rms_eps()
        return module(x) if eps is None else torch.ops.specdec.rms_norm(x, module.weight, float(eps))

    def add_norm(self, x, residual, module):
        # x, residual: [B, T, H] -> (norm(x + residual), x + residual): one SkipSimplifiedLayerNormalization
        if not self.fused_norms:
            total = residual + x
            return self.norm(module, total), total
        return torch.ops.specdec.skip_rms_norm(x, residual, module.weight, float(self.arch.rms_eps()))

    def attention_gqa(self, index, layer, x, cos, sin, past_k, past_v, seqlens_k, total_len):
        # x: [B, T, H]; past_*: [B, Hkv, S, D] -> attention output [B, T, H], present_k, present_v
        dims = self.arch.dims
        batch, steps, _ = x.shape
        args = (past_k, past_v, seqlens_k, total_len, self.cos_cache, self.sin_cache, dims.num_heads,
                dims.num_kv_heads, self.arch.attn_scale(), int(self.fused_rotary), self.window)
        if self.packed[index]["qkv"]:  # qkv: [B, T, (Hq + 2 Hkv) D], rotated inside the attention op
            weight, bias = getattr(self, f"qkv_weight_{index}"), getattr(self, f"qkv_bias_{index}")
            qkv = torch.nn.functional.linear(x, weight, bias)
            norms = self.arch.qk_norms(layer)
            if norms is not None:
                qkv = self._norm_heads(qkv, norms)
            out, present_k, present_v = torch.ops.specdec.gqa_packed(qkv, *args)
            return self.arch.out_proj(layer, out), present_k, present_v
        rotate_here = not self.fused_rotary
        q, k, v = self.project(layer, x, cos if rotate_here else None, sin if rotate_here else None)
        flat = lambda t: t.transpose(1, 2).reshape(batch, steps, -1)  # noqa: E731  [B, N, T, D] -> [B, T, N*D]
        out, present_k, present_v = torch.ops.specdec.gqa(flat(q), flat(k), flat(v), *args)
        return self.arch.out_proj(layer, out), present_k, present_v

    def _norm_heads(self, qkv, norms):
        # qkv: [B, T, (Hq + 2 Hkv) D] -> the same with each head of q and k RMS-normalized over D (Qwen3): a Split,
        # per part a Reshape, a SimplifiedLayerNormalization and a Reshape back, and a Concat
        dims = self.arch.dims
        batch, steps, _ = qkv.shape
        sizes = [dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim]
        q, k, v = qkv.split(sizes, dim=-1)
        normed = [torch.ops.specdec.rms_norm(part.reshape(batch, steps, -1, dims.head_dim), norm.weight,
                                             float(norm.variance_epsilon)).reshape(batch, steps, -1)
                  for part, norm in ((q, norms[0]), (k, norms[1]))]
        return torch.cat([*normed, v], dim=-1)

    def mlp_packed(self, index, layer, x):
        # x: [B, T, H] -> [B, T, H]; gate and up as one MatMul where the family allows, GELU as one op
        if self.packed[index]["gate_up"] is None:
            gelu = self.arch.gelu_mlp(layer)
            if gelu is None:
                return self.arch.mlp(layer, x)
            up, approximate, down = gelu
            return down(torch.ops.specdec.gelu(up(x), approximate))
        act, down = self.packed[index]["gate_up"]
        gate, up = torch.nn.functional.linear(x, getattr(self, f"gate_up_weight_{index}")).chunk(2, dim=-1)
        return down(act(gate) * up)

    def forward(self, input_ids, cache_len, logit_positions, past_keys: list, past_values: list):
        # input_ids: [B, T]; cache_len: [B]; logit_positions: [N]; past_*: L x [B, Hkv, S, D]
        steps = input_ids.shape[1]
        hidden, _, (cos, sin) = self.embed(input_ids, cache_len)
        seqlens_k = (cache_len + steps - 1).to(torch.int32)  # [B]: last valid index after this step
        total_len = (cache_len.max() + steps).to(torch.int32)  # scalar
        layers = list(self.arch.layers())
        normed = self.norm(self.arch.attn_norm(layers[0]), hidden)
        presents_k, presents_v, outputs = [], [], []
        for index, layer in enumerate(layers):
            attn_out, present_k, present_v = self.attention_gqa(
                index, layer, normed, cos, sin, past_keys[index], past_values[index], seqlens_k, total_len)
            normed, hidden = self.add_norm(attn_out, hidden, self.arch.mlp_norm(layer))
            mlp_out = self.mlp_packed(index, layer, normed)
            last = index + 1 == len(layers)
            normed, hidden = self.add_norm(mlp_out, hidden,
                                           self.arch.final_norm() if last else self.arch.attn_norm(layers[index + 1]))
            presents_k.append(present_k)
            presents_v.append(present_v)
            outputs.append(hidden)
        logits = self.lm_logits(torch.index_select(normed, 1, logit_positions))  # [B, N, V]
        return (logits, *presents_k, *presents_v, *self.features(outputs))
