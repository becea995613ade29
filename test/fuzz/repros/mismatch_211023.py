"""Reproducer found by test/fuzz/graph_fuzz.py (seed 211023, --device cuda --mode reduce-overhead).

mismatch: call 1: output 0: max error 0.819 (allowed 0.001 x magnitude 1); expected 0.455895, got -0.363281
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 211023
DEVICE = 'cuda'
MODE = 'reduce-overhead'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'sliced', 'shape': [1, 11], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}.contiguous().as_strided((2, 5), (5, 1), 1)', 'tag': 'as_strided'},
         {'args': ['v0'],
          'expr': 'torch.matmul({0}, (torch.arange(5, dtype={0}.dtype, device={0}.device).reshape(5, 1) % 7 '
                  '- 3) * 0.1)',
          'tag': 'matmul'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([3, 11], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t[1::2]
    out.append(t)
    return out


def program(i0):
    v0 = i0.contiguous().as_strided((2, 5), (5, 1), 1)
    v1 = torch.matmul(v0, (torch.arange(5, dtype=v0.dtype, device=v0.device).reshape(5, 1) % 7 - 3) * 0.1)
    return (v1,)
