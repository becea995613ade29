"""Per-node executor overhead: eager vs ember vs inductor on graphs whose kernels take next to no time.

    python bench/overhead.py                    # the CPU, and CUDA too when it is available
    python bench/overhead.py --device cpu --no-inductor

The graph is a straight-line chain of N pointwise ops on 16-element tensors, cycling x = x + b, x = x * c,
x = sin(x) (b and c are inputs too, so no op has a Python scalar operand). With kernels this small, time per call is
overhead: Python and the dispatcher for eager, the executor for ember, the launch of one fused kernel for
inductor. Each backend runs the 100-node chain and a 1-node chain (x + b):

    per call (1 node)   the fixed cost of one call of a compiled graph (Dynamo guards, AOTAutograd's wrapper, ...)
    per node            (t(100 nodes) - t(1 node)) / 99, the cost each extra node adds

Variants:
    ember               ember's default passes (a fusion pass may turn the chain into one step)
    ember-unfused       ember with its fusion passes disabled (options disable_passes), so the plan runs one
                        step per node: this is the executor's per-node overhead
    ... executor        the same CompiledGraph called directly (no Dynamo / AOTAutograd wrapper)

Time per call is the median over --rounds rounds of --calls back-to-back calls (on CUDA synchronized at the
end of each round, so it is the launch rate while the GPU keeps up). Every variant is compiled first, then
each round times all of them in turn, so that noise from other work on the machine falls on all alike.
ember runs with fallback="raise".
Writes bench/results/overhead_<device>.json.
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import EMBER_OPTIONS, RESULTS_DIR, disable_inductor_caches, error_text, machine_info, settle, sync  # noqa: E402

NODES = 100
SIZE = 16
OPS = ("x = x + b", "x = x * c", "x = torch.sin(x)")


def make_chain(nodes):
    """A new function fn(x, b, c) of `nodes` straight-line pointwise ops: add b, mul c, sin, add b, ...

    Each call makes a new code object, so every compiled variant has a Dynamo cache of its own and all of them
    can be timed side by side without recompiling or resetting.
    """
    source = "def chain(x, b, c):\n" + "".join(f"    {OPS[i % 3]}\n" for i in range(nodes)) + "    return x\n"
    namespace = {"torch": torch}
    exec(source, namespace)
    return namespace["chain"]


class CaptureEmberGraphs:
    """Keeps the CompiledGraph objects ember hands to AOTAutograd, to time ember's executor on its own."""

    def __enter__(self):
        import ember.backend

        self.graphs = []
        self._original = ember.backend.compile_fx_graph

        def capture(*args, **kwargs):
            graph = self._original(*args, **kwargs)
            self.graphs.append(graph)
            return graph

        ember.backend.compile_fx_graph = capture
        return self

    def __exit__(self, *exc):
        import ember.backend

        ember.backend.compile_fx_graph = self._original


def ember_fusion_passes():
    """The names of ember's passes that merge nodes (disabled for the ember-unfused variant); [] if none."""
    try:
        from ember import _C

        return [name for name in _C.pass_names() if "fus" in name]
    except Exception:
        return []


def prepare(backend, nodes, inputs, device):
    """[(label, fn, args, info)] to time for one backend and chain length: the compiled function (first call
    done and checked against eager) and, for ember, its CompiledGraph called directly."""
    fn = make_chain(nodes)
    expected = fn(*inputs)
    if backend == "eager":
        return [("eager", fn, inputs, {})]
    is_ember = backend.startswith("ember")
    if backend == "inductor":
        compiled = torch.compile(fn, backend="inductor")
    elif backend == "ember":
        compiled = torch.compile(fn, backend="ember", options=EMBER_OPTIONS)
    elif backend == "ember-unfused":
        compiled = torch.compile(fn, backend="ember", options=dict(EMBER_OPTIONS, disable_passes=ember_fusion_passes()))
    else:
        raise ValueError(f"unknown backend {backend!r}")
    with CaptureEmberGraphs() if is_ember else contextlib.nullcontext() as captured:
        start = time.perf_counter()
        out = compiled(*inputs)
        sync(device)
        info = {"first_call_s": time.perf_counter() - start}
    info["max_abs_error"] = (out - expected).abs().max().item()
    if not info["max_abs_error"] <= 1e-4:
        raise RuntimeError(f"wrong result: max abs error {info['max_abs_error']:.2e} against eager")
    variants = [(backend, compiled, inputs, info)]
    if is_ember:
        if len(captured.graphs) != 1:
            raise RuntimeError(f"expected one ember graph, got {len(captured.graphs)}")
        graph = captured.graphs[0]
        # The graph takes the inputs the chain uses, in order (the 1-node chain does not use c). A tuple is not
        # cleared by the call (a list would be: boxed calling convention), so it can be passed again and again.
        graph_inputs = inputs[: graph.num_inputs]
        if (graph(graph_inputs)[0] - expected).abs().max().item() > 1e-4:
            raise RuntimeError("calling ember's CompiledGraph directly gave a different result")
        info["plan_steps"] = graph.num_steps

        def executor(*args):
            return graph(args)

        variants.append((backend + " executor", executor, graph_inputs, {"plan_steps": graph.num_steps}))
    return variants


def time_interleaved(variants, device, calls, rounds):
    """{key: median seconds per call}; each round times `calls` back-to-back calls of every variant in turn."""
    samples = {key: [] for key, _, _ in variants}
    for _, fn, args in variants:
        for _ in range(max(3, calls // 10)):
            fn(*args)
    settle()
    for _ in range(rounds):
        for key, fn, args in variants:
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            sync(device)
            samples[key].append((time.perf_counter() - start) / calls)
    return {key: statistics.median(s) for key, s in samples.items()}


def run_device(device, backends, calls, rounds):
    torch.manual_seed(0)
    inputs = tuple(torch.randn(SIZE, device=device) for _ in range(3))
    results = {}
    variants = []  # ((label, nodes), fn, args)
    torch._dynamo.reset()
    with torch.no_grad():
        for backend in backends:
            print(f"[overhead] {device} {backend}: compiling", file=sys.stderr, flush=True)
            try:
                prepared = {nodes: prepare(backend, nodes, inputs, device) for nodes in (1, NODES)}
            except Exception as e:
                results[backend] = {"error": error_text(e)}
                continue
            for nodes, entries in prepared.items():
                for label, fn, args, info in entries:
                    row = results.setdefault(label, {})
                    row[f"{nodes}_node" if nodes == 1 else f"{nodes}_nodes"] = info
                    variants.append(((label, nodes), fn, args))
        print(f"[overhead] {device}: timing {len(variants)} variants, {rounds} rounds of {calls} calls",
              file=sys.stderr, flush=True)
        times = time_interleaved(variants, device, calls, rounds)
    torch._dynamo.reset()

    for label, row in results.items():
        if "error" in row:
            continue
        one, many = 1e6 * times[(label, 1)], 1e6 * times[(label, NODES)]
        row.update({"us_per_call_1_node": one, f"us_per_call_{NODES}_nodes": many,
                    "us_per_node": (many - one) / (NODES - 1)})
    eager_node = results.get("eager", {}).get("us_per_node")
    for row in results.values():
        if eager_node and "us_per_node" in row:
            row["per_node_vs_eager"] = row["us_per_node"] / eager_node
    return results


def print_table(device, results):
    print(f"\n{device}: chain of {NODES} pointwise ops on {SIZE}-element tensors (us = microseconds)")
    header = (f"{'backend':<23} {'us/call 1 node':>14} {f'us/call {NODES} nodes':>17} {'us/node':>8} "
              f"{'node vs eager':>13}  note")
    print(header)
    print("-" * len(header))
    for label, row in results.items():
        if "error" in row:
            print(f"{label:<23} {row['error']}")
            continue
        ratio = f"{row['per_node_vs_eager']:.2f}x" if "per_node_vs_eager" in row else "-"
        note = ""
        if label.endswith(" executor"):
            note = f"CompiledGraph called directly; plan of {row[f'{NODES}_nodes']['plan_steps']} steps"
        elif label != "eager":
            note = f"torch.compile'd; first call {row[f'{NODES}_nodes']['first_call_s']:.2f} s ({NODES} nodes)"
        print(f"{label:<23} {row['us_per_call_1_node']:>14.2f} {row[f'us_per_call_{NODES}_nodes']:>17.2f} "
              f"{row['us_per_node']:>8.3f} {ratio:>13}  {note}")
    for label in ("ember", "ember-unfused"):
        if "per_node_vs_eager" in results.get(label, {}):
            print(f"{label}: per-node overhead {results[label]['per_node_vs_eager']:.2f}x eager's, "
                  f"fixed per-call overhead {results[label]['us_per_call_1_node']:.1f} us "
                  f"(eager {results['eager']['us_per_call_1_node']:.1f} us)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                        help="all: the CPU, and CUDA when available (default)")
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls per round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if not torch.cuda.is_available():
        if args.device == "cuda":
            parser.error("--device cuda: CUDA is not available")
        devices = [d for d in devices if d != "cuda"]
    backends = ["eager", "ember"] + (["ember-unfused"] if ember_fusion_passes() else [])
    backends += [] if args.no_inductor else ["inductor"]

    torch._dynamo.config.suppress_errors = False
    made_cache_dir = disable_inductor_caches()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    try:
        for device in devices:
            results = run_device(device, backends, args.calls, args.rounds)
            print_table(device, results)
            out = os.path.join(RESULTS_DIR, f"overhead_{device}.json")
            with open(out, "w") as f:
                json.dump({"machine": machine_info(device), "nodes": NODES, "size": SIZE, "calls": args.calls,
                           "rounds": args.rounds, "results": results}, f, indent=2)
            print(f"wrote {out}")
    finally:
        if made_cache_dir:
            shutil.rmtree(made_cache_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
