"""specdec's own CPU kernels (docs/backends.md, native), for targets with native weights: GGUF blocks or rows.

A GGUF's Q4_1 linear weights are d·q + m per block of 32, its Q8_0 embedding d·q. Exported to fp32, the target reads
32 bits for each 4.5 bits those hold; these kernels read the blocks themselves and multiply them with fp32
activations, so they compute the target's own function (another summation order, no quantized activations). A target exported
from a bf16, f16 or fp32 checkpoint keeps its weights as rows in the narrowest of those that holds each exactly.
"""
