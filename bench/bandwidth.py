"""Achieved memory bandwidth of large fused kernels: ember and inductor against eager and the device's copy.

    python bench/bandwidth.py                 # CUDA only; well under a minute on an H100/H200
    python bench/bandwidth.py --no-inductor --repeat 10

For each function and dtype it times eager, inductor and ember (torch.compile, ember with fallback="raise"),
and `y.copy_(x)` over the same number of elements as the device's reference bandwidth. Bandwidth is
(bytes read + bytes written) / time, the bytes being what the fused function must move at least: each
input once, each output once. Time: CUDA events around `--inner` back-to-back calls, the median of `--repeat`
such batches (ms, % copy: what a caller sees, the host's per-call work included where it outlasts the
kernels); and the kernels' own time per call under torch.profiler (kernel ms, its % copy against the copy
kernel's time: the kernels' bandwidth). Results: a table on stdout and bench/results/bandwidth_cuda.json.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def silu_add(x, y):
    return x * torch.sigmoid(x) + y


def scaled_softmax(x):
    # Scaled as in attention; ember leaves a lone softmax to ATen (one op gains nothing from fusion).
    return torch.softmax(x * 0.125, -1)


def cases(device):
    """(name, fn, inputs, bytes moved, elements of the reference copy)."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        tag = "f32" if dtype == torch.float32 else "bf16"
        n = 64 * 1024 * 1024
        x, y = (torch.randn(n, device=device, dtype=dtype) for _ in range(2))
        out.append((f"x*sigmoid(x)+y 64M {tag}", silu_add, (x, y), 3 * n * x.element_size(), n))
        rows, cols = 32768, 1024
        s = torch.randn(rows, cols, device=device, dtype=dtype)
        out.append((f"softmax(x/8) 32768x1024 {tag}", scaled_softmax, (s,), 2 * s.numel() * s.element_size(), s.numel()))
    return out


def time_ms(fn, inputs, inner, repeat):
    """Median over `repeat` batches of the per-call time of `inner` back-to-back calls (CUDA events)."""
    for _ in range(3):
        fn(*inputs)
    harness.settle()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn(*inputs)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def kernel_ms(fn, inputs, calls=20):
    """The GPU time per call of fn(*inputs), its kernels' (and copies') durations summed under torch.profiler:
    what the kernels take, without the host's per-call work, which back-to-back calls only hide where it is
    shorter than the kernels (a 40 us softmax measured 47 us per call so on one H200 host)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*inputs)
        torch.cuda.synchronize()
    us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return us / calls / 1e3


def max_rel_error(a, b):
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed batches (median reported)")
    parser.add_argument("--inner", type=int, default=10, help="calls per timed batch")
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "bandwidth_cuda.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bandwidth.py measures GPU kernels: CUDA is not available, nothing to do")
        return 0
    torch._dynamo.config.suppress_errors = False
    torch._dynamo.config.cache_size_limit = 64
    device = "cuda"
    torch.manual_seed(0)
    backends = ["eager"] + ([] if args.no_inductor else ["inductor"]) + ["ember"]
    results = []
    header = (f"{'case':<28} {'backend':<9} {'ms':>8} {'GB/s':>8} {'% copy':>7} {'kernel ms':>9} {'% copy':>7} "
              f"{'vs eager':>8} {'max rel err':>11}")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(header)
    print("-" * len(header))
    with torch.no_grad():
        for name, fn, inputs, nbytes, copy_numel in cases(device):
            src = inputs[0].reshape(-1)[:copy_numel]
            dst = torch.empty_like(src)
            copy_ms = time_ms(lambda: dst.copy_(src), (), args.inner, args.repeat)
            copy_kernel_ms = kernel_ms(lambda: dst.copy_(src), ())
            copy_gbs = 2 * src.numel() * src.element_size() / copy_ms / 1e6
            copy_kernel_gbs = 2 * src.numel() * src.element_size() / copy_kernel_ms / 1e6
            row = {"case": name, "bytes": nbytes, "copy_ms": copy_ms, "copy_GBps": copy_gbs,
                   "copy_kernel_ms": copy_kernel_ms, "backends": {}}
            print(f"{name:<28} {'copy':<9} {copy_ms:8.3f} {copy_gbs:8.0f} {100.0:6.0f}% {copy_kernel_ms:9.3f} {100.0:6.0f}% "
                  f"{'':>8} {'':>11}")
            reference = fn(*inputs)
            eager_ms = None
            for backend in backends:
                torch._dynamo.reset()
                try:
                    if backend == "eager":
                        compiled = fn
                    elif backend == "inductor":
                        compiled = torch.compile(fn, backend="inductor", dynamic=False)
                    else:
                        compiled = torch.compile(fn, backend="ember", dynamic=False, options={"fallback": "raise"})
                    err = max_rel_error(compiled(*inputs), reference)
                    ms = time_ms(compiled, inputs, args.inner, args.repeat)
                    k_ms = kernel_ms(compiled, inputs)
                except Exception as e:  # report and go on: one failing backend must not hide the others
                    row["backends"][backend] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                    print(f"{'':<28} {backend:<9} error: {row['backends'][backend]['error']}")
                    continue
                eager_ms = ms if backend == "eager" else eager_ms
                gbs = nbytes / ms / 1e6
                entry = {"ms": ms, "GBps": gbs, "fraction_of_copy": gbs / copy_gbs, "kernel_ms": k_ms,
                         "kernel_fraction_of_copy": nbytes / k_ms / 1e6 / copy_kernel_gbs, "max_rel_error": err}
                if eager_ms:
                    entry["speedup_vs_eager"] = eager_ms / ms
                row["backends"][backend] = entry
                vs = f"{eager_ms / ms:7.2f}x" if eager_ms else "-"
                print(f"{'':<28} {backend:<9} {ms:8.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.0f}% {k_ms:9.3f} "
                      f"{100 * entry['kernel_fraction_of_copy']:6.0f}% {vs:>8} {err:11.1e}")
            results.append(row)
            del inputs, reference, src, dst
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "repeat": args.repeat,
                   "inner": args.inner, "results": results}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
