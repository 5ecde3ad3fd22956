"""Fixtures of the calibration tests: a writable copy of the tiny INT4 bundle, and fp32 layer-draft bundles."""
from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def bundle_copy(int4_bundle, tmp_path):
    return shutil.copytree(int4_bundle, tmp_path / "bundle")


@pytest.fixture(scope="session", params=["plain", "gqa"])
def layer_draft_bundle(request, tmp_path_factory, tiny_llama, export_tiny):
    """The tiny 2-layer target with its fp32 first-layer draft (--draft-layers 1), in each lowering."""
    out = tmp_path_factory.mktemp("b") / f"layers-{request.param}"
    return export_tiny(out, tiny_llama, draft_layers=1, lowering=request.param, check_parity=False)


@pytest.fixture(scope="session")
def native_bundle(tmp_path_factory, export_tiny):
    """A target the native engine runs (head dim 16, eight layers: a head reads three distinct ones), no draft:
    what head training reads."""
    from specdec.export.tiny import save_tiny

    model = save_tiny(tmp_path_factory.mktemp("native_llama"), "llama", layers=8, seed=0, hidden=64, init_range=0.5)
    return export_tiny(tmp_path_factory.mktemp("b") / "native", model, no_draft=True)
