"""Deployment side by side: ember.export + ember::load against AOTInductor (aoti_compile_and_package +
aoti_load_package), on the same models, in one script.

    python bench/export_bench.py --device cpu --models mlp,transformer_layer
    python bench/export_bench.py --device cuda                   # mlp, transformer_layer, resnet18
    python bench/export_bench.py --device cuda --no-aoti         # ember only

Per model and system it records
    export_s        nn.Module -> package file: torch.export included, for both (inductor's caches and
                    ember's kernel disk cache off, so both compile from scratch)
    package_bytes   the package file's size
    latency_ms      also for eager, as the reference; the systems alternate call by call
    load_ms         loading the package in a fresh process (torch, ember and the CUDA context already up;
                    the median of --load-repeats processes)
    latency_ms      the median of --repeat calls after --warmup (each call synchronized on CUDA)
    max_abs_error   against eager on the same inputs
and for ember the ratios the issue asks about: export_s / aoti export_s (target <= 0.2), latency_ms / aoti
latency_ms (<= 1.0), and load_ms (resnet18: <= 100 ms).

JSON goes to --json (default bench/results/export_<device>.json).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Both systems compile from scratch: inductor's caches and ember's kernel disk cache are off.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("EMBER_CACHE_DIR", "off")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def build(name, device):
    """(model, example inputs); CPU shapes are smaller where a few cores would take long."""
    cpu = device == "cpu"
    if name == "mlp":
        model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
        return model, (torch.randn(16 if cpu else 64, 512),)
    if name == "transformer_layer":
        model = nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024, dropout=0.0, batch_first=True)
        return model, (torch.randn(2 if cpu else 8, 64 if cpu else 128, 256),)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(), (torch.randn(1 if cpu else 8, 3, 224, 224),)
    raise SystemExit(f"unknown model {name}")


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def latency_ms(runs, inputs, device, warmup, repeat):
    """Median milliseconds per call for each of `runs` (name -> fn), alternating call by call so that
    a busy machine slows every system alike."""
    times = {name: [] for name in runs}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in runs.values():
                fn(inputs)
        sync(device)
        for _ in range(repeat):
            for name, fn in runs.items():
                start = time.perf_counter()
                fn(inputs)
                sync(device)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


# Run in a fresh interpreter: prints the milliseconds one load took.
LOAD_SCRIPT = r"""
import sys, time, torch
kind, path, device = sys.argv[1:4]
if device == "cuda":
    torch.empty(1, device="cuda"); torch.cuda.synchronize()
if kind == "ember":
    import ember, ember._C
    from ember.backend import _hint_nvrtc
    _hint_nvrtc()
    start = time.perf_counter()
    ember.load(path, device)
else:
    import torch._inductor
    start = time.perf_counter()
    torch._inductor.aoti_load_package(path)
if device == "cuda":
    torch.cuda.synchronize()
print((time.perf_counter() - start) * 1e3)
"""


def load_ms(kind, path, device, repeats):
    times = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, kind, path, device], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def max_abs_error(outputs, expected):
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    return max(float((o.float() - e.float()).abs().max()) for o, e in zip(outputs, expected))


def bench_ember(model, inputs, device, workdir, args):
    import ember

    os.makedirs(workdir)
    path = os.path.join(workdir, "model.ember")
    start = time.perf_counter()
    info = ember.export(model, inputs, path, device=device)
    export_s = time.perf_counter() - start
    loaded = ember.load(path, device)
    run = lambda xs: loaded.run(list(xs))  # noqa: E731
    with torch.no_grad():
        error = max_abs_error(run(inputs), model(*inputs))
    result = dict(export_s=export_s, export_breakdown_s=info["seconds"], kernel_images=info["kernel_images"],
                  package_bytes=os.path.getsize(path), load_ms=load_ms("ember", path, device, args.load_repeats),
                  max_abs_error=error)
    if device == "cuda":  # the same package loaded with CUDA graphs (LoadOptions::reduce_overhead)
        replayed = ember.load(path, device, reduce_overhead=True)
        result["_ro_run"] = lambda xs: replayed.run(list(xs))  # noqa: E731
    return result, run


def bench_aoti(model, inputs, device, workdir, args):
    import torch._inductor

    os.makedirs(workdir)
    path = os.path.join(workdir, "model.pt2")
    start = time.perf_counter()
    ep = torch.export.export(model, inputs)
    torch._inductor.aoti_compile_and_package(ep, package_path=path)
    export_s = time.perf_counter() - start
    runner = torch._inductor.aoti_load_package(path)
    run = lambda xs: runner(*xs)  # noqa: E731
    with torch.no_grad():
        error = max_abs_error(run(inputs), model(*inputs))
    return dict(export_s=export_s, package_bytes=os.path.getsize(path),
                load_ms=load_ms("aoti", path, device, args.load_repeats), max_abs_error=error), run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default=None, help="comma-separated (default: mlp,transformer_layer[,resnet18])")
    parser.add_argument("--no-aoti", action="store_true")
    parser.add_argument("--systems", default="ember,aoti",
                        help="comma-separated subset of ember,aoti (one process each keeps a crash in one from hiding the other)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--load-repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.models:
        names = args.models.split(",")
    else:
        names = ["mlp", "transformer_layer"]
        try:
            import torchvision  # noqa: F401

            names.append("resnet18")
        except ImportError:
            pass
    results = dict(device=args.device, torch=torch.__version__,
                   gpu=torch.cuda.get_device_name() if args.device == "cuda" else None, models={})
    for name in names:
        model, inputs = build(name, args.device)
        model = model.eval().to(args.device)
        inputs = tuple(x.to(args.device) for x in inputs)
        row, runs = {}, {"eager": lambda xs: model(*xs)}
        wanted = set(args.systems.split(",")) - ({"aoti"} if args.no_aoti else set())
        systems = [(n, f) for n, f in (("ember", bench_ember), ("aoti", bench_aoti)) if n in wanted]
        with tempfile.TemporaryDirectory() as workdir:
            for system, fn in systems:
                try:
                    row[system], runs[system] = fn(model, inputs, args.device, os.path.join(workdir, system), args)
                except Exception as e:  # noqa: BLE001 -- one system failing must not hide the other's numbers
                    row[system] = dict(error=f"{type(e).__name__}: {e}"[:2000])
            if "_ro_run" in row.get("ember", {}):
                runs["ember-ro"] = row["ember"].pop("_ro_run")
            for system, ms in latency_ms(runs, inputs, args.device, args.warmup, args.repeat).items():
                row.setdefault(system, {})["latency_ms"] = ms
        for system in row:
            print(f"{name} {system}: {json.dumps(row[system])}", flush=True)
        e, a = row.get("ember", {}), row.get("aoti", {})
        if "export_s" in e and "export_s" in a:
            row["ratios"] = dict(export=e["export_s"] / a["export_s"], latency=e["latency_ms"] / a["latency_ms"],
                                 load=e["load_ms"] / a["load_ms"], size=e["package_bytes"] / a["package_bytes"])
            if "latency_ms" in row.get("ember-ro", {}):
                row["ratios"]["latency_ro"] = row["ember-ro"]["latency_ms"] / a["latency_ms"]
        results["models"][name] = row

    print(f"\n{'model':<20}{'system':<8}{'export s':>10}{'load ms':>10}{'latency ms':>12}{'MB':>9}{'max err':>10}")
    for name, row in results["models"].items():
        print(f"{name:<20}{'eager':<8}{'':>10}{'':>10}{row['eager']['latency_ms']:>12.3f}")
        if "ember-ro" in row:
            print(f"{name:<20}{'ember-ro':<8}{'':>10}{'':>10}{row['ember-ro']['latency_ms']:>12.3f}")
        for system in ("ember", "aoti"):
            r = row.get(system)
            if r is None:
                continue
            if "error" in r:
                print(f"{name:<20}{system:<8}  error: {r['error'][:80]}")
                continue
            print(f"{name:<20}{system:<8}{r['export_s']:>10.2f}{r['load_ms']:>10.1f}{r['latency_ms']:>12.3f}"
                  f"{r['package_bytes'] / 1e6:>9.2f}{r['max_abs_error']:>10.1e}")
        if "ratios" in row:
            print(f"{'':<20}{'ratio':<8}" + "  ".join(f"{k}={v:.2f}" for k, v in row["ratios"].items()))
    path = args.json or os.path.join(RESULTS_DIR, f"export_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
