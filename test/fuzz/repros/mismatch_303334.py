"""Reproducer found by test/fuzz/graph_fuzz.py (seed 303334, --device cpu --mode default).

mismatch: call 0: output 0: max error 1 (allowed 0.02 x magnitude 2.11); expected 1, got 0
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 303334
DEVICE = 'cpu'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [], 'special': False},
            {'dtype': 'bool', 'grad': False, 'layout': 'contig', 'shape': [], 'special': False},
            {'dtype': 'bfloat16', 'grad': False, 'layout': 'contig', 'shape': [1, 5, 11], 'special': False}],
 'ops': [{'args': ['i2', 'i0'], 'expr': 'torch.ne({0}, {1})', 'tag': 'ne'},
         {'args': ['i1', 'v0'], 'expr': 'torch.ge({0}, {1})', 'tag': 'ge'},
         {'args': ['i2', 'v1'], 'expr': 'torch.minimum({0}, {1})', 'tag': 'minimum'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    t = (torch.rand([], generator=g) > 0.5)
    t = t.to(device=device, dtype=torch.bool)
    out.append(t)
    t = torch.randn([1, 5, 11], generator=g)
    t = t.to(device=device, dtype=torch.bfloat16)
    out.append(t)
    return out


def program(i0, i1, i2):
    v0 = torch.ne(i2, i0)
    v1 = torch.ge(i1, v0)
    v2 = torch.minimum(i2, v1)
    return (v2,)
