"""Reproducer found by test/fuzz/graph_fuzz.py (seed 200718, --device cuda --mode reduce-overhead).

crash: worker died with exit code -6
"""

import torch
import torch.nn.functional as F

KIND = 'crash'
SEED = 200718
DEVICE = 'cuda'
MODE = 'reduce-overhead'
PROGRAM = {'inputs': [{'dtype': 'bfloat16', 'grad': False, 'layout': 'contig', 'shape': [13], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': 'torch.ge({0}, 0.5)', 'tag': 'ge_s'},
         {'args': ['i0'], 'expr': 'torch.log_softmax({0}, dim=0)', 'tag': 'log_softmax'},
         {'args': ['i0'], 'expr': '{0}[1::1]', 'tag': 'slice'},
         {'args': ['v1'], 'expr': '{0}.clamp_(-1, 1)', 'tag': 'clamp_'},
         {'args': ['v2'], 'expr': '{0}.float()', 'tag': 'to_float'},
         {'args': ['v4', 'v2'], 'expr': 'torch.add({0}, {1})', 'tag': 'add'},
         {'args': ['v2', 'v5'], 'expr': 'torch.maximum({0}, {1})', 'tag': 'maximum'},
         {'args': ['v1'],
          'expr': 'torch.index_select({0}, 0, torch.tensor([3, 3], device={0}.device))',
          'tag': 'index_select'},
         {'args': ['v4'], 'expr': 'torch.logsumexp({0}, dim=(0,), keepdim=False)', 'tag': 'logsumexp'},
         {'args': ['v5'], 'expr': 'torch.log_softmax({0}, dim=0)', 'tag': 'log_softmax'},
         {'args': ['v6'], 'expr': 'torch.add({0}, -1.5, alpha=2)', 'tag': 'add_alpha_s'},
         {'args': ['v8'], 'expr': 'torch.mean({0}, )', 'tag': 'mean'},
         {'args': ['v8'], 'expr': 'torch.exp({0}.clamp(-8, 8))', 'tag': 'exp'},
         {'args': ['v8'], 'expr': '{0}.relu_()', 'tag': 'relu_'},
         {'args': ['v4'], 'expr': 'torch.isnan({0})', 'tag': 'isnan'},
         {'args': ['v4', 'v10'], 'expr': 'torch.cat(({0}, {1}), dim=0)', 'tag': 'cat'},
         {'args': ['v11'], 'expr': '{0}.mul_(2)', 'tag': 'mul_'},
         {'args': ['v10'], 'expr': 'torch.reciprocal({0}.abs() + 1)', 'tag': 'reciprocal'},
         {'args': ['v11'], 'expr': '{0}.unsqueeze(-1)', 'tag': 'unsqueeze'},
         {'args': ['v17', 'v11'], 'expr': 'torch.mul({0}, {1})', 'tag': 'mul'},
         {'args': ['v8', 'v15'], 'expr': 'torch.mul({0}, {1})', 'tag': 'mul'},
         {'args': ['v1'], 'expr': 'torch.neg({0})', 'tag': 'neg'},
         {'args': ['v13', 'v18'], 'expr': 'torch.add({0}, {1}, alpha=2)', 'tag': 'add_alpha'},
         {'args': ['v18'], 'expr': 'torch.logsumexp({0}, dim=(0,), keepdim=False)', 'tag': 'logsumexp'},
         {'args': ['v14'], 'expr': '{0}.long()', 'tag': 'to_long'},
         {'args': ['v20'], 'expr': 'torch.linalg.vector_norm({0}, dim=(0,), keepdim=False)', 'tag': 'norm'},
         {'args': ['v20', 'v22'], 'expr': 'torch.maximum({0}, {1})', 'tag': 'maximum'},
         {'args': ['v24'], 'expr': 'torch.lt({0}, -1.5)', 'tag': 'lt_s'},
         {'args': ['v27'], 'expr': 'torch.ge({0}, 2)', 'tag': 'ge_s'},
         {'args': ['v0'], 'expr': '{0}.reshape(-1)', 'tag': 'reshape'},
         {'args': ['v26'], 'expr': '{0}.clamp_(-1, 1)', 'tag': 'clamp_'},
         {'args': ['v21'], 'expr': '{0} + 1', 'tag': 'scalar'},
         {'args': ['v26'], 'expr': '{0}.permute([0])', 'tag': 'permute'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([13], generator=g)
    t = t.to(device=device, dtype=torch.bfloat16)
    out.append(t)
    return out


def program(i0):
    v0 = torch.ge(i0, 0.5)
    v1 = torch.log_softmax(i0, dim=0)
    v2 = i0[1::1]
    v3 = v1.clamp_(-1, 1)
    v4 = v2.float()
    v5 = torch.add(v4, v2)
    v6 = torch.maximum(v2, v5)
    v7 = torch.index_select(v1, 0, torch.tensor([3, 3], device=v1.device))
    v8 = torch.logsumexp(v4, dim=(0,), keepdim=False)
    v9 = torch.log_softmax(v5, dim=0)
    v10 = torch.add(v6, -1.5, alpha=2)
    v11 = torch.mean(v8, )
    v12 = torch.exp(v8.clamp(-8, 8))
    v13 = v8.relu_()
    v14 = torch.isnan(v4)
    v15 = torch.cat((v4, v10), dim=0)
    v16 = v11.mul_(2)
    v17 = torch.reciprocal(v10.abs() + 1)
    v18 = v11.unsqueeze(-1)
    v19 = torch.mul(v17, v11)
    v20 = torch.mul(v8, v15)
    v21 = torch.neg(v1)
    v22 = torch.add(v13, v18, alpha=2)
    v23 = torch.logsumexp(v18, dim=(0,), keepdim=False)
    v24 = v14.long()
    v25 = torch.linalg.vector_norm(v20, dim=(0,), keepdim=False)
    v26 = torch.maximum(v20, v22)
    v27 = torch.lt(v24, -1.5)
    v28 = torch.ge(v27, 2)
    v29 = v0.reshape(-1)
    v30 = v26.clamp_(-1, 1)
    v31 = v21 + 1
    v32 = v26.permute([0])
    return (v3, v7, v9, v12, v16, v19, v23, v25, v28, v29, v30, v31, v32)
