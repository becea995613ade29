"""Reproducer found by test/fuzz/graph_fuzz.py (seed 1943321, --device cpu --mode max-autotune).

mismatch: call 0: output 0: max error 1.09 (allowed 0.001 x magnitude 1.19); expected 1.18988, got 0.0949383
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 1943321
DEVICE = 'cpu'
MODE = 'max-autotune'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32',
             'grad': False,
             'layout': 'contig',
             'shape': [1, 1, 13, 1],
             'special': False}],
 'ops': [{'args': ['i0'],
          'expr': 'torch.matmul({0}, (torch.arange(1, dtype={0}.dtype, device={0}.device).reshape(1, 1) % 7 '
                  '- 3) * 0.1)',
          'tag': 'matmul'},
         {'args': ['v0'], 'expr': '{0} * 0.5', 'tag': 'scalar'},
         {'args': ['v1'], 'expr': 'F.silu({0})', 'tag': 'silu'},
         {'args': ['v2'], 'expr': '{0} + 1', 'tag': 'scalar'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 1, 13, 1], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.matmul(i0, (torch.arange(1, dtype=i0.dtype, device=i0.device).reshape(1, 1) % 7 - 3) * 0.1)
    v1 = v0 * 0.5
    v2 = F.silu(v1)
    v3 = v2 + 1
    return (v3,)
