"""Reproducer found by test/fuzz/graph_fuzz.py (seed 20335, --device cpu --mode default).

mismatch: call 0: output 0: NaN at 1 positions where the other side has a number
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 20335
DEVICE = 'cpu'
MODE = 'default'
# Fixed: kernels/cpu/interpreter.cpp reduce(): a row sum over no column of a value-only register is 0.
# A fuzz failure whose shrunk program has these op tags (and this kind of difference) is this bug.
SIGNATURE = {'tags': [], 'differs': 'NaN at', 'empty_input': True}
PROGRAM = {'inputs': [{'dtype': 'int32', 'grad': False, 'layout': 'contig', 'shape': [0], 'special': False}],
 'ops': [{'args': ['i0', 'i0'], 'expr': 'torch.div({0}, {1}.abs() + 1)', 'tag': 'div'},
         {'args': ['v0'],
          'expr': 'F.layer_norm({0}, [0], torch.full([0], 1.5, dtype={0}.dtype, device={0}.device), '
                  'torch.full([0], -0.25, dtype={0}.dtype, device={0}.device))',
          'tag': 'layer_norm'},
         {'args': ['v1'], 'expr': 'torch.sum({0}, dim=(0,), keepdim=True)', 'tag': 'sum'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randint(-6, 7, [0], generator=g)
    t = t.to(device=device, dtype=torch.int32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.div(i0, i0.abs() + 1)
    v1 = F.layer_norm(v0, [0], torch.full([0], 1.5, dtype=v0.dtype, device=v0.device), torch.full([0], -0.25, dtype=v0.dtype, device=v0.device))
    v2 = torch.sum(v1, dim=(0,), keepdim=True)
    return (v2,)
