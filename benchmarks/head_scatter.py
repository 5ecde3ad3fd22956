"""How a trimmed draft LM head's scores go back to [M, V] in the graph: each form timed alone, interleaved.

    python benchmarks/head_scatter.py [--kept 24579] [--vocab 49152] [--rows 1] [--repeats 200]

The trimmed head (specdec.calibration.q41._replace_head) scores N' of V tokens; the graph must still return [M, V]
logits with a large negative value for the tokens it did not score. Forms, each one small onnxruntime graph on the
runtime's session options: the bundle's own form (specdec.calibration.q41.scatter_back: Pad one fill column +
GatherElements with int32 indices expanded to [M, V]), Pad + Gather along axis 1 (the form before it),
ScatterElements into a filled [M, V], and numpy fancy indexing outside the graph for scale. Every form is checked
equal to the numpy form.
Writes scatter.md (microseconds per call, min and median) and record.json. Not a test: the machine is shared.
"""
from __future__ import annotations

import argparse

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from harness import opening, record, tables, timer
from specdec.calibration.q41 import HEAD_FILL as FILL, scatter_back
from specdec.runtime.backend import session_options

EXPERIMENT = "head-scatter"


def _graph(nodes: list, inits: list, kept: int) -> bytes:
    graph = helper.make_graph(nodes, "scatter", [helper.make_tensor_value_info("k", TensorProto.FLOAT, ["M", kept])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def forms(keep: np.ndarray, vocab: int) -> dict:
    kept = len(keep)
    rows = np.full(vocab, kept, np.int64)
    rows[keep] = np.arange(kept)
    bundle_inits = []
    bundle_nodes = scatter_back("k", "y", keep, vocab, "head", lambda name, value: bundle_inits.append(
        numpy_helper.from_array(value, name)), helper)
    pad = [numpy_helper.from_array(np.array([0, 0, 0, 1], np.int64), "pads"),
           numpy_helper.from_array(np.array(FILL, np.float32), "fill")]
    out = {"Pad + GatherElements (int32; the bundle's form)": _graph(bundle_nodes, bundle_inits, kept)}
    out["Pad + Gather (axis 1; the form before)"] = _graph(
        [helper.make_node("Pad", ["k", "pads", "fill"], ["p"], mode="constant"),
         helper.make_node("Gather", ["p", "rows"], ["y"], axis=1)],
        pad + [numpy_helper.from_array(rows, "rows")], kept)
    out["ScatterElements"] = _graph(
        [helper.make_node("Shape", ["k"], ["kshape"]),
         helper.make_node("Gather", ["kshape", "first"], ["m"], axis=0),
         helper.make_node("Concat", ["m", "vocab"], ["full"], axis=0),
         helper.make_node("ConstantOfShape", ["full"], ["filled"],
                          value=numpy_helper.from_array(np.array([FILL], np.float32))),
         helper.make_node("Expand", ["keep", "kshape"], ["index"]),
         helper.make_node("ScatterElements", ["filled", "index", "k"], ["y"], axis=1)],
        [numpy_helper.from_array(np.array([0], np.int64), "first"),
         numpy_helper.from_array(np.array([vocab], np.int64), "vocab"),
         numpy_helper.from_array(keep[None], "keep")], kept)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kept", type=int, default=24579)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, default=1, help="M: rows of scores per call")
    parser.add_argument("--repeats", type=int, default=200)
    opening.add_out(parser)
    args = parser.parse_args(argv)
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    keep = np.sort(rng.choice(args.vocab, args.kept, replace=False)).astype(np.int64)
    sessions = {name: ort.InferenceSession(model, session_options(), providers=["CPUExecutionProvider"])
                for name, model in forms(keep, args.vocab).items()}
    scores = rng.standard_normal((args.rows, args.kept)).astype(np.float32)

    def numpy_form(x):
        full = np.full((x.shape[0], args.vocab), FILL, np.float32)
        full[:, keep] = x
        return full

    calls = {name: (lambda s=s: s.run(None, {"k": scores})[0]) for name, s in sessions.items()}
    calls["numpy, outside the graph"] = lambda: numpy_form(scores)
    want = calls["numpy, outside the graph"]()
    for name, call in calls.items():
        if not np.array_equal(call(), want):
            raise SystemExit(f"{name} differs from the numpy form")
    runtime = "the runtime's (specdec.runtime.backend.session_options)"
    settings = {name: {"session options": runtime} for name in sessions}
    run = record.run_record(EXPERIMENT, settings, None, __file__, argv, kept=args.kept, vocab=args.vocab,
                            rows=args.rows)
    spreads = {name: timer.summarize(v) for name, v in timer.interleave(calls, rounds=args.repeats).items()}
    rows = [[name, f"{s.min * 1e6:.0f}", f"{s.median * 1e6:.0f}"] for name, s in spreads.items()]
    text = (f"{args.kept} of {args.vocab} tokens, {args.rows} row(s), {args.repeats} interleaved calls each\n\n"
            + tables.markdown(["form", "µs per call, min", "median"], rows))
    record.finish(run, args.out, {"scatter.md": text}, shown=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
