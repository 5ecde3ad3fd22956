"""benchmarks/native_step.py's kernels and forward pass, against PyTorch on a tiny LLaMA whose weights are snapped
to the Q4_1 grid (linear layers) and the Q8_0 grid (tied embedding), as the default model's are: prefill, one-token
and several-token calls at the logits' tolerance. Needs gcc and an AVX2 + FMA CPU."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "native_step.py"


def _cpu_has(*flags) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(text.split())
    return all(flag in words for flag in flags)


pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or not _cpu_has("avx2", "fma"),
                                reason="the native kernels need gcc and an AVX2 + FMA CPU")


@pytest.fixture(scope="module")
def native_step():
    spec = importlib.util.spec_from_file_location("native_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _on_grids(model) -> None:
    """Every Linear weight [N, K] onto Q4_1 levels d·q + m, the tied embedding onto Q8_0 levels d·q."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                w = module.weight.reshape(module.weight.shape[0], -1, 32)
                low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
                step = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
                module.weight.copy_((torch.round((w - low) / step) * step + low).reshape(module.weight.shape))
        e = model.model.embed_tokens.weight.reshape(model.model.embed_tokens.weight.shape[0], -1, 32)
        step = e.abs().amax(-1, keepdim=True) / 127
        step = torch.where(step > 0, step, torch.ones_like(step))  # the padding token's row is zeros
        model.model.embed_tokens.weight.copy_((torch.round(e / step) * step).reshape(-1, e.shape[1] * 32))


def test_native_forward_matches_pytorch(native_step):
    from specdec.export.tiny import tiny_model

    model = tiny_model("llama", 320, layers=2, hidden=64, init_range=0.2)
    _on_grids(model)
    tokens = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(tokens).logits[0].numpy()  # [24, V]
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    native = native_step.NativeTarget(native_step.build_kernels(2), state, model.config, 64)
    assert max(native.errors) < 1e-3  # the snapped weights are on the grids the kernels hold
    ids = tokens[0].tolist()
    got = np.concatenate([native.forward(ids[:13], 0), native.forward(ids[13:14], 13), native.forward(ids[14:21], 14),
                          native.forward(ids[21:], 21)])  # prefill (row tiles of 6 and a rest), T = 1, T = 7, T = 3
    scale = np.abs(reference).max()
    assert scale > 1.0
    assert np.abs(got - reference).max() < 1e-4 * scale
    assert (got.argmax(-1) == reference.argmax(-1)).all()


def test_off_grid_weights_show_their_error(native_step):
    blocks, error = native_step.q41_blocks(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    assert blocks.shape == (8, 2) and error > 0.01  # random fp32 weights are not Q4_1 levels
    levels = (np.arange(32) % 16).astype(np.float32) * 0.25 - 1.0
    blocks, error = native_step.q41_blocks(np.tile(levels, (4, 2)))
    assert error == 0.0 and np.allclose(blocks["d"], 0.25) and np.allclose(blocks["m"], -1.0)
