"""Reproducer found by test/fuzz/graph_fuzz.py (seed 2846, --device cpu --mode default).

mismatch: call 0: output 0: NaN at 3 positions where the other side has a number
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 2846
DEVICE = 'cpu'
MODE = 'default'
# Fixed: kernels/cpu/epilogue_support.h library_exact_ops: a relu after a oneDNN convolution or matmul runs through ATen on the library's result.
# A fuzz failure whose shrunk program has these op tags (and this kind of difference) is this bug.
SIGNATURE = {'tags': ['conv2d'], 'differs': 'NaN at'}
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [2, 5, 1, 2], 'special': True}],
 'ops': [{'args': ['i0'], 'expr': 'torch.split({0}, 2, dim=1)[-1]', 'tag': 'split'},
         {'args': ['v0'],
          'expr': '{0}[:, :, :, torch.tensor([0, 1], device={0}.device)]',
          'tag': 'index_tensor'},
         {'args': ['v1'],
          'expr': 'F.conv2d({0}, torch.ones(3, 1, 2, 2, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=2, padding=1)',
          'tag': 'conv2d'},
         {'args': ['v2'], 'expr': '{0}.relu_()', 'tag': 'relu_'}]}


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
    t = torch.randn([2, 5, 1, 2], generator=g)
    t = _sprinkle(t, g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.split(i0, 2, dim=1)[-1]
    v1 = v0[:, :, :, torch.tensor([0, 1], device=v0.device)]
    v2 = F.conv2d(v1, torch.ones(3, 1, 2, 2, dtype=v1.dtype, device=v1.device).cumsum(0) * 0.1, stride=2, padding=1)
    v3 = v2.relu_()
    return (v3,)
