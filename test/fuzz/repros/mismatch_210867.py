"""Reproducer found by test/fuzz/graph_fuzz.py (seed 210867, --device cuda --mode reduce-overhead).

mismatch: call 1: output 0: max error 6.31 (allowed 0.001 x magnitude 4.56); expected -4.55577, got -10.8625
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 210867
DEVICE = 'cuda'
MODE = 'reduce-overhead'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'sliced', 'shape': [1, 7, 8], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}.contiguous().as_strided((2, 27), (27, 1), 1)', 'tag': 'as_strided'},
         {'args': ['v0'], 'expr': 'torch.sum({0}, dim=(0, 1), keepdim=False)', 'tag': 'sum'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([3, 7, 8], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t[1::2]
    out.append(t)
    return out


def program(i0):
    v0 = i0.contiguous().as_strided((2, 27), (27, 1), 1)
    v1 = torch.sum(v0, dim=(0, 1), keepdim=False)
    return (v1,)
