"""Prefix reuse in `specdec serve`: a slot keeps the K/V of the request it served last, and the next request on it
skips the prefill of the tokens they share. On native, where a position's K/V are the same bits however a prompt is
fed, that changes no bit: a prefill after reused K/V leaves the K/V and logits a whole prefill gives, and served texts
equal offline target-only greedy text, for a prompt that extends an earlier one and for one that carries an earlier
answer on (whose last token was never fed: its K/V is not there to reuse).
Backends without that promise (onnxruntime) and --no-prefix-reuse feed every prompt whole."""
from __future__ import annotations

import httpx
import pytest

import specdec
from specdec import GenerationConfig
from specdec.native import build
from specdec.runtime.state import common_prefix
from specdec.serving.batching import ServingLoop
from tests.serving.conftest import client, metric, start

pytestmark = pytest.mark.skipif(bool(build.missing_cpu_flags()), reason="the native kernels need AVX2, FMA and F16C")
NEW_TOKENS = 12
BASE = "The quick brown fox jumps over"


def _served(bundle, prompts: list, **options) -> tuple[list, float, float]:
    """Texts of `prompts` served one after another, the prompt tokens reused and fed (from /metrics)."""
    with start(bundle, **options) as server:
        api = client(server, key="unused")
        texts = [api.completions.create(model="q41", prompt=p, max_tokens=NEW_TOKENS, temperature=0).choices[0].text
                 for p in prompts]
        exposition = httpx.get(f"{server.url}/metrics").text
    return (texts, metric(exposition, "specdec_prompt_tokens_reused_total"),
            metric(exposition, "specdec_prompt_tokens_total"))


@pytest.fixture(scope="module")
def offline(q41_bundle):
    with specdec.load(q41_bundle, backend="onnxruntime") as gen:
        first = gen.generate(BASE, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).text
        prompts = [BASE, BASE + " the lazy dog", BASE + first + " and", BASE]
        texts = [gen.generate(p, GenerationConfig(max_new_tokens=NEW_TOKENS, drafter="none")).text for p in prompts]
        lengths = [len(gen.codec.encode(p)) for p in prompts]
    return prompts, texts, lengths


@pytest.mark.parametrize("speculation", ["off", "fixed"])
def test_a_reused_prefix_changes_no_token(q41_bundle, offline, speculation):
    prompts, expected, lengths = offline
    texts, reused, fed = _served(q41_bundle, prompts, backend="native", speculation=speculation)
    assert texts == expected
    assert fed == sum(lengths)
    # each prompt after the first shares at least the base prompt's tokens but its last with its slot's K/V; the
    # third carries the first answer on, all of whose tokens but the pending last are in the slot
    assert reused >= 3 * (lengths[0] - 2)
    assert reused <= sum(lengths[1:]) - 3  # every prompt's last token is fed: it gives the first token


def test_off_where_asked_or_not_exact(q41_bundle, offline):
    prompts, expected, _ = offline
    for options in ({"backend": "native", "reuse_prefix": False}, {"backend": "onnxruntime"}):
        texts, reused, _ = _served(q41_bundle, prompts[:2], **options)
        assert texts == expected[:2] and reused == 0, options


def test_reused_kv_gives_the_bits_of_a_fresh_prefill(q41_bundle):
    import numpy as np

    with specdec.load(q41_bundle, backend="native") as gen:
        gen.target.reset(2)
        loop = ServingLoop(gen.target, {}, None, 16, gen.manifest.tokenizer.eos_token_ids)
        config = GenerationConfig(max_new_tokens=8, drafter="none")
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, 200, 21)]
        first = gen.requests.row(prompt, config, slot=0)
        loop.prefill([first])  # slot 0 now holds the prompt's K/V; its first token is pending, never fed
        carried = prompt + [first.tokens[-1], 7, 8]  # a later turn: the prompt, the answer, more
        reused, fresh = gen.requests.row(carried, config, slot=0), gen.requests.row(carried, config, slot=1)
        loop.prefill([reused])
        loop.prefill([fresh])
        assert (reused.reused, fresh.reused) == (len(prompt), 0)
        assert reused.tokens == fresh.tokens  # the same first token ...
        step = [gen.target.forward(np.array([[row.tokens[-1]]]), np.array([row.target_len]), slots=np.array([row.slot]))
                for row in (reused, fresh)]
        assert np.array_equal(step[0], step[1])  # ... and the same bits at the next position, over every K/V


def test_the_command_line_switch():
    import argparse

    from specdec.cli.serve import add_serve_parser, options_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert options_from_args(parser.parse_args(["serve", "b"])).reuse_prefix is True
    assert options_from_args(parser.parse_args(["serve", "b", "--no-prefix-reuse"])).reuse_prefix is False


class _Row:
    def __init__(self, tokens, target_len, slot=0, head=None):
        self.tokens, self.target_len, self.slot, self.head = tokens, target_len, slot, head


class _Exact:
    exact_prefix_kv = True


def test_only_fed_positions_count_and_the_longest_prefix_picks_the_slot():
    loop = ServingLoop(_Exact(), {}, None, 16, [0])
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    first = _Row([5, 6, 7, 8, 9], target_len=4)  # 9 is pending: never fed
    assert loop.reusable(first, first.tokens) == 0  # an empty slot
    assert loop.held(0) == [5, 6, 7, 8]
    again = _Row([5, 6, 7, 8, 9, 10], target_len=0)
    assert loop.reusable(again, again.tokens) == 4  # not 5: position 4 holds no K/V of token 9
    assert loop.held(0) == []  # the slot is the new row's now, and it has fed nothing yet
    loop.holders[1] = _Row([5, 6, 1], target_len=2, slot=1)
    loop.holders[2] = _Row([5, 6, 7, 3], target_len=3, slot=2)
    assert loop.best_slot([0, 1, 2, 3], [5, 6, 7, 2]) == 2
    assert loop.best_slot([0, 3], [5, 6]) == 0  # no prefix anywhere: the lowest slot
    whole = _Row([5, 6, 7], target_len=0, slot=2)
    assert loop.reusable(whole, whole.tokens) == 2  # the whole prompt is held: its last token is fed all the same
    inexact = ServingLoop(object(), {}, None, 16, [0])
    inexact.holders[0] = _Row([5, 6, 7], target_len=2)
    assert inexact.held(0) == [] and inexact.reusable(_Row([5, 6, 7], 0), [5, 6, 7]) == 0


def test_a_head_row_keeps_what_its_slot_held_of_their_shared_prefix():
    import numpy as np

    from specdec.runtime.head_drafter import HeadState

    def head(length: int, pending: int) -> HeadState:  # fed positions 0..length-1, holds the hidden states after
        state = HeadState(length=length)
        state.put(0, np.arange(pending * 2, dtype=np.float32).reshape(pending, 1, 2) + length)  # [T, F, H]
        return state

    loop = ServingLoop(_Exact(), {}, None, 16, [0])
    loop.holders[0] = _Row([5, 6, 7, 8, 9, 4], target_len=5, head=head(4, 1))  # its head fed positions 0..3
    new = _Row([5, 6, 7, 8, 2, 2], target_len=0)
    assert loop.reusable(new, new.tokens) == 4
    assert loop.tapped_start(new, 4) == 3  # head position 3 read token 4 (9 there, 2 here): refed
    assert (new.head.length, new.head.count) == (3, 0) and 0 not in loop.head_kept  # (taken by that prefill)
    before = head(2, 3)
    loop.holders[0] = _Row([5, 6, 7, 8, 9, 4], target_len=5, head=before)  # it fed 0..1, holds 2..4's states
    again = _Row([5, 6, 7, 8, 9, 4, 1], target_len=0)
    assert loop.reusable(again, again.tokens) == 5
    assert loop.tapped_start(again, 5) == 5  # nothing refed: the states of 2..4 come along, copied
    assert (again.head.length, again.head.count) == (2, 3)
    assert not np.shares_memory(again.head.buffer, before.buffer)
    assert again.head.pending[:, 0, 0].tolist() == [2.0, 4.0, 6.0]
    loop.holders[0] = _Row([5, 6, 7, 8, 9, 4], target_len=5, head=head(1, 1))  # its head lagged: states of 1 only
    short = _Row([5, 6, 7, 8, 9, 3], target_len=0)
    assert loop.reusable(short, short.tokens) == 5 and loop.tapped_start(short, 5) == 2
    assert (short.head.length, short.head.count) == (1, 1)
    loop.holders[0] = _Row([5, 6, 7], target_len=2)  # a row without a head: nothing to keep
    plain = _Row([5, 6, 7, 1], target_len=0)
    assert loop.reusable(plain, plain.tokens) == 2 and loop.tapped_start(plain, 2) == 0 and plain.head is None
