"""Reproducer found by test/fuzz/graph_fuzz.py (seed 2958, --device cpu --mode default).

mismatch: call 0: output 0: max error 6 (allowed 0.001 x magnitude 7.54); expected 7.541, got 1.541
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 2958
DEVICE = 'cpu'
MODE = 'default'
# Fixed: kernels/program.cpp emit() files an instruction that reads no register (alpha * 3) as the node it serves (full or row); lower.py no longer folds alpha.
# A fuzz failure whose shrunk program has these op tags (and this kind of difference) is this bug.
SIGNATURE = {'tags': ['add_alpha_s'], 'differs': None}
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [2, 1, 1, 1], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': 'torch.add({0}, 3, alpha=2)', 'tag': 'add_alpha_s'},
         {'args': ['v0'], 'expr': 'torch.amax({0}, dim=(0, 1), keepdim=True)', 'tag': 'amax'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([2, 1, 1, 1], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.add(i0, 3, alpha=2)
    v1 = torch.amax(v0, dim=(0, 1), keepdim=True)
    return (v1,)
