"""Reproducer found by test/fuzz/graph_fuzz.py (seed 1257, --device cpu --mode default).

mismatch: call 0: output 0: max error 4.92 (allowed 0.0001 x magnitude 3.93); expected 2.30252, got -2.61332
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 1257
DEVICE = 'cpu'
MODE = 'default'
# Fixed: backend/runtime/plan.cpp StaticView sees from two meta probes (input at offset 0 and 1024) that as_strided's offset is absolute, and places the view there.
# A fuzz failure whose shrunk program has these op tags (and this kind of difference) is this bug.
SIGNATURE = {'tags': ['as_strided'], 'differs': None}
PROGRAM = {'inputs': [{'dtype': 'float32',
             'grad': False,
             'layout': 'transposed',
             'shape': [4, 11, 16],
             'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}.contiguous().as_strided((2, 191), (191, 1), 1)', 'tag': 'as_strided'},
         {'args': ['v0'], 'expr': '{0}.contiguous().as_strided((3, 127), (127, 1), 1)', 'tag': 'as_strided'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([4, 16, 11], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t.transpose(-1, -2)
    out.append(t)
    return out


def program(i0):
    v0 = i0.contiguous().as_strided((2, 191), (191, 1), 1)
    v1 = v0.contiguous().as_strided((3, 127), (127, 1), 1)
    return (v1,)
