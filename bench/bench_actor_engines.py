"""The policy's actor on one observation through three engines: is there a CPU engine that
runs it faster than ONNX Runtime, so that a decision could cost less than one ONNX Runtime
call?

The actor is the committed default bundle's single-row graph (``checkpoints/default``,
``actor_row.onnx``: the per-channel scorer of ``agents/networks.py``, globals 8 -> 32 and
features 4 -> 32 summed, ReLU, 32 -> 32, ReLU, 32 -> 1, tanh, on K + 1 = 201 channels at
``godaddy``). The observations are real ones: every active type of the 4 test windows
re-decided once on a fully decided ``Session`` (``bench_serving``'s sessions), each
observation recorded from the runner's input as ``Session.decide`` wrote it.

Engines, each timed on the same observations cycled in order (each call first copies the
observation into the engine's input buffer, as the decision path writes it there):

- **ONNX Runtime**: the bundle's single-row runner as the server uses it
  (``PolicyBundle.bound_row``: bound buffers, ``run_with_iobinding``; one intra-op thread).
- **NumPy**: the ONNX graph's nodes (Gemm, Relu, Tanh) interpreted in order with NumPy
  float32 operations (``np.dot`` on the BLAS of this NumPy; each call builds its
  temporaries, so the time includes the interpreter's overhead).
- **numba**: the same graph as one compiled loop kernel (float32, fast-math, the hidden
  layer in blocks of 4 output rows so each input row is loaded once per block, the
  channel loops innermost for the compiler to vectorise).

For each engine: the time per call, p50 over ``calls`` calls, median (min-max) over
``repeats`` runs, one pinned core; and its agreement with ONNX Runtime on every recorded
observation: the largest absolute score difference and how many observations' argmax
channel differs (a different argmax can change a decision).

Usage: ``python bench/bench_actor_engines.py [--quick]``
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from _common import ROOT, finish, fmt_stats, log, md_table, pin_one_core, stats

sys.path.insert(0, str(ROOT / "bench"))

CORE = pin_one_core()

import bench_serving as bs  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from serving.policy_store import PolicyStore  # noqa: E402

#: the single-row actor's node sequence this benchmark's numba kernel is written for
EXPECTED_OPS = ["Gemm", "Gemm", "Relu", "Gemm", "Relu", "Gemm", "Tanh"]


def _gemm_plain(node: Any) -> bool:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return all(attrs.get(k, d) == d for k, d in
               (("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0)))


def numpy_engine(model: Any, x: np.ndarray, inputs: dict[str, tuple[int, tuple]]) -> Any:
    """A call that evaluates the graph's nodes in order on views of ``x`` (the runner's
    flat observation: each graph input a reshaped slice of it)."""
    init = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
    nodes = list(model.graph.node)
    for n in nodes:
        if n.op_type not in ("Gemm", "Relu", "Tanh") or (n.op_type == "Gemm"
                                                          and not _gemm_plain(n)):
            raise SystemExit(f"numpy engine: node {n.name} ({n.op_type}) is not supported")
    out_name = model.graph.output[0].name

    def call() -> np.ndarray:
        env = dict(init)
        for name, (start, shape) in inputs.items():
            env[name] = x[start:start + int(np.prod(shape))].reshape(shape)
        for n in nodes:
            if n.op_type == "Gemm":
                a, b, c = (env[i] for i in n.input)
                env[n.output[0]] = np.dot(a, b) + c
            elif n.op_type == "Relu":
                env[n.output[0]] = np.maximum(env[n.input[0]], np.float32(0))
            else:
                env[n.output[0]] = np.tanh(env[n.input[0]])
        return env[out_name]

    return call


@numba.njit(cache=True, fastmath=True, boundscheck=False)
def _forward(x: np.ndarray, ng: int, wg: np.ndarray, b1: np.ndarray, wf: np.ndarray,
             w2: np.ndarray, b2: np.ndarray, w3: np.ndarray, b3: float, out: np.ndarray,
             h1: np.ndarray, h2: np.ndarray) -> None:
    """The single-row actor: h1 = relu(wf F + (wg g + b1)), h2 = relu(w2 h1 + b2),
    out = tanh(w3 h2 + b3), with ``g = x[:ng]`` and ``F = x[ng:]`` as [features, channels].
    The 32 -> 32 layer is computed 4 output rows at a time (``h2`` holds one block), each
    row of ``h1`` loaded once per block; the channel loops are the vectorised ones."""
    nf, hidden, channels = wf.shape[1], w2.shape[0], out.shape[0]
    g = x[:ng]
    f = x[ng:].reshape(nf, channels)
    zero = np.float32(0)
    for j in range(hidden):
        a = b1[j]
        for i in range(ng):
            a += wg[j, i] * g[i]
        for c in range(channels):
            h1[j, c] = a
        for i in range(nf):
            w = wf[j, i]
            for c in range(channels):
                h1[j, c] += w * f[i, c]
        for c in range(channels):
            h1[j, c] = max(h1[j, c], zero)
    for c in range(channels):
        out[c] = b3
    for j in range(0, hidden, 4):
        for r in range(4):
            for c in range(channels):
                h2[r, c] = b2[j + r]
        for k in range(hidden):
            a0, a1, a2, a3 = w2[j, k], w2[j + 1, k], w2[j + 2, k], w2[j + 3, k]
            for c in range(channels):
                h = h1[k, c]
                h2[0, c] += a0 * h
                h2[1, c] += a1 * h
                h2[2, c] += a2 * h
                h2[3, c] += a3 * h
        for c in range(channels):
            out[c] += (w3[j] * max(h2[0, c], zero) + w3[j + 1] * max(h2[1, c], zero)
                       + w3[j + 2] * max(h2[2, c], zero) + w3[j + 3] * max(h2[3, c], zero))
    for c in range(channels):
        out[c] = np.tanh(out[c])


def numba_engine(model: Any, x: np.ndarray, inputs: dict[str, tuple[int, tuple]]) -> Any:
    """A call of :func:`_forward` with the graph's weights (refused unless the graph is the
    per-channel scorer's node sequence, ``EXPECTED_OPS``, each node taking the one before it;
    the agreement check of :func:`main` catches any other difference)."""
    nodes = list(model.graph.node)
    if [n.op_type for n in nodes] != EXPECTED_OPS or not all(
            _gemm_plain(n) for n in nodes if n.op_type == "Gemm"):
        raise SystemExit(f"numba engine: the graph is {[n.op_type for n in nodes]}, "
                         f"the kernel is written for {EXPECTED_OPS}")
    chained = [(1, 2, 0), (2, 0, 1), (3, 1, 2), (4, 0, 3), (5, 1, 4), (6, 0, 5)]
    if any(nodes[i].input[k] != nodes[j].output[0] for i, k, j in chained):
        raise SystemExit("numba engine: the graph's nodes are not chained as the kernel's")
    init = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
    g_in, f_in = nodes[0].input[1], nodes[1].input[1]
    if inputs[g_in][0] != 0 or inputs[f_in][0] != int(np.prod(inputs[g_in][1])):
        raise SystemExit("numba engine: the globals must precede the features in the row")
    wg, b1 = init[nodes[0].input[0]], init[nodes[0].input[2]][:, 0].copy()
    wf = init[nodes[1].input[0]]
    w2, b2 = init[nodes[3].input[0]], init[nodes[3].input[2]][:, 0].copy()
    w3, b3 = init[nodes[5].input[0]][0].copy(), float(init[nodes[5].input[2]].ravel()[0])
    ng, channels = int(np.prod(inputs[g_in][1])), int(inputs[f_in][1][1])
    hidden = w2.shape[0]
    if hidden % 4:
        raise SystemExit(f"numba engine: the kernel needs a hidden width divisible by 4, "
                         f"not {hidden}")
    out = np.zeros(channels, np.float32)
    h1, h2 = np.zeros((hidden, channels), np.float32), np.zeros((4, channels), np.float32)

    def call() -> np.ndarray:
        _forward(x, ng, wg, b1, wf, w2, b2, w3, np.float32(b3), out, h1, h2)
        return out

    return call


def recorded_observations(policy: Any, ps: Any) -> np.ndarray:
    """Every active type of each test window re-decided once on a fully decided session,
    its observation as ``Session.decide`` wrote it into the runner's input."""
    obs = []
    for w in ps.windows["test"]:
        s = bs.fresh_session(bs.snapshot_of(bs.session_body(ps, w)), policy)
        for t in bs.active_ids(s):
            _, _, (o, _) = bs._inlined(s, t, policy, time.perf_counter_ns)
            obs.append(o)
    return np.asarray(obs, np.float32)


def graph_inputs(model: Any, runner: Any) -> dict[str, tuple[int, tuple]]:
    """Each graph input's (offset, shape) in the runner's flat observation."""
    out = {}
    for name, view in runner.feeds.items():
        start = (view.__array_interface__["data"][0]
                 - runner.x.__array_interface__["data"][0]) // runner.x.itemsize
        out[name] = (int(start), tuple(view.shape))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls")
    args = ap.parse_args()
    calls, repeats = (2_000, 3) if args.quick else (10_000, 5)
    t0 = time.perf_counter()
    ps = bs.problems_for(bs.SCENARIO)
    policy = PolicyStore(trust=bs.TRUST).load(bs.BUNDLE)
    obs = recorded_observations(policy, ps)
    runner = policy.bound_row()
    model = onnx.load(str(bs.BUNDLE / "actor_row.onnx"))
    inputs = graph_inputs(model, runner)
    x = np.zeros_like(runner.x)  # the other engines' input buffer
    engines = {"ONNX Runtime (bound row)": (runner.x, runner.run),
               "NumPy (graph nodes in order)": (x, numpy_engine(model, x, inputs)),
               "numba (one compiled kernel)": (x, numba_engine(model, x, inputs))}
    log(f"bench_actor_engines: core {CORE}; {len(obs)} recorded observations of "
        f"{obs.shape[1]} floats; graph inputs {inputs}")
    reference = np.empty((len(obs), runner.scores.shape[0]), np.float32)
    for i, o in enumerate(obs):
        runner.x[:] = o
        reference[i] = runner.run()
    results: dict[str, Any] = {}
    for name, (buf, call) in engines.items():
        scores = np.empty_like(reference)
        for i, o in enumerate(obs):
            buf[:] = o
            scores[i] = call()
        diff = float(np.abs(scores - reference).max())
        flips = int((scores.argmax(1) != reference.argmax(1)).sum())
        p50s = []
        for _ in range(repeats):
            lat = np.empty(calls, np.int64)
            for i in range(calls):
                o = obs[i % len(obs)]
                a = time.perf_counter_ns()
                buf[:] = o
                call()
                lat[i] = time.perf_counter_ns() - a
            p50s.append(float(np.median(lat)) / 1000)
        results[name] = {"p50_us": stats(p50s), "max_abs_diff": diff, "argmax_differs": flips}
        log(f"  {name}: p50 {fmt_stats(results[name]['p50_us'], '{:.1f}')} us; max |diff| "
            f"{diff:.2e}; argmax differs on {flips} of {len(obs)}")
    ort_p50 = results["ONNX Runtime (bound row)"]["p50_us"]["median"]
    rows = [[name, fmt_stats(r["p50_us"], "{:.1f}"), f"{r['p50_us']['median'] / ort_p50:.2f}x",
             f"{r['max_abs_diff']:.1e}", f"{r['argmax_differs']} of {len(obs)}"]
            for name, r in results.items()]
    table = md_table(["engine", "one call, p50 (us)", "/ ONNX Runtime",
                      "largest score difference from ONNX Runtime",
                      "observations whose argmax differs"], rows)
    notes = [f"the committed default bundle's actor_row.onnx at godaddy ({obs.shape[1]} "
             f"floats in, {reference.shape[1]} channel scores out); {len(obs)} observations "
             "recorded from Session.decide re-deciding every active type of the 4 test "
             f"windows; core {CORE}; p50 of {calls:,} calls, median (min-max) of {repeats} "
             "runs; each call includes copying the observation into the engine's input",
             "NumPy: the graph's Gemm, Relu and Tanh nodes evaluated in order with float32 "
             "NumPy, interpreted per call; numba: the same graph as one compiled loop "
             "kernel (float32, fast-math, the hidden layer in blocks of 4 rows)"]
    finish("bench_actor_engines", {"results": results, "observations": len(obs),
                                   "settings": {"calls": calls, "repeats": repeats,
                                                "quick": args.quick}},
           table, notes, time.perf_counter() - t0)


if __name__ == "__main__":
    main()
