"""Reproducer found by test/fuzz/graph_fuzz.py (seed 2146, --device cpu --mode default).

mismatch: call 0: output 0: max error 4.34e+03 (allowed 0.0001 x magnitude 6.54); expected 1.70529, got 4342.39
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 2146
DEVICE = 'cpu'
MODE = 'default'
# Fixed: backend/runtime/plan.cpp StaticView sees from two meta probes (input at offset 0 and 1024) that as_strided's offset is absolute, and places the view there.
# A fuzz failure whose shrunk program has these op tags (and this kind of difference) is this bug.
SIGNATURE = {'tags': ['as_strided'], 'differs': None}
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'sliced', 'shape': [0, 5, 1], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}.contiguous().as_strided((2, 2), (2, 1), 1)', 'tag': 'as_strided'},
         {'args': ['v0'], 'expr': '{0} * 3', 'tag': 'scalar'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 5, 1], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t[1::2]
    out.append(t)
    return out


def program(i0):
    v0 = i0.contiguous().as_strided((2, 2), (2, 1), 1)
    v1 = v0 * 3
    return (v1,)
