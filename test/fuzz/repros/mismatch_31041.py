"""Reproducer found by test/fuzz/graph_fuzz.py (seed 31041, --device cpu --mode default).

mismatch: call 0: output 0: max error 3.14 (allowed 0.0001 x magnitude 3.14); expected -3.14159, got -0
"""

import torch
import torch.nn.functional as F

KIND = 'mismatch'
SEED = 31041
DEVICE = 'cpu'
MODE = 'default'
# Fixed: kernels/cpu/interpreter.cpp Relu is ATen's clamp_min(x, 0) (keeps -0.0); kernels/program.cpp puts the clamps' bound first.
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [1, 2], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': 'torch.round({0})', 'tag': 'round'},
         {'args': ['v0'], 'expr': '{0} * 0.5', 'tag': 'scalar'},
         {'args': ['v0'], 'expr': '{0}.relu_()', 'tag': 'relu_'},
         {'args': ['v1', 'v2'], 'expr': 'torch.atan2({0}, {1})', 'tag': 'atan2'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 2], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.round(i0)
    v1 = v0 * 0.5
    v2 = v0.relu_()
    v3 = torch.atan2(v1, v2)
    return (v3,)
