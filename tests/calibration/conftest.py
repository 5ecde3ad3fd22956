"""Fixtures of the calibration tests: a writable copy of the tiny INT4 bundle."""
from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def bundle_copy(int4_bundle, tmp_path):
    return shutil.copytree(int4_bundle, tmp_path / "bundle")
