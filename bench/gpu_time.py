"""Where a workload's GPU time goes: its kernels under eager and under ember (and inductor), side by side.

    python bench/gpu_time.py bert_b32_s512_bf16
    python bench/gpu_time.py ln_gelu_linear_ln,sin_cos_exp --calls 20 --top 15 --no-inductor

Per bench/harness.py workload (CUDA), each backend compiles and warms up, then torch.profiler records
--calls calls; printed per backend: the GPU time per call summed over kernels (and memcpy / memset), the
kernel count per call, and the --top kernels by GPU time per call. GPU time, not latency: the harness
measures latency; this says which kernels make the difference.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import harness  # noqa: E402


def kernels(fn, inputs, calls, training):
    """{kernel name: (GPU us per call, launches per call)} over `calls` calls of fn(*inputs)."""
    grad = torch.enable_grad if training else torch.no_grad

    def step():
        with grad():
            fn(*inputs)  # a training workload's step runs its backward itself

    for _ in range(3):
        step()
    harness.settle()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    table = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us, n = table.get(e.name, (0.0, 0))
        table[e.name] = (us + e.device_time / calls, n + 1 / calls)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", help="comma-separated bench/harness.py workload names")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--no-inductor", action="store_true")
    args = parser.parse_args()
    for name in args.workloads.split(","):
        w = harness.WORKLOADS[name]
        model, inputs = w.build("cuda")
        backends = ["eager", "ember"] + ([] if args.no_inductor else ["inductor"])
        for backend in backends:
            torch._dynamo.reset()
            if backend == "eager":
                fn = model
            elif backend == "ember":
                fn = torch.compile(model, backend="ember", options=harness.EMBER_OPTIONS)
            else:
                fn = torch.compile(model, backend="inductor")
            table = kernels(fn, inputs, args.calls, w.training)
            total = sum(us for us, _ in table.values())
            launches = sum(n for _, n in table.values())
            print(f"\n{name} {backend}: {total:.1f} us of GPU time per call, {launches:.0f} kernels per call")
            for kernel, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"  {us:9.1f} us  {n:5.1f}x  {kernel[:110]}")


if __name__ == "__main__":
    main()
