"""Reproducer found by test/fuzz/graph_fuzz.py (seed 1800875, --device cpu --mode max-autotune-no-cudagraphs).

mismatch: call 0: output 1: max error 0.381 (allowed 0.2 x magnitude 1); expected 0.119141, got 0.5
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 1800875
DEVICE = 'cpu'
MODE = 'max-autotune-no-cudagraphs'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [2, 128], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0} + 1', 'tag': 'scalar'},
         {'args': ['v0'], 'expr': 'torch.sum({0}, dim=(0, 1), keepdim=False)', 'tag': 'sum'},
         {'args': ['i0'], 'expr': '{0}.bfloat16()', 'tag': 'to_bf16'},
         {'args': ['v2', 'v1'], 'expr': 'torch.sub({0}, {1})', 'tag': 'sub'},
         {'args': ['v3'], 'expr': 'torch.erf({0})', 'tag': 'erf'},
         {'args': ['v3'], 'expr': 'torch.softmax({0}, dim=0)', 'tag': 'softmax'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([2, 128], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = i0 + 1
    v1 = torch.sum(v0, dim=(0, 1), keepdim=False)
    v2 = i0.bfloat16()
    v3 = torch.sub(v2, v1)
    v4 = torch.erf(v3)
    v5 = torch.softmax(v3, dim=0)
    return (v4, v5)
