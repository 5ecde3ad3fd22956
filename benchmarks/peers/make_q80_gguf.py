"""The default model as a Q8_0 GGUF, for the native engine's q80 layout (issue 39): every Q4_1 tensor of the default
GGUF dequantized and quantized again to Q8_0 by gguf-py (the `gguf` package transformers reads GGUFs with); every
other tensor and every metadata field copied as it is. Same shapes and tokenizer as the default model, 8.5 bits a
linear weight: what a user's Q8_0 download costs to run (its values are the Q4_1 model's, to within Q8_0's rounding).

    python benchmarks/peers/make_q80_gguf.py [--out FILE] [--overwrite]   # default benchmarks/.peers/models/...
"""
from __future__ import annotations

import argparse
from pathlib import Path

from llamacpp_peer import default_gguf, peers_dir


def convert(source: Path, out: Path) -> dict:
    """Write `out` from `source`; -> {tensor type: count} of what was written."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer's own header fields
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype is GGUFValueType.ARRAY else None)
    writer.add_file_type(7)  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q8_0
    written: dict = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind is GGMLQuantizationType.Q4_1:
            values = dequantize(tensor.data, kind)
            writer.add_tensor(tensor.name, quantize(values, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
            kind = GGMLQuantizationType.Q8_0
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=kind)
        written[kind.name] = written.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=peers_dir() / "models" / "SmolLM2-135M-Instruct.Q8_0.gguf")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.overwrite:
        raise SystemExit(f"{args.out} exists; pass --overwrite to replace it")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = convert(default_gguf(), args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB): {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
