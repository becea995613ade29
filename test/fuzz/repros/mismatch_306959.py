"""Reproducer found by test/fuzz/graph_fuzz.py (seed 306959, --device cpu --mode default).

mismatch: call 0: output 0: max error 1 (allowed 0.01 x magnitude 1); expected 0, got 1
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 306959
DEVICE = 'cpu'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float16',
             'grad': False,
             'layout': 'contig',
             'shape': [128, 16, 3, 2],
             'special': False},
            {'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [], 'special': False}],
 'ops': [{'args': ['i0', 'i1'], 'expr': 'torch.ne({0}, {1})', 'tag': 'ne'},
         {'args': ['v0', 'i1'], 'expr': 'torch.maximum({0}, {1})', 'tag': 'maximum'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([128, 16, 3, 2], generator=g)
    t = t.to(device=device, dtype=torch.float16)
    out.append(t)
    t = torch.randn([], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0, i1):
    v0 = torch.ne(i0, i1)
    v1 = torch.maximum(v0, i1)
    return (v1,)
