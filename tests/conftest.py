"""Session fixtures: tiny random models with a real tokenizer, exported once through the real pipeline."""
from __future__ import annotations

import random
import socket

import pytest

from specdec.export.bundle import export_bundle
from specdec.export.config import ExportConfig
from specdec.export.tiny import save_tiny
from specdec.native_record import Activations

GAMMA_MAX = 6
MAX_SEQ_LEN = 96
# A server's port in tests comes from below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
# 32768 up by default) and above Ray's worker ports (10002-19999): a port the kernel hands out for port 0 may be
# handed again, between our check and our server's bind, to a process Ray starts (its metrics agent answered a
# test's /health once).
TEST_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port nothing listens on now, from TEST_PORTS."""
    for port in random.sample(TEST_PORTS, 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {TEST_PORTS}")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama", seed=0, init_range=0.5)


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory):
    """Same tokenizer, other random weights: a draft built to be rejected."""
    return save_tiny(tmp_path_factory.mktemp("llama_other"), "llama", seed=1, init_range=0.5)


def _export(out, target, **options):
    config = ExportConfig(out=out, target=str(target), max_seq_len=MAX_SEQ_LEN, gamma=3, gamma_max=GAMMA_MAX,
                          max_batch=4, max_prefill_chunk=16, progress=False,
                          **{"activations": Activations.FP32, **options})
    return export_bundle(config)


@pytest.fixture(scope="session")
def int4_bundle(tmp_path_factory, tiny_llama):
    return _export(tmp_path_factory.mktemp("b") / "int4", tiny_llama, draft_from_target="int4", lowering="plain")


@pytest.fixture(scope="session")
def gqa_int4_bundle(tmp_path_factory, tiny_llama):
    """The onnxruntime lowering (GroupQueryAttention, in-place KV) with its INT4 self-draft."""
    return _export(tmp_path_factory.mktemp("b") / "gqa", tiny_llama, draft_from_target="int4", lowering="gqa")


@pytest.fixture(scope="session")
def random_draft_bundle(tmp_path_factory, tiny_llama, random_draft_dir):
    return _export(tmp_path_factory.mktemp("b") / "random", tiny_llama, draft=str(random_draft_dir), lowering="plain")


@pytest.fixture(scope="session")
def copy_llama(tmp_path_factory):
    """One layer with small weights and tied embeddings: it mostly repeats its last token, so prompt lookup on
    its own output proposes tokens the target accepts (at every draft position)."""
    return save_tiny(tmp_path_factory.mktemp("copy"), "llama", layers=1, seed=0, init_range=0.02)


@pytest.fixture(scope="session")
def copy_bundles(tmp_path_factory, copy_llama):
    root = tmp_path_factory.mktemp("b")
    return {lowering: _export(root / lowering, copy_llama, lowering=lowering) for lowering in ("plain", "gqa")}


@pytest.fixture(scope="session")
def export_tiny():
    """Export a tiny model with options; for tests that need their own bundle."""
    return _export
