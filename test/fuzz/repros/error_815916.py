"""Reproducer found by test/fuzz/graph_fuzz.py (seed 815916, --device cpu --mode default).

error: call 0: EmberError: fused kernel: inputs do not broadcast
"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 815916
DEVICE = 'cpu'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': True, 'layout': 'contig', 'shape': [2, 2], 'special': False},
            {'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [0, 0], 'special': False}],
 'ops': [{'args': ['i1'], 'expr': '{0}.float()', 'tag': 'to_float'},
         {'args': ['i0'], 'expr': '{0}.view([] + [-1])', 'tag': 'view'},
         {'args': ['i0'], 'expr': 'torch.logsumexp({0}, dim=(0, 1), keepdim=True)', 'tag': 'logsumexp'},
         {'args': ['v2'], 'expr': '{0} * 3', 'tag': 'scalar'},
         {'args': ['v1', 'v2'], 'expr': 'torch.add({0}, {1}, alpha=2)', 'tag': 'add_alpha'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([2, 2], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t.detach().requires_grad_(True)
    out.append(t)
    t = torch.randn([0, 0], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0, i1):
    v0 = i1.float()
    v1 = i0.view([] + [-1])
    v2 = torch.logsumexp(i0, dim=(0, 1), keepdim=True)
    v3 = v2 * 3
    v4 = torch.add(v1, v2, alpha=2)
    return (v0, v3, v4)
