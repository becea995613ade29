"""Reproducer found by test/fuzz/graph_fuzz.py (seed 1920463, --device cpu --mode max-autotune-no-cudagraphs).

error: call 0: SystemError: <function find_torch_dispatch_rule at 0x7f51772c2fc0> returned a result with an exception set
"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 1920463
DEVICE = 'cpu'
MODE = 'max-autotune-no-cudagraphs'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': True, 'layout': 'contig', 'shape': [1, 5, 1, 1], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}.bfloat16()', 'tag': 'to_bf16'},
         {'args': ['v0'],
          'expr': 'F.conv2d({0}, torch.ones(3, 5, 1, 1, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=1, padding=1)',
          'tag': 'conv2d'},
         {'args': ['v1'], 'expr': '{0}.relu_()', 'tag': 'relu_'},
         {'args': ['v0'], 'expr': '{0}.expand([-1, -1, -1, 3])', 'tag': 'expand'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 5, 1, 1], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t.detach().requires_grad_(True)
    out.append(t)
    return out


def program(i0):
    v0 = i0.bfloat16()
    v1 = F.conv2d(v0, torch.ones(3, 5, 1, 1, dtype=v0.dtype, device=v0.device).cumsum(0) * 0.1, stride=1, padding=1)
    v2 = v1.relu_()
    v3 = v0.expand([-1, -1, -1, 3])
    return (v2, v3)
