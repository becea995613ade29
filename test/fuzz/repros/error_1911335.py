"""Reproducer found by test/fuzz/graph_fuzz.py (seed 1911335, --device cpu --mode max-autotune-no-cudagraphs).

error: call 0: RuntimeError: required rank 4 tensor to use channels_last format (ember: while running %cat_rh11_clone_1 = aten::clone)
"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 1911335
DEVICE = 'cpu'
MODE = 'max-autotune-no-cudagraphs'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32',
             'grad': False,
             'layout': 'contig',
             'shape': [0, 2, 11, 2],
             'special': False}],
 'ops': [{'args': ['i0'], 'expr': 'torch.cat((-{0}[..., 1:], {0}[..., :1]), dim=-1)', 'tag': 'rotate_half'},
         {'args': ['i0'], 'expr': '{0}.transpose(1, 2)', 'tag': 'transpose'},
         {'args': ['v0'],
          'expr': '{0}[:, :, :, torch.tensor([0, 0, 0], device={0}.device)]',
          'tag': 'index_tensor'},
         {'args': ['v1'],
          'expr': 'F.conv2d({0}, torch.ones(3, 11, 3, 3, dtype={0}.dtype, device={0}.device).cumsum(0) * '
                  '0.1, stride=2, padding=1)',
          'tag': 'conv2d'},
         {'args': ['v0'],
          'expr': 'F.conv2d({0}, torch.ones(3, 2, 1, 1, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=2, padding=0)',
          'tag': 'conv2d'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([0, 2, 11, 2], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0):
    v0 = torch.cat((-i0[..., 1:], i0[..., :1]), dim=-1)
    v1 = i0.transpose(1, 2)
    v2 = v0[:, :, :, torch.tensor([0, 0, 0], device=v0.device)]
    v3 = F.conv2d(v1, torch.ones(3, 11, 3, 3, dtype=v1.dtype, device=v1.device).cumsum(0) * 0.1, stride=2, padding=1)
    v4 = F.conv2d(v0, torch.ones(3, 2, 1, 1, dtype=v0.dtype, device=v0.device).cumsum(0) * 0.1, stride=2, padding=0)
    return (v2, v3, v4)
