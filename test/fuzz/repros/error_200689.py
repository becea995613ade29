"""Reproducer found by test/fuzz/graph_fuzz.py (seed 200689, --device cuda --mode reduce-overhead).

error: call 1: RuntimeError: unsupported operation: more than one element of the written-to tensor refers to a single memory location. Please clone() the tensor before performing the operation.
"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 200689
DEVICE = 'cuda'
MODE = 'reduce-overhead'
# Fixed: cudagraph/replay.cpp gives an expanded input of a captured part a static buffer over its span (copy_ refuses to write into an overlapping tensor).
PROGRAM = {'inputs': [{'dtype': 'int32', 'grad': False, 'layout': 'contig', 'shape': [1, 1, 7, 1], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}.expand([-1, 3, -1, -1])', 'tag': 'expand'},
         {'args': ['v0'],
          'expr': '{0}[:, :, torch.tensor([1, 3], device={0}.device)]',
          'tag': 'index_tensor'},
         {'args': ['v0', 'v0'], 'expr': 'torch.cat(({0}, {1}), dim=0)', 'tag': 'cat'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randint(-6, 7, [1, 1, 7, 1], generator=g)
    t = t.to(device=device, dtype=torch.int32)
    out.append(t)
    return out


def program(i0):
    v0 = i0.expand([-1, 3, -1, -1])
    v1 = v0[:, :, torch.tensor([1, 3], device=v0.device)]
    v2 = torch.cat((v0, v0), dim=0)
    return (v1, v2)
