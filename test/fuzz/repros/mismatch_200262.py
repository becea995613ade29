"""Reproducer found by test/fuzz/graph_fuzz.py (seed 200262, --device cuda --mode reduce-overhead).

mismatch: call 2: output 1: max error 0.00184 (allowed 0.001 x magnitude 1); expected -0.273839, got -0.271999
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 200262
DEVICE = 'cuda'
MODE = 'reduce-overhead'
# Fixed: test/fuzz/check.py compares with cuDNN TF32 off on both sides (ember's channels_last convolutions use other algorithms, whose TF32 rounding differs by ~1e-3).
PROGRAM = {'inputs': [{'dtype': 'float32',
             'grad': False,
             'layout': 'contig',
             'shape': [2, 8, 16, 11],
             'special': False}],
 'ops': [{'args': ['i0'],
          'expr': 'F.conv2d({0}, torch.ones(4, 8, 2, 2, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=2, padding=0)',
          'tag': 'conv2d'},
         {'args': ['i0'],
          'expr': 'F.conv2d({0}, torch.ones(4, 8, 3, 3, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=1, padding=0)',
          'tag': 'conv2d'},
         {'args': ['v1', 'v1'], 'expr': 'torch.cat(({0}, {1}), dim=3)', 'tag': 'cat'},
         {'args': ['v2'],
          'expr': 'torch.matmul({0}, (torch.arange(18, dtype={0}.dtype, device={0}.device).reshape(18, 1) % '
                  '7 - 3) * 0.1)',
          'tag': 'matmul'},
         {'args': ['v3'], 'expr': 'torch.prod({0}.tanh(), dim=3)', 'tag': 'prod'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([2, 8, 16, 11], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = F.conv2d(i0, torch.ones(4, 8, 2, 2, dtype=i0.dtype, device=i0.device).cumsum(0) * 0.1, stride=2, padding=0)
    v1 = F.conv2d(i0, torch.ones(4, 8, 3, 3, dtype=i0.dtype, device=i0.device).cumsum(0) * 0.1, stride=1, padding=0)
    v2 = torch.cat((v1, v1), dim=3)
    v3 = torch.matmul(v2, (torch.arange(18, dtype=v2.dtype, device=v2.device).reshape(18, 1) % 7 - 3) * 0.1)
    v4 = torch.prod(v3.tanh(), dim=3)
    return (v0, v4)
