"""Where a symbolic graph loses time against a static one: one bench/dynamic.py workload, one way of compiling it,
steady latency against eager at two sizes, and torch.profiler's kernels and host time per size.

    python bench/profile_sizes.py bert dynamic OUT      # Dynamo's automatic dynamic: static first, then symbolic
    python bench/profile_sizes.py bert static OUT       # a static compile per size
    python bench/profile_sizes.py llama inductor OUT    # inductor's automatic dynamic, for comparison

Workloads are bench/dynamic.py's (bert, llama, mlp, convnet). The two sizes are the workload's third and last; the
dynamic and inductor runs first call the first size, so the measured sizes run on the symbolic graph. Eager's
latency is measured in the same process. Prints one line per size and appends the profiler's tables (sorted by GPU
time, then by host time) to OUT/<workload>_<kind>.txt; with `dynamic`, ember's debug dump goes to OUT/dump_<workload>.
Run one process per kind: the numbers are meant to be read side by side. Nothing here asserts a speed.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dynamic  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def steady_ms(fn, args, device):
    """Median milliseconds of 30 synchronized calls, as bench/dynamic.py times each size."""
    return dynamic._steady(fn, args, device, "default", 30) * 1e3


def profile(fn, args, path, title):
    from torch.profiler import ProfilerActivity, profile as record

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    for _ in range(3):
        fn(*args)
    sync()
    with record(activities=activities) as p:
        for _ in range(5):
            fn(*args)
        sync()
    table = p.key_averages()
    with open(path, "a") as f:
        f.write(f"\n===== {title}\n")
        if torch.cuda.is_available():
            f.write(table.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=90))
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90))


def first_tensor(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "last_hidden_state", getattr(out, "logits", out))


def main():
    workload, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if kind not in ("dynamic", "static", "inductor", "eager"):
        raise SystemExit(f"unknown kind {kind!r}: dynamic, static, inductor or eager")
    os.makedirs(out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model, sizes, make = dynamic.WORKLOADS[workload][1](device)
    measured = [sizes[2], sizes[-1]]
    log = os.path.join(out, f"{workload}_{kind}.txt")
    with torch.no_grad():
        eager = {n: steady_ms(model, make(n), device) for n in measured}
        fn = model
        if kind in ("dynamic", "inductor"):
            import ember

            options = {} if kind == "inductor" else {"fallback": "raise", "debug_dir": os.path.join(out, f"dump_{workload}")}
            fn = torch.compile(model, backend="inductor" if kind == "inductor" else "ember", options=options)
            for n in (sizes[0], measured[0]):  # static at the first size, the symbolic recompile at the second
                start = time.perf_counter()
                fn(*make(n))
                sync()
                print(f"{workload} {kind}: first call at size {n}: {time.perf_counter() - start:.3f} s")
            if kind == "dynamic":
                ember.wait_for_compiles()
        for n in measured:
            if kind == "static":
                import ember

                torch._dynamo.reset()
                fn = torch.compile(model, backend="ember", dynamic=False, options={"fallback": "raise"})
                fn(*make(n))
                ember.wait_for_compiles()
            x = make(n)
            ms = steady_ms(fn, x, device)
            err = (first_tensor(fn(*x)) - first_tensor(model(*x))).abs().max().item()
            line = (f"{workload} {kind} size {n}: {ms:.3f} ms, eager {eager[n]:.3f} ms, speedup {eager[n] / ms:.3f}, "
                    f"max abs error {err:.2e}")
            print(line)
            with open(log, "a") as f:
                f.write(line + "\n")
            profile(fn, x, log, f"{kind} size {n}")


if __name__ == "__main__":
    main()
