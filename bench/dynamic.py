"""Sizes that vary: models fed a different batch or length per call, each backend in a process of its own.

    python bench/dynamic.py --device cuda                          # every workload, eager / inductor / ember
    python bench/dynamic.py --device cpu --only mlp,convnet --modes default
    python bench/dynamic.py --device cuda --only bert --backends ember --serve 200 --out bert.json

Workloads (`--list`): BERT-base and a LLaMA-style decoder over prompt lengths, a small convnet and an MLP over batch
sizes. For each workload, backend (inductor, ember) and mode (default, reduce-overhead), two phases, each in a
fresh process whose compile caches start empty:

1. **serving**: `--serve` calls (500) at sizes drawn from the workload's list with a fixed seed, from a fresh
   torch.compile: the wall time, every compile included, and the compiles Dynamo made;
2. **dynamic**: a fresh torch.compile fed the sizes in turn, as Dynamo's automatic dynamic sees them (the first size
   static, a recompile with a symbolic size at the second): each first call's seconds, then each size's steady
   latency (median of `--repeat` calls), and its error against eager at that size. Then (`--static`: which
   backends; all by default) a torch.compile(dynamic=False) per size in the same process, its first call, and its
   steady latency measured alternating with the symbolic graph's at that size (`static_s`, `dynamic_alt_s`):
   what the dynamic graph is compared with. The two stay live side by side (Dynamo keeps a cache entry per
   backend object), and alternating blocks of calls keep the host's drift out of their ratio: on the GPU these
   calls are mostly host time, which moved by 30-50% between processes and within one. Each is also timed alone,
   the static graph then the symbolic one, just before (`static_alone_s`, `dynamic_alone_s`): in reduce-overhead
   on the H100 the MLP's symbolic graph took 52 us a call at batch 7 timed alone and 79 us alternating.

Eager's latency per size comes from the same process as each compiled row (eager's speed varies between
processes), and the table prints each compiled latency as a speedup over that. Nothing here asserts a speed.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import harness  # noqa: E402

MODES = ("default", "reduce-overhead")


# ----------------------------------------------------------------------------------------------------------
# Workloads: (model, sizes, make(size) -> inputs), seeded
# ----------------------------------------------------------------------------------------------------------


def _bert(device):
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig()).eval().to(device)
    batch, sizes = (8, [64, 96, 128, 160, 200, 256, 320, 384]) if device == "cuda" else (1, [16, 24, 32, 48, 64, 96])
    return model, sizes, lambda n: (torch.randint(0, 30000, (batch, n), device=device),)


def _llama(device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=8192, use_cache=False)
    model = LlamaForCausalLM(config).eval().to(device)
    batch, sizes = (4, [64, 96, 128, 192, 256, 384, 512]) if device == "cuda" else (1, [16, 24, 32, 48, 64, 96])
    return model, sizes, lambda n: (torch.randint(0, 8192, (batch, n), device=device),)


def _convnet(device):
    def block(cin, cout, stride):
        return [torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]

    model = torch.nn.Sequential(*block(3, 32, 2), *block(32, 64, 2), *block(64, 64, 1), *block(64, 128, 2),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10))
    model = model.eval().to(device)
    side, sizes = (112, [1, 3, 8, 13, 16, 24, 32]) if device == "cuda" else (64, [1, 2, 3, 5, 8])
    return model, sizes, lambda n: (torch.randn(n, 3, side, side, device=device),)


def _mlp(device):
    model = harness.mlp().eval().to(device)
    sizes = [1, 7, 16, 33, 64, 100, 128, 255, 512] if device == "cuda" else [1, 7, 16, 33, 64, 100, 128]
    return model, sizes, lambda n: (torch.randn(n, 512, device=device),)


WORKLOADS = {
    "bert": ("BertModel(BertConfig()), input_ids over lengths", _bert),
    "llama": ("LlamaForCausalLM, 4 layers of 512, GQA 8/4 heads, no KV cache, input_ids over lengths", _llama),
    "convnet": ("4 conv-BN-ReLU blocks + pool + linear, images over batch sizes", _convnet),
    "mlp": ("MLP 512-1024-1024-10 (ReLU) over batch sizes", _mlp),
}


# ----------------------------------------------------------------------------------------------------------
# One process: one workload, backend and mode
# ----------------------------------------------------------------------------------------------------------


def _compile(model, backend, mode, dynamic=None):
    if backend == "eager":
        return model
    if backend == "dynamo":  # Dynamo alone: its graphs run as traced, the floor under every backend's compile
        return torch.compile(model, backend="eager", dynamic=dynamic)
    kwargs = {} if mode == "default" else {"mode": mode}
    return torch.compile(model, backend=backend, dynamic=dynamic, **kwargs)


def _graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _call(fn, inputs, device, mode):
    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
    return harness.timed_call(fn, inputs, device)


def _steady(fn, inputs, device, mode, repeat):
    for _ in range(3):
        _call(fn, inputs, device, mode)
    return statistics.median(_call(fn, inputs, device, mode)[0] for _ in range(repeat))


def _settle(backend):
    if backend == "ember":
        harness.settle()


PHASES = ("serve", "dynamic")


def _alternating(fa, fb, inputs, device, mode, repeat, block=5):
    """Medians of fa's and fb's latencies, measured in alternating blocks of `block` calls."""
    ta, tb = [], []
    for f in (fa, fb):
        for _ in range(3):
            _call(f, inputs, device, mode)
    while len(ta) < repeat:
        ta += [_call(fa, inputs, device, mode)[0] for _ in range(block)]
        tb += [_call(fb, inputs, device, mode)[0] for _ in range(block)]
    return statistics.median(ta), statistics.median(tb)


def child(name, backend, mode, phase, device, serve, repeat, static=True):
    """One phase of one run, in a process whose compile caches start empty (so each phase's compiles are cold)."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64  # the symbolic graph and a static one per size, side by side
    torch.manual_seed(0)
    model, sizes, make = WORKLOADS[name][1](device)
    inputs = {n: make(n) for n in sizes}
    result = {"sizes": sizes}
    with torch.no_grad():
        if phase == "serve":  # random sizes from a fresh compile, every compile included
            order = random.Random(0).choices(sizes, k=serve)
            fn, before = _compile(model, backend, mode), _graphs()
            harness.sync(device)
            start = time.perf_counter()
            for n in order:
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                fn(*inputs[n])
            harness.sync(device)
            result["serve_s"], result["serve_compiles"] = time.perf_counter() - start, _graphs() - before
            return result

        eager = {n: harness.snapshot(model(*inputs[n])) for n in sizes}
        result["eager_s"] = [_steady(model, inputs[n], device, "default", repeat) for n in sizes]
        # the sizes in turn, then each one's steady latency and error
        fn, before = _compile(model, backend, mode), _graphs()
        result["first_call_s"] = [_call(fn, inputs[n], device, mode)[0] for n in sizes]
        result["compiles"] = _graphs() - before
        _settle(backend)
        result["dynamic_s"] = [_steady(fn, inputs[n], device, mode, repeat) for n in sizes]
        result["error"] = [harness.max_rel_error(harness.snapshot(_call(fn, inputs[n], device, mode)[1]), eager[n])
                           for n in sizes]
        if static:  # each size compiled alone, beside the symbolic graph, timed alternating with it
            for key in ("static_s", "dynamic_alt_s", "static_first_call_s", "static_alone_s", "dynamic_alone_s"):
                result[key] = []
            for n in sizes:
                fs = _compile(model, backend, mode, dynamic=False)
                result["static_first_call_s"].append(_call(fs, inputs[n], device, mode)[0])
                _settle(backend)
                result["static_alone_s"].append(_steady(fs, inputs[n], device, mode, repeat))
                result["dynamic_alone_s"].append(_steady(fn, inputs[n], device, mode, repeat))
                d, s = _alternating(fn, fs, inputs[n], device, mode, repeat)
                result["dynamic_alt_s"].append(d)
                result["static_s"].append(s)
    return result


# ----------------------------------------------------------------------------------------------------------
# The parent: a process per run, then the table
# ----------------------------------------------------------------------------------------------------------


def run_phase(args, name, backend, mode, phase):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, backend, mode, phase, "--device", args.device,
           "--serve", str(args.serve), "--repeat", str(args.repeat)]
    if args.static is not None and backend not in args.static.split(","):
        cmd.append("--no-static")
    env = dict(os.environ)
    caches = tempfile.mkdtemp(prefix="ember-dynamic-")  # every process starts with empty compile caches
    for key in harness.CACHE_ENV:
        env[key] = os.path.join(caches, key.lower())
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"{phase}: over {args.timeout:.0f} s"}
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"failed": f"{phase}: " + " | ".join(tail)[-400:]}


def run_child(args, name, backend, mode):
    """The run's phases, each in a fresh process, merged into one record."""
    result = {"workload": name, "backend": backend, "mode": mode}
    for phase in PHASES:
        part = run_phase(args, name, backend, mode, phase)
        if "failed" in part:
            return {**result, **part}
        result.update(part)
    return result


def print_rows(r):
    label = f"{r['workload']:8} {r['backend']:8} {r['mode']:15}"
    if "failed" in r:
        print(f"{label} FAILED: {r['failed']}")
        return
    speed = lambda es, ts: " ".join(f"{e / t:5.2f}x" for e, t in zip(es, ts))  # noqa: E731
    print(f"{label} sizes        {' '.join(f'{n:>6}' for n in r['sizes'])}")
    print(f"{label} dynamic      {speed(r['eager_s'], r['dynamic_s'])}")
    if r.get("static_s"):
        print(f"{label} static       {speed(r['eager_s'], r['static_s'])}")
        ratios = " ".join(f"{s / d:6.2f}" for s, d in zip(r["static_s"], r["dynamic_alt_s"]))
        print(f"{label} sym/static   {ratios}  (static latency / symbolic, alternating)")
        if r.get("static_alone_s"):
            ratios = " ".join(f"{s / d:6.2f}" for s, d in zip(r["static_alone_s"], r["dynamic_alone_s"]))
            print(f"{label} sym/static   {ratios}  (each timed alone, back to back)")
        print(f"{label} static s     {' '.join(f'{t:6.2f}' for t in r['static_first_call_s'])}  (first calls)")
    print(f"{label} first call s {' '.join(f'{t:6.2f}' for t in r['first_call_s'])}  compiles {r['compiles']}")
    print(f"{label} max error    {max(r['error']):.2e}   serving: {r['serve_s']:.2f} s, {r['serve_compiles']} compiles")


def to_chart(results, machine, command, date, suite):
    """A results file of bench/chart.py's schema: one row per workload and size, bars for each run's symbolic
    graph ("ember", "inductor"; "-ro" in reduce-overhead) and ember's static compile at that size."""
    rows = {}
    for r in results:
        if "failed" in r:
            continue
        tag = "" if r["mode"] == "default" else "-ro"
        for i, n in enumerate(r["sizes"]):
            row = rows.setdefault((r["workload"], n), {})
            row[r["backend"] + tag] = r["eager_s"][i] / r["dynamic_s"][i]
            if r.get("static_s"):
                row[f"{r['backend']}{tag} static"] = r["eager_s"][i] / r["static_s"][i]
    import chart

    return {**chart.header(machine, command, date, suite),
            "rows": [{"workload": f"{w} {n}", "speedup": v} for (w, n), v in rows.items()]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--backends", default="inductor,ember",
                    help="comma-separated: inductor, ember, dynamo (Dynamo alone, backend='eager', default mode: the "
                    "floor under every backend's compile times); eager is always in")
    ap.add_argument("--modes", default=None, help="comma-separated: default, reduce-overhead (default: both on CUDA)")
    ap.add_argument("--serve", type=int, default=500, help="calls in the serving run")
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per size (median reported)")
    ap.add_argument("--static", default=None, help="backends that also get a static compile per size (default: all; "
                    "'none': none)")
    ap.add_argument("--no-static", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    ap.add_argument("--out", default=None, help="JSON path for the results")
    ap.add_argument("--chart", default=None, help="also a results file for bench/chart.py (its schema) at this path")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--child", nargs=4, metavar=("WORKLOAD", "BACKEND", "MODE", "PHASE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for name, (text, _) in WORKLOADS.items():
            print(f"{name:8} {text}")
        return 0
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args.device, args.serve, args.repeat, static=not args.no_static)))
        return 0
    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    modes = (args.modes or ("default,reduce-overhead" if args.device == "cuda" else "default")).split(",")
    results = []
    for name in names:
        for backend in [b for b in args.backends.split(",") if b]:
            for mode in modes:
                print(f"[dynamic] {name} {backend} {mode} ...", file=sys.stderr, flush=True)
                results.append(run_child(args, name, backend, mode))
                print_rows(results[-1])
                sys.stdout.flush()
                if args.out:  # after each process: a run cut short keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump({"machine": harness.machine_info(args.device), "results": results}, f, indent=1)
    if args.out:
        print(f"wrote {args.out}")
    if args.chart:
        machine = harness.machine_info(args.device)
        with open(args.chart, "w") as f:
            json.dump(to_chart(results, machine, "python bench/dynamic.py " + " ".join(argv or sys.argv[1:]),
                               time.strftime("%Y-%m-%d"), f"sizes that vary, {args.device}"), f, indent=1)
        print(f"wrote {args.chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
