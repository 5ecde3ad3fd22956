"""A trained draft head (EAGLE-3 style) beside the target, numpy only (docs/heads.md).

- `format`: the head's weights in the bundle (`head/head.npz`) and its manifest record (specdec.manifest.HeadRecord),
  written by `attach_head` and read back with every tensor's shape checked against the record and the target.
- `model`: its forward over [B rows, T tokens] at per-row positions and KV slots, with its own one-layer static KV;
  the products in fp32 numpy (the reference) or on the native kernels over Q8_0 blocks (specdec.native).
- `opening`: the head beside an open target backend (the target's token embedding shared, not copied).

The drafter that runs it is specdec.runtime.head_drafter.HeadDrafter (`drafter="head"`).
"""
