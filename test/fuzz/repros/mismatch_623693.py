"""Reproducer found by test/fuzz/graph_fuzz.py (seed 623693, --device cpu --mode default).

mismatch: call 0: output 0: NaN at 3 positions where the other side has a number
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 623693
DEVICE = 'cpu'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [1, 1, 3, 2], 'special': False},
            {'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [0, 0, 0, 0], 'special': False}],
 'ops': [{'args': ['i1'], 'expr': 'torch.logsumexp({0}, dim=(0, 1, 2, 3), keepdim=True)', 'tag': 'logsumexp'},
         {'args': ['i0'], 'expr': '{0}.permute([1, 0, 3, 2])', 'tag': 'permute'},
         {'args': ['v1', 'v0'], 'expr': 'torch.add({0}, {1}, alpha=2)', 'tag': 'add_alpha'},
         {'args': ['v2'],
          'expr': 'torch.matmul({0}, (torch.arange(9, dtype={0}.dtype, device={0}.device).reshape(3, 3) % 7 '
                  '- 3) * 0.1)',
          'tag': 'matmul'},
         {'args': ['v3'],
          'expr': 'F.conv2d({0}, torch.ones(3, 1, 1, 1, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=2, padding=1)',
          'tag': 'conv2d'},
         {'args': ['v4'], 'expr': 'torch.sigmoid({0})', 'tag': 'sigmoid'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 1, 3, 2], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    t = torch.randn([0, 0, 0, 0], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0, i1):
    v0 = torch.logsumexp(i1, dim=(0, 1, 2, 3), keepdim=True)
    v1 = i0.permute([1, 0, 3, 2])
    v2 = torch.add(v1, v0, alpha=2)
    v3 = torch.matmul(v2, (torch.arange(9, dtype=v2.dtype, device=v2.device).reshape(3, 3) % 7 - 3) * 0.1)
    v4 = F.conv2d(v3, torch.ones(3, 1, 1, 1, dtype=v3.dtype, device=v3.device).cumsum(0) * 0.1, stride=2, padding=1)
    v5 = torch.sigmoid(v4)
    return (v5,)
