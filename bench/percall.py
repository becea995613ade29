"""Where one steady call of a compiled workload goes: Dynamo's fixed cost against the backend's own.

    python bench/percall.py sin_cos_exp,matmul_softmax,mlp_b1          # CUDA where available, else the CPU
    python bench/percall.py mlp_b1 --device cpu --calls 1000

Per bench/harness.py workload (inference, torch.no_grad), the median of --calls individually timed calls (on
CUDA each bracketed by torch.cuda.synchronize(), as the harness times them), in microseconds, of:

    eager       the model itself
    dynamo      torch.compile with a backend that runs the captured graph eagerly (gm.forward): Dynamo's floor
    dyn-const   torch.compile with a backend that returns outputs computed once: Dynamo's fixed cost alone
                (guards, its wrappers; on CUDA the synchronization too), no work at all
    ember       torch.compile(backend="ember")
    direct      the callable ember's backend returned to Dynamo, called directly with the example inputs

so that ember - direct is what Dynamo adds to ember's call, and direct against eager is what ember's plan
costs against eager's ops. The variants are compiled one after another (torch._dynamo.reset() between), then
timed round-robin, call by call, so that the machine's noise falls on all alike. --block N times N consecutive
calls of one variant before moving to the next (still round-robin): each variant then runs with its own code and
data warm in the CPU's caches, as in a loop calling one model, where call by call every variant starts cold.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ember.backend  # noqa: E402
import harness  # noqa: E402

VARIANTS = ("eager", "dynamo", "dyn-const", "ember", "direct")


def split(name, device, calls, warmup, block=1):
    """{variant: median us} for workload `name`."""
    model, inputs = harness.WORKLOADS[name].build(device)
    held = {}

    def const_backend(gm, example_inputs):
        outputs = gm.forward(*example_inputs)
        return lambda *args: outputs

    def ember_backend(gm, example_inputs):
        compiled = ember.backend.ember_backend(gm, example_inputs, options=harness.EMBER_OPTIONS)
        held.setdefault("compiled", (compiled, list(example_inputs)))
        return compiled

    fns = {"eager": model}
    with torch.no_grad():
        for variant, backend in (("dynamo", lambda gm, example_inputs: gm.forward), ("dyn-const", const_backend),
                                 ("ember", ember_backend)):
            torch._dynamo.reset()
            fns[variant] = torch.compile(model, backend=backend)
            fns[variant](*inputs)  # compiled here, before the timing rounds
        compiled, example_inputs = held["compiled"]
        if getattr(compiled, "_boxed_call", False):
            fns["direct"] = lambda *args: compiled(list(example_inputs))
        else:
            fns["direct"] = lambda *args: compiled(*example_inputs)
        times = {v: [] for v in VARIANTS}
        for _ in range(warmup):
            for v in VARIANTS:
                fns[v](*inputs)
        harness.settle()
        for _ in range(max(1, calls // block)):
            for v in VARIANTS:
                for _ in range(block):
                    seconds, _ = harness.timed_call(fns[v], inputs, device)
                    times[v].append(seconds)
    torch._dynamo.reset()
    return {v: statistics.median(t) * 1e6 for v, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workloads", help="comma-separated bench/harness.py workload names")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per variant (median reported)")
    parser.add_argument("--block", type=int, default=1, help="consecutive timed calls per variant in each round")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per variant before timing")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in harness.WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(harness.WORKLOADS)}")
    if any(harness.WORKLOADS[n].training for n in names):
        parser.error("training workloads are not split here (their ember call is AOTAutograd's wrapper)")
    print(f"{'workload':<20}" + "".join(f"{v:>11}" for v in VARIANTS) + "   (us per call, median)")
    for name in names:
        row = split(name, args.device, args.calls, args.warmup, args.block)
        print(f"{name:<20}" + "".join(f"{row[v]:11.1f}" for v in VARIANTS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
