"""Reproducer found by test/fuzz/graph_fuzz.py (seed 113083, --device cuda --mode default).

hang: no result after 60.0 s (H200, torch 2.11; the fuzzer's process was then killed, SIGKILL, while shrinking it)
"""

import torch
import torch.nn.functional as F

KIND = 'hang'
SEED = 113083
DEVICE = 'cuda'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'sliced', 'shape': [], 'special': False},
            {'dtype': 'int64',
             'grad': False,
             'layout': 'channels_last',
             'shape': [16, 11, 1031, 1],
             'special': False}],
 'ops': [{'args': ['i0', 'i1'], 'expr': 'torch.add({0}, {1}, alpha=2)', 'tag': 'add_alpha'},
         {'args': ['i1'], 'expr': '{0}.flatten()', 'tag': 'flatten'},
         {'args': ['i0'], 'expr': '{0} * 3', 'tag': 'scalar'},
         {'args': ['i1'], 'expr': '{0}.half()', 'tag': 'to_half'},
         {'args': ['v1'], 'expr': '{0}.expand([-1])', 'tag': 'expand'},
         {'args': ['v4'], 'expr': 'torch.sum({0}, dim=(0,), keepdim=False)', 'tag': 'sum'},
         {'args': ['v5'], 'expr': '{0}.bfloat16()', 'tag': 'to_bf16'},
         {'args': ['i1'], 'expr': 'torch.split({0}, 1, dim=2)[0]', 'tag': 'split'},
         {'args': ['v6'], 'expr': '{0} + 1', 'tag': 'scalar'},
         {'args': ['v5'], 'expr': '{0}.unsqueeze(-1)', 'tag': 'unsqueeze'},
         {'args': ['v3'], 'expr': '{0}.to(torch.int32)', 'tag': 'to_int'},
         {'args': ['v8'], 'expr': 'F.dropout({0}, p=0.3, training=False)', 'tag': 'dropout'},
         {'args': ['v5'], 'expr': '{0}.unsqueeze(0)', 'tag': 'unsqueeze'},
         {'args': ['v9'], 'expr': '{0}.mul_(2)', 'tag': 'mul_'},
         {'args': ['v6'], 'expr': 'torch.neg({0})', 'tag': 'neg'},
         {'args': ['v6'], 'expr': '{0} * 3', 'tag': 'scalar'},
         {'args': ['v9'], 'expr': 'torch.lt({0}, -1.5)', 'tag': 'lt_s'},
         {'args': ['v10', 'v8'], 'expr': 'torch.maximum({0}, {1})', 'tag': 'maximum'},
         {'args': ['v16', 'v9'], 'expr': 'torch.where({0}, {1}, 1)', 'tag': 'where_s'},
         {'args': ['v13'], 'expr': 'torch.any({0})', 'tag': 'any'},
         {'args': ['v17'], 'expr': '{0}[torch.tensor([1, 4, 8], device={0}.device)]', 'tag': 'index_tensor'},
         {'args': ['v10'],
          'expr': 'torch.remainder({0}, torch.ones_like({0}).abs() + 1)',
          'tag': 'remainder_s'},
         {'args': ['v21', 'v16'], 'expr': 'torch.add({0}, {1})', 'tag': 'add'},
         {'args': ['v20'], 'expr': 'torch.cumsum({0}, dim=0)', 'tag': 'cumsum'},
         {'args': ['v6'], 'expr': '{0}.unsqueeze(-1)', 'tag': 'unsqueeze'},
         {'args': ['v15'], 'expr': 'torch.sqrt({0}.abs())', 'tag': 'sqrt'},
         {'args': ['v14'], 'expr': '{0}.relu_()', 'tag': 'relu_'},
         {'args': ['v17'], 'expr': 'torch.rsqrt({0}.abs() + 0.5)', 'tag': 'rsqrt'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    t = torch.randint(-6, 7, [16, 11, 1031, 1], generator=g)
    t = t.to(device=device, dtype=torch.int64)
    t = t.contiguous(memory_format=torch.channels_last)
    out.append(t)
    return out


def program(i0, i1):
    v0 = torch.add(i0, i1, alpha=2)
    v1 = i1.flatten()
    v2 = i0 * 3
    v3 = i1.half()
    v4 = v1.expand([-1])
    v5 = torch.sum(v4, dim=(0,), keepdim=False)
    v6 = v5.bfloat16()
    v7 = torch.split(i1, 1, dim=2)[0]
    v8 = v6 + 1
    v9 = v5.unsqueeze(-1)
    v10 = v3.to(torch.int32)
    v11 = F.dropout(v8, p=0.3, training=False)
    v12 = v5.unsqueeze(0)
    v13 = v9.mul_(2)
    v14 = torch.neg(v6)
    v15 = v6 * 3
    v16 = torch.lt(v9, -1.5)
    v17 = torch.maximum(v10, v8)
    v18 = torch.where(v16, v9, 1)
    v19 = torch.any(v13)
    v20 = v17[torch.tensor([1, 4, 8], device=v17.device)]
    v21 = torch.remainder(v10, torch.ones_like(v10).abs() + 1)
    v22 = torch.add(v21, v16)
    v23 = torch.cumsum(v20, dim=0)
    v24 = v6.unsqueeze(-1)
    v25 = torch.sqrt(v15.abs())
    v26 = v14.relu_()
    v27 = torch.rsqrt(v17.abs() + 0.5)
    return (v0, v2, v7, v11, v12, v18, v19, v22, v23, v24, v25, v26, v27)
