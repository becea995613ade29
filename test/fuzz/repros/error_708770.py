"""Reproducer found by test/fuzz/graph_fuzz.py (seed 708770, --device cuda --mode reduce-overhead).

error: call 1: SystemError: <class 'UserWarning'> returned a result with an exception set
(behind it: "CUDA cuLaunchKernel failed: invalid argument". The forward's and the backward's matmuls each
became a linear chain on one entry point; the backward's set that entry point's shared-memory limit below
what the forward launches with, so the forward's second call failed. Fixed in kernels/cuda/driver.cpp.)
"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 708770
DEVICE = 'cuda'
MODE = 'reduce-overhead'
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': True, 'layout': 'contig', 'shape': [1, 2], 'special': False}],
 'ops': [{'args': ['i0'],
          'expr': 'torch.matmul({0}, (torch.arange(6, dtype={0}.dtype, device={0}.device).reshape(2, 3) % 7 '
                  '- 3) * 0.1)',
          'tag': 'matmul'},
         {'args': ['v0'],
          'expr': 'torch.matmul({0}, (torch.arange(3, dtype={0}.dtype, device={0}.device).reshape(3, 1) % 7 '
                  '- 3) * 0.1)',
          'tag': 'matmul'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([1, 2], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    t = t.detach().requires_grad_(True)
    out.append(t)
    return out


def program(i0):
    v0 = torch.matmul(i0, (torch.arange(6, dtype=i0.dtype, device=i0.device).reshape(2, 3) % 7 - 3) * 0.1)
    v1 = torch.matmul(v0, (torch.arange(3, dtype=v0.dtype, device=v0.device).reshape(3, 1) % 7 - 3) * 0.1)
    return (v1,)
