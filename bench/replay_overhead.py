"""Host time of one call under mode="reduce-overhead": what a replayed call costs the CPU, GPU work excluded.

    python bench/replay_overhead.py [--calls 200 --rounds 30]

For each graph (a 3-op pointwise chain on 16 floats; MLP 512-1024-1024-10 at batch 1; 20 x Linear(100,100) at
batch 32) it times, on the host, each call from entry to return with the device idle before it (synchronized
before the call, not within it): the GPU work is excluded. Timing back-to-back calls instead measures the GPU
wherever a call's GPU work outlasts its host time, as 20 x Linear's replay does (a queue of launches fills and
the next launch waits). Median over rounds of the mean over --calls calls:

    dynamo-guards   torch.compile with a backend whose compiled function returns precomputed outputs: Dynamo's
                    guard check and frame handling alone, the floor every torch.compile backend pays
    ember-ro        ember, CUDA graphs (after warm-up every call is a replay)
    inductor-ro     inductor, mode="reduce-overhead" (cudagraph trees)
    ember           ember's default mode, for reference
    aot-guards      like dynamo-guards, through AOTAutograd (which ember and inductor both use): the guards
                    it adds, with its runtime wrapper; for reference, not subtracted

and reports each minus dynamo-guards: the overhead on top of Dynamo's guards. Two more rows split ember's part:

    ember-ro-call   what ember handed Dynamo (the C++ DirectCall, or AOTAutograd's wrapper) called with Dynamo's
                    inputs, parameters included, without Dynamo: ember's own cost per replayed call, argument
                    conversion, input copies and the graph launch included
    torch-replay    torch.cuda.CUDAGraph.replay() of the same function captured by hand: the launch floor

Writes bench/results/replay_overhead.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import EMBER_OPTIONS, RESULTS_DIR, disable_inductor_caches, machine_info, settle  # noqa: E402


def graphs():
    chain = (lambda x: (x.sin() * 2).cos() + 1, (torch.randn(16, device="cuda"),))
    mlp = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    lin20 = nn.Sequential(*[nn.Linear(100, 100) for _ in range(20)])
    return {
        "chain16": chain,
        "mlp_b1": (mlp.cuda().eval(), (torch.randn(1, 512, device="cuda"),)),
        "linear20_b32": (lin20.cuda().eval(), (torch.randn(32, 100, device="cuda"),)),
    }


def guards_only_backend(gm, example_inputs):
    with torch.no_grad():
        outputs = gm(*example_inputs)
    return lambda *args: outputs


def aot_guards_only_backend(gm, example_inputs):
    from torch._dynamo.backends.common import aot_autograd

    def returns_first_outputs(g, inputs):
        with torch.no_grad():
            outputs = g(*inputs)
        return lambda *args: outputs

    return aot_autograd(fw_compiler=returns_first_outputs, inference_compiler=returns_first_outputs)(gm, example_inputs)


def compiled(fn, variant):
    if variant == "dynamo-guards":
        return torch.compile(fn, backend=guards_only_backend)
    if variant == "aot-guards":
        return torch.compile(fn, backend=aot_guards_only_backend)
    if variant == "inductor-ro":
        return torch.compile(fn, backend="inductor", mode="reduce-overhead")
    return torch.compile(fn, backend="ember", options=EMBER_OPTIONS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "replay_overhead.json"))
    args = parser.parse_args()
    torch._dynamo.config.suppress_errors = False
    disable_inductor_caches()
    variants = ("dynamo-guards", "ember-ro", "inductor-ro", "ember", "aot-guards")
    results = {}
    with torch.no_grad():
        for name, (fn, inputs) in graphs().items():
            torch._dynamo.reset()
            import ember.backend

            handed = []  # (callable Dynamo got, its example inputs) of the ember-ro compile

            def ember_ro(gm, example_inputs):
                fn_for_dynamo = ember.backend.ember_backend(
                    gm, example_inputs, options={**EMBER_OPTIONS, "cudagraphs": True})
                handed.append((fn_for_dynamo, list(example_inputs)))
                return fn_for_dynamo

            fns = {v: torch.compile(fn, backend=ember_ro) if v == "ember-ro" else compiled(fn, v) for v in variants}
            for f in fns.values():
                for _ in range(5):
                    f(*inputs)
            if len(handed) == 1:
                fns["ember-ro-call"] = lambda *a, _f=handed[0][0], _x=handed[0][1]: _f(*_x)
            static_x = [t.clone() for t in inputs]
            torch_graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*static_x)
                with torch.cuda.graph(torch_graph):
                    fn(*static_x)
            torch.cuda.current_stream().wait_stream(side)
            fns["torch-replay"] = lambda *a: torch_graph.replay()
            for f in fns.values():
                for _ in range(5):
                    f(*inputs)
            settle()
            torch.cuda.synchronize()
            per_call = {v: [] for v in fns}
            for _ in range(args.rounds):
                for v, f in fns.items():
                    host = 0.0
                    for _ in range(args.calls):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        f(*inputs)
                        host += time.perf_counter() - start
                    per_call[v].append(host / args.calls * 1e6)
                    torch.cuda.synchronize()
            us = {v: statistics.median(t) for v, t in per_call.items()}
            results[name] = {v: {"host_us": us[v], "over_guards_us": us[v] - us["dynamo-guards"]} for v in fns}
            print(f"{name:<14} " + "  ".join(f"{v} {us[v]:6.1f} us (+{us[v] - us['dynamo-guards']:.1f})" for v in fns))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine_info("cuda"), "calls": args.calls, "rounds": args.rounds, "results": results}, f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
