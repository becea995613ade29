"""Reproducer found by test/fuzz/graph_fuzz.py (seed 813653, --device cpu --mode default).

error: call 0: RuntimeError: expected src to have a size equal to the slice of self. src size = [7], slice size = [1]
"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 813653
DEVICE = 'cpu'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [7], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': 'torch.split({0}, 3, dim=0)[-1]', 'tag': 'split'},
         {'args': ['i0'], 'expr': 'torch.sum({0}, dim=(0,), keepdim=False)', 'tag': 'sum'},
         {'args': ['v0'], 'expr': '{0}.add_(1)', 'tag': 'add_'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([7], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.split(i0, 3, dim=0)[-1]
    v1 = torch.sum(i0, dim=(0,), keepdim=False)
    v2 = v0.add_(1)
    return (v1, v2)
