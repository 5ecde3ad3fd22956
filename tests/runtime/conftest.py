"""Generators shared by the runtime tests (module scope: each test module opens its own)."""
from __future__ import annotations

import pytest

import specdec


@pytest.fixture(scope="module", params=["plain", "gqa"])
def int4_gen(request, int4_bundle, gqa_int4_bundle):
    """The INT4 self-draft bundle in both lowerings: every test that uses it runs on each."""
    with specdec.load(int4_bundle if request.param == "plain" else gqa_int4_bundle) as gen:
        yield gen


@pytest.fixture(scope="module")
def random_gen(random_draft_bundle):
    """A draft of other random weights: built to be rejected."""
    with specdec.load(random_draft_bundle) as gen:
        yield gen
