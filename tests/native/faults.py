"""Faults put into a bundle's native weights on purpose, each with the file's new hash recorded (as a bundle made so
on purpose would pass its hash check): for the native and cuda backends' tests of what the checks at open refuse and
what the checks of every forward's logits catch."""
from __future__ import annotations

import json

import numpy as np

from specdec.weight_kinds import DTYPES
from specdec.manifest import sha256_file

OVERFLOW, GAIN = 60000.0, 9000.0  # within the bounds at open (scales ±65504, gains ±1e4); a model of them overflows


def edit_manifest(bundle, edit) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def native_record(bundle, role: str = "target") -> dict:
    return json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))["models"][role]["native"]


def edit_bytes(bundle, tensor: str, at: int, data: bytes, role: str = "target") -> None:
    """Write `data` at byte `at` of `tensor` in the model's native.bin; record the file's new hash."""
    native = native_record(bundle, role)
    start, path = native["tensors"][tensor]["offset"] + at, bundle / native["path"]
    raw = bytearray(path.read_bytes())
    raw[start : start + len(data)] = data
    path.write_bytes(bytes(raw))
    edit_manifest(bundle, lambda m: m["models"][role]["files"].update({native["path"]: sha256_file(path)}))


def poke(bundle, tensor: str, value: float, at: int = 0, role: str = "target") -> None:
    """`value` as a float32 at byte `at` of `tensor` (0: its first float, a block's d)."""
    edit_bytes(bundle, tensor, at, np.float32(value).tobytes(), role)


def float_at(bundle, tensor: str, at: int) -> np.float32:
    native = native_record(bundle)
    start = native["tensors"][tensor]["offset"] + at
    return np.frombuffer((bundle / native["path"]).read_bytes()[start : start + 4], np.float32)[0]


def flip_scale(bundle, tensor: str, block: int, field: str) -> np.float32:
    """Flip the top exponent bit of block `block`'s `field` (d or m) of `tensor`: a value below 2 in size grows by
    2**128 (finite), one of 1 to 2 turns inf or NaN. -> the value written."""
    kind = DTYPES[native_record(bundle)["tensors"][tensor]["kind"]]
    at = block * kind.itemsize + kind.fields[field][1]
    value = float_at(bundle, tensor, at)
    assert 0 < abs(value) < 2, value
    flipped = (value.view(np.uint32) ^ np.uint32(1 << 30)).view(np.float32)
    poke(bundle, tensor, flipped, at)
    return flipped


def swap_offsets(bundle, first: str, second: str) -> None:
    def swap(tensors):
        tensors[first]["offset"], tensors[second]["offset"] = tensors[second]["offset"], tensors[first]["offset"]

    edit_manifest(bundle, lambda m: swap(m["models"]["target"]["native"]["tensors"]))


def overflowing(bundle, role: str = "target") -> None:
    """Each of the model's MLP blocks' scales at OVERFLOW (a target's blk4 d, a draft's blk4p fp16 d0 and d1), and a
    target's norm gains at GAIN: every value within the bounds, and the products overflow float32 in the first
    layers (a norm's sum of squares turns inf, which would zero its row)."""
    native = native_record(bundle, role)
    for name, spec in native["tensors"].items():
        kind, count = DTYPES[spec["kind"]], int(np.prod(spec["shape"]))
        if name.endswith("norm"):
            edit_bytes(bundle, name, 0, np.full(count, GAIN, np.float32).tobytes(), role)
        elif name.endswith(("gate_up", "down", "gate_up_p", "down_p")):
            blocks = np.frombuffer((bundle / native["path"]).read_bytes(), kind, count, spec["offset"]).copy()
            if "d" in kind.names:
                blocks["d"] = OVERFLOW
            else:
                blocks["h"][..., :2] = OVERFLOW
            edit_bytes(bundle, name, 0, blocks.tobytes(), role)
