"""Reproducer found by test/fuzz/graph_fuzz.py (seed 50243, --device cpu --mode reduce-overhead).

mismatch: call 1: output 0: max error 3.14 (allowed 0.2 x magnitude 3.14); expected 3.14159, got 0
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 50243
DEVICE = 'cpu'
MODE = 'reduce-overhead'
KNOWN_OPEN = "kernels/cpu/matmul_kernel.cpp: oneDNN's matmul accumulates from +0.0, so a product that is -0.0 (K = 1 here; or every product -0.0) comes out +0.0 where ATen's mm (MKL) gives -0.0; only atan2 or a division by the result tells them apart. The weights are a constant folded once, so from call 1 on the matmul runs through oneDNN on packed weights"
# A fuzz failure whose shrunk program has these op tags (and this kind of difference) is this bug.
SIGNATURE = {'tags': ['matmul', 'atan2'], 'differs': None}
PROGRAM = {'inputs': [{'dtype': 'bfloat16', 'grad': False, 'layout': 'contig', 'shape': [1, 8, 1], 'special': True}],
 'ops': [{'args': ['i0'], 'expr': '{0}.float()', 'tag': 'to_float'},
         {'args': ['v0'],
          'expr': 'torch.matmul({0}, (torch.arange(8, dtype={0}.dtype, device={0}.device).reshape(1, 8) % 7 '
                  '- 3) * 0.1)',
          'tag': 'matmul'},
         {'args': ['v0', 'v1'], 'expr': 'torch.atan2({0}, {1})', 'tag': 'atan2'}]}


def _sprinkle(t, g):
    """A few NaN, +-Inf and denormal values at seeded positions."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return t
    for value in (float("nan"), float("inf"), -float("inf"), 1e-41, -3e-39):
        if torch.rand((), generator=g) < 0.5:
            flat[torch.randint(0, flat.numel(), (), generator=g)] = value
    return flat.reshape(t.shape)


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 8, 1], generator=g)
    t = _sprinkle(t, g)
    t = t.to(device=device, dtype=torch.bfloat16)
    out.append(t)
    return out


def program(i0):
    v0 = i0.float()
    v1 = torch.matmul(v0, (torch.arange(8, dtype=v0.dtype, device=v0.device).reshape(1, 8) % 7 - 3) * 0.1)
    v2 = torch.atan2(v0, v1)
    return (v2,)
