"""flex_attention's kernel time under ember and inductor, by shape and mask (CUDA, 16-bit, inference).

    python bench/flex.py                 # every case
    python bench/flex.py --only causal_8k --repeat 50

Per case and backend: milliseconds per call from CUDA events around --repeat back-to-back calls (the GPU's
throughput, Dynamo's and the plan's host time hidden behind it where the kernel is longer), the first call
in seconds (compiles included), and the largest difference from eager's flex_attention on float32 copies of
the inputs. Each backend compiles in a fresh Dynamo state; the caches of neither are cleared.

    causal_1k     B 4, H 16, L 1024, E 64, causal mask, a per-head bias in score_mod (bench/hops.py's flex)
    causal_8k     B 1, H 32, L 8192, E 128, causal mask (an LLM's prefill)
    documents_4k  B 2, H 16, L 4096, E 64, five packed documents under a causal mask, tanh soft cap
    sliding_4k    B 2, H 16, L 4096, E 64, a 256-token causal sliding window, ALiBi slopes per head
    gqa_2k        B 2, H 32 query / 8 key-value heads, L 2048, E 128, causal, enable_gqa
    decode_8k     B 4, H 32 query / 8 key-value heads, 1 query row against 8192 cached keys, E 128 (a decode step)
"""

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def case(name):
    dev, dt = "cuda", torch.bfloat16
    if name == "causal_1k":
        B, H, HKV, L, E = 4, 16, 16, 1024, 64
        bias = torch.randn(H, device=dev, dtype=dt)
        mask_mod, score_mod = (lambda b, h, qi, ki: qi >= ki), (lambda s, b, h, qi, ki: s + bias[h])
    elif name == "causal_8k":
        B, H, HKV, L, E = 1, 32, 32, 8192, 128
        mask_mod, score_mod = (lambda b, h, qi, ki: qi >= ki), None
    elif name == "documents_4k":
        B, H, HKV, L, E = 2, 16, 16, 4096, 64
        doc = (torch.arange(L, device=dev) * 5 // L).to(torch.int32)
        mask_mod = lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi)  # noqa: E731
        score_mod = lambda s, b, h, qi, ki: torch.tanh(s / 20) * 20  # noqa: E731
    elif name == "sliding_4k":
        B, H, HKV, L, E = 2, 16, 16, 4096, 64
        slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=dev)
        mask_mod = lambda b, h, qi, ki: (ki <= qi) & (qi - ki < 256)  # noqa: E731
        score_mod = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki)  # noqa: E731
    elif name == "gqa_2k":
        B, H, HKV, L, E = 2, 32, 8, 2048, 128
        mask_mod, score_mod = (lambda b, h, qi, ki: qi >= ki), None
    elif name == "decode_8k":
        B, H, HKV, L, E = 4, 32, 8, 8192, 128
        position = torch.tensor(L - 1, device=dev)
        mask_mod, score_mod = (lambda b, h, qi, ki: ki <= position + qi), None
    else:
        raise SystemExit(f"unknown case {name}")
    q_len = 1 if name.startswith("decode") else L
    mask = create_block_mask(mask_mod, None, None, q_len, L, device=dev)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=HKV != H)

    inputs = [torch.randn(B, h, length, E, device=dev, dtype=dt) for h, length in ((H, q_len), (HKV, L), (HKV, L))]
    return fn, inputs


CASES = ("causal_1k", "causal_8k", "documents_4k", "sliding_4k", "gqa_2k", "decode_8k")


def run(name, backend, repeat):
    fn, inputs = case(name)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = compiled(*inputs)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ref = fn(*(x.float() for x in inputs))
        err = (out.float() - ref).abs().max().item()
        for _ in range(3):
            compiled(*inputs)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeat):
            compiled(*inputs)
        end.record()
        torch.cuda.synchronize()
    return first, begin.elapsed_time(end) / repeat, err


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--backends", default="ember,inductor", help="comma-separated, of ember and inductor")
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':14} {'backend':9} {'first call s':>12} {'ms per call':>12} {'max |diff|':>11}")
    for name in args.only.split(","):
        rows = {}
        for backend in args.backends.split(","):
            try:
                rows[backend] = run(name, backend, args.repeat)
            except Exception as e:  # noqa: BLE001 (a backend's failure is a result here)
                print(f"{name:14} {backend:9} error: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            first, ms, err = rows[backend]
            print(f"{name:14} {backend:9} {first:12.3f} {ms:12.3f} {err:11.2e}")
        if len(rows) == 2:
            print(f"{'':14} ember / inductor time: {rows['ember'][1] / rows['inductor'][1]:.2f}")


if __name__ == "__main__":
    main()
