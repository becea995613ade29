"""Reproducer found by test/fuzz/graph_fuzz.py (seed 813074, --device cpu --mode default).

error: call 0: BackendCompilerFailed: backend='ember' raised:
ValueError: Cannot view a tensor with shape torch.Size([3, 2, 3, 3]) and strides (3, 9, 18, 1) as a tensor with shape (3, 2, 9)!

While executing %v5 : [num_users=1] = call_method[target=view](args = (%v4, [3, 2, -1]), kwargs = {})
Original traceback:
  File "<fuzz program>", line 23, in program

Use tlparse to see full graph. (https://github.com/pytorch/tlparse?tab=readme-ov-file#tlparse-parse-structured-pt2-logs)

Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially if you're reporting a bug to PyTorch). For even more developer context, set TORCH_LOGS="+dynamo"

"""

import torch
import torch.nn.functional as F

KIND = 'error'
SEED = 813074
DEVICE = 'cpu'
MODE = 'default'
# KNOWN_OPEN = "why it still fails"  (set it while the bug is open: the test then xfails strictly)
PROGRAM = {'inputs': [{'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [3, 3, 1, 5], 'special': False},
            {'dtype': 'float32', 'grad': False, 'layout': 'contig', 'shape': [3, 1], 'special': False}],
 'ops': [{'args': ['i0'], 'expr': '{0}[:, :, :, 0::2]', 'tag': 'slice'},
         {'args': ['i0', 'i1'], 'expr': 'torch.add({0}, {1}, alpha=2)', 'tag': 'add_alpha'},
         {'args': ['v0'],
          'expr': 'F.conv2d({0}, torch.ones(3, 3, 1, 1, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=2, padding=1)',
          'tag': 'conv2d'},
         {'args': ['v1'],
          'expr': 'F.conv2d({0}, torch.ones(1, 3, 3, 3, dtype={0}.dtype, device={0}.device).cumsum(0) * 0.1, '
                  'stride=2, padding=0)',
          'tag': 'conv2d'},
         {'args': ['v2'], 'expr': '{0}.permute([3, 2, 0, 1])', 'tag': 'permute'},
         {'args': ['v4'], 'expr': '{0}.view([3, 2] + [-1])', 'tag': 'view'}]}


def make_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    t = torch.randn([3, 3, 1, 5], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    t = torch.randn([3, 1], generator=g)
    t = t.to(device=device, dtype=torch.float32)
    out.append(t)
    return out


def program(i0, i1):
    v0 = i0[:, :, :, 0::2]
    v1 = torch.add(i0, i1, alpha=2)
    v2 = F.conv2d(v0, torch.ones(3, 3, 1, 1, dtype=v0.dtype, device=v0.device).cumsum(0) * 0.1, stride=2, padding=1)
    v3 = F.conv2d(v1, torch.ones(1, 3, 3, 3, dtype=v1.dtype, device=v1.device).cumsum(0) * 0.1, stride=2, padding=0)
    v4 = v2.permute([3, 2, 0, 1])
    v5 = v4.view([3, 2] + [-1])
    return (v3, v5)
