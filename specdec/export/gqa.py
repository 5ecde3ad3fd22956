"""The onnxruntime lowering: attention as com.microsoft GroupQueryAttention over a shared, in-place KV buffer.

Same model, same contract semantics as the plain graph (positions cache_len + arange(T), slot s < cache_len
visible, causal among new tokens), but:
  inputs   input_ids [B, T], cache_len [B], logit_positions [N] (which of the T positions get logits),
           past_key.i / past_value.i [B, Hkv, S, D] for every layer i
  outputs  logits [B, N, V], present_key.i / present_value.i [B, Hkv, S, D]
Bind past and present to the same buffer (IO binding) and GroupQueryAttention writes the new K/V in place and
reads only the valid length. onnxruntime's CPU kernel needs B = 1 when T > 1 with a past, so the runtime runs
rows one at a time.
"""
from __future__ import annotations

import torch

from specdec.export.static_model import StaticKVDecoder

MS_DOMAIN = "com.microsoft"
STAGING_DOMAIN = "specdec.lowering"  # onnxscript has no schema for contrib ops: emit here, then rename


@torch.library.custom_op("specdec::gqa", mutates_args=())
def gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
        seqlens_k: torch.Tensor, total_len: torch.Tensor, num_heads: int, kv_num_heads: int,
        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager reference of GroupQueryAttention (BSH q/k/v, BNSH caches of length S, rows write at cache_len)."""
    batch, steps, _ = q.shape
    head_dim = past_k.shape[-1]
    present_k, present_v = past_k.clone(), past_v.clone()
    out = torch.empty_like(q)
    for row in range(batch):
        start = int(seqlens_k[row]) + 1 - steps
        present_k[row, :, start : start + steps] = k[row].view(steps, kv_num_heads, head_dim).transpose(0, 1)
        present_v[row, :, start : start + steps] = v[row].view(steps, kv_num_heads, head_dim).transpose(0, 1)
        keys = present_k[row, :, : start + steps].repeat_interleave(num_heads // kv_num_heads, 0)  # [Hq, L, D]
        values = present_v[row, :, : start + steps].repeat_interleave(num_heads // kv_num_heads, 0)
        query = q[row].view(steps, num_heads, head_dim).transpose(0, 1)  # [Hq, T, D]
        scores = query @ keys.transpose(1, 2) * scale  # [Hq, T, L]
        causal = torch.arange(start + steps)[None, :] <= (start + torch.arange(steps))[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[row] = (probs @ values).transpose(0, 1).reshape(steps, -1)
    return out, present_k, present_v


@gqa.register_fake
def _gqa_fake(q, k, v, past_k, past_v, seqlens_k, total_len, num_heads, kv_num_heads, scale):
    return torch.empty_like(q), torch.empty_like(past_k), torch.empty_like(past_v)


def _register_staging_schema() -> None:
    """Give onnxscript a schema for the staged GroupQueryAttention (onnx ships none for contrib ops)."""
    import onnx

    if onnx.defs.has("GroupQueryAttention", STAGING_DOMAIN):
        return
    param = onnx.defs.OpSchema.FormalParameter
    attr = onnx.defs.OpSchema.Attribute
    kinds = onnx.defs.OpSchema.AttrType
    schema = onnx.defs.OpSchema(
        "GroupQueryAttention", STAGING_DOMAIN, 1,
        inputs=[param(n, "T" if n not in ("seqlens_k", "total_len") else "M")
                for n in ("q", "k", "v", "past_k", "past_v", "seqlens_k", "total_len")],
        outputs=[param(n, "T") for n in ("out", "present_k", "present_v")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("M", ["tensor(int32)"], "")],
        attributes=[attr("num_heads", kinds.INT, ""), attr("kv_num_heads", kinds.INT, ""),
                    attr("scale", kinds.FLOAT, "")],
    )
    onnx.defs.register_schema(schema)


def gqa_translation():
    """torch.onnx custom translation: specdec::gqa -> com.microsoft GroupQueryAttention."""
    import onnxscript

    _register_staging_schema()
    msft = onnxscript.values.Opset(STAGING_DOMAIN, 1)

    def lower(q, k, v, past_k, past_v, seqlens_k, total_len, num_heads: int, kv_num_heads: int, scale: float):
        return msft.GroupQueryAttention(
            q, k, v, past_k, past_v, seqlens_k, total_len, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale
        )

    return {torch.ops.specdec.gqa.default: lower}


def move_to_ms_domain(model) -> None:
    """Rename the staged nodes of an onnx_ir model to com.microsoft (done before saving)."""
    for node in model.graph.all_nodes():
        if node.domain == STAGING_DOMAIN:
            node.domain = MS_DOMAIN
    model.opset_imports.pop(STAGING_DOMAIN, None)
    model.opset_imports[MS_DOMAIN] = 1


class GqaDecoder(StaticKVDecoder):
    """The decoder with GroupQueryAttention and per-layer, shared-buffer KV inputs/outputs."""

    def attention_gqa(self, layer, x, cos, sin, past_k, past_v, seqlens_k, total_len):
        # x: [B, T, H]; past_*: [B, Hkv, S, D] -> attention output [B, T, H], present_k, present_v
        dims = self.arch.dims
        batch, steps, _ = x.shape
        q, k, v = self.project(layer, x, cos, sin)  # rotary applied here, as in the plain graph
        flat = lambda t: t.transpose(1, 2).reshape(batch, steps, -1)  # noqa: E731  [B, N, T, D] -> [B, T, N*D]
        out, present_k, present_v = torch.ops.specdec.gqa(
            flat(q), flat(k), flat(v), past_k, past_v, seqlens_k, total_len,
            dims.num_heads, dims.num_kv_heads, self.arch.attn_scale(),
        )
        return self.arch.out_proj(layer, out), present_k, present_v

    def forward(self, input_ids, cache_len, logit_positions, past_keys: list, past_values: list):
        # input_ids: [B, T]; cache_len: [B]; logit_positions: [N]; past_*: L x [B, Hkv, S, D]
        steps = input_ids.shape[1]
        hidden, _, (cos, sin) = self.embed(input_ids, cache_len)
        seqlens_k = (cache_len + steps - 1).to(torch.int32)  # [B]: last valid index after this step
        total_len = (cache_len.max() + steps).to(torch.int32)  # scalar
        presents_k, presents_v = [], []
        for index, layer in enumerate(self.arch.layers()):
            attn_out, present_k, present_v = self.attention_gqa(
                layer, self.arch.attn_norm(layer, hidden), cos, sin, past_keys[index], past_values[index],
                seqlens_k, total_len,
            )
            hidden = hidden + attn_out
            hidden = hidden + self.arch.mlp(layer, self.arch.mlp_norm(layer, hidden))
            presents_k.append(present_k)
            presents_v.append(present_v)
        logits = self.head(torch.index_select(hidden, 1, logit_positions))  # [B, N, V]
        return (logits, *presents_k, *presents_v)


def gqa_io_names(num_layers: int) -> tuple[list, list]:
    inputs = ["input_ids", "cache_len", "logit_positions"]
    inputs += [f"past_key.{i}" for i in range(num_layers)] + [f"past_value.{i}" for i in range(num_layers)]
    outputs = ["logits"] + [f"present_key.{i}" for i in range(num_layers)]
    outputs += [f"present_value.{i}" for i in range(num_layers)]
    return inputs, outputs


def check_gqa_supported(arch) -> None:
    from specdec.errors import ExportError

    if arch.sliding_window() is not None:
        raise ExportError(
            f"the gqa lowering does not implement sliding-window attention ({arch.dims.model_type})",
            "export with --lowering plain",
        )
