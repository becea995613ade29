"""Higher-order ops under each backend: flex_attention, torch.cond, and a stack of nested_compile_region blocks.

    python bench/hops.py                      # CUDA where available, else the CPU
    python bench/hops.py --device cpu --repeat 20

Per workload and backend (eager, ember, inductor; each compiled in a fresh Dynamo state, caches of neither
compiler cleared): the first call in seconds (compiles included), then the median of --repeat synchronized
calls in ms, and the largest difference from eager's output. Inference only (torch.no_grad).

    flex        flex_attention with a causal block mask and a per-head bias in score_mod (B 4, H 16, L 1024,
                E 64, bf16 on CUDA; B 1, H 4, L 256 in f32 on the CPU): ember runs it as one NVRTC kernel on
                CUDA (flex.py) and dense on the CPU (attention.py), inductor as one generated kernel, eager
                dense (flex_attention without compile)
    flex_long   packed documents under a causal mask with a tanh soft cap (B 2, H 16, L 4096 bf16 on CUDA;
                B 1, H 2, L 512 f32 on the CPU): most key blocks are skipped
    cond        an MLP block whose second half is torch.cond on the batch's mean (both branches taken)
    nested      12 transformer-like blocks (LayerNorm, Linear, GELU, Linear, residual) marked with
                torch.compiler.nested_compile_region, batch 8 x 128 x 512
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness  # noqa: E402


def flex(device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, E, dtype = (4, 16, 1024, 64, torch.bfloat16) if device == "cuda" else (1, 4, 256, 64, torch.float32)
    bias = torch.randn(H, device=device, dtype=dtype)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=device)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h], block_mask=mask)

    return fn, [torch.randn(B, H, L, E, device=device, dtype=dtype) for _ in range(3)]


def flex_long(device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, E, dtype = (2, 16, 4096, 64, torch.bfloat16) if device == "cuda" else (1, 2, 512, 64, torch.float32)
    doc = (torch.arange(L, device=device) * 5 // L).to(torch.int32)  # five documents packed in one sequence
    mask = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, L, L, device=device)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.tanh(s / 20) * 20, block_mask=mask)

    return fn, [torch.randn(B, H, L, E, device=device, dtype=dtype) for _ in range(3)]


def cond(device):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.alt = nn.Linear(256, 1024), nn.Linear(1024, 256), nn.Linear(256, 256)

        def forward(self, x):
            h = F.gelu(self.up(x))
            return torch.cond(x.mean() > 0, lambda h, x: self.down(h) + x, lambda h, x: torch.tanh(self.alt(x)), (h, x))

    return Block().to(device), [torch.randn(64, 256, device=device)]


def nested(device):
    @torch.compiler.nested_compile_region
    def block(x, ln, up, down):
        return x + down(F.gelu(up(ln(x))))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.ModuleList([nn.LayerNorm(512), nn.Linear(512, 2048), nn.Linear(2048, 512)]) for _ in range(12))

        def forward(self, x):
            for ln, up, down in self.layers:
                x = block(x, ln, up, down)
            return x

    return Stack().to(device), [torch.randn(8, 128, 512, device=device)]


WORKLOADS = {"flex": flex, "flex_long": flex_long, "cond": cond, "nested": nested}


def run(name, device, repeat):
    fn, inputs = WORKLOADS[name](device)
    results = {}
    with torch.no_grad():
        reference = fn(*inputs)
        for backend in ("eager", "ember", "inductor"):
            torch._dynamo.reset()
            compiled = fn if backend == "eager" else torch.compile(fn, backend=backend)
            try:
                first, out = harness.timed_call(compiled, inputs, device)
                for _ in range(3):
                    compiled(*inputs)
                times = [harness.timed_call(compiled, inputs, device)[0] for _ in range(repeat)]
            except Exception as e:  # noqa: BLE001 (a backend's failure is a result here)
                results[backend] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
                continue
            err = (out.float() - reference.float()).abs().max().item()
            results[backend] = (first, statistics.median(times) * 1e3, err)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--only", default=",".join(WORKLOADS))
    args = parser.parse_args(argv)
    print(f"{'workload':10} {'backend':9} {'first call s':>12} {'ms per call':>12} {'speedup':>8} {'max |diff|':>11}")
    for name in args.only.split(","):
        results = run(name, args.device, args.repeat)
        eager_ms = results["eager"][1] if isinstance(results.get("eager"), tuple) else None
        for backend, r in results.items():
            if isinstance(r, str):
                print(f"{name:10} {backend:9} {r}")
                continue
            first, ms, err = r
            speedup = f"{eager_ms / ms:7.2f}x" if eager_ms else ""
            print(f"{name:10} {backend:9} {first:12.3f} {ms:12.3f} {speedup:>8} {err:11.2e}")


if __name__ == "__main__":
    main()
