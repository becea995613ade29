"""Random ops. In training mode dropout cannot match eager bit for bit, so the tests check statistics
and that the backward uses the forward's mask; in eval mode dropout is the identity and matches eager."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import DEVICES, EMBER_GRAPHS, check, compile_ember

N = 1 << 20  # a million elements: the fraction of zeros is within 0.005 of p with overwhelming probability


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_train_statistics_and_backward_mask(device, p):
    fn = compile_ember(lambda x: F.dropout(x, p=p, training=True))
    x = (torch.rand(N, device=device) + 0.5).requires_grad_()  # no zeros in the input
    out = fn(x)
    assert len(EMBER_GRAPHS) >= 1
    zero = out == 0
    frac = zero.float().mean().item()
    assert abs(frac - p) < 0.005, f"fraction of dropped elements {frac} is not close to p={p}"
    scale = 1.0 / (1.0 - p)
    kept = ~zero
    torch.testing.assert_close(out[kept], x.detach()[kept] * scale)

    out.sum().backward()
    g = x.grad
    assert torch.equal(g == 0, zero), "backward must drop exactly the elements the forward dropped"
    torch.testing.assert_close(g[kept], torch.full_like(g[kept], scale))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_masks_differ_between_calls(device):
    fn = compile_ember(lambda x: F.dropout(x, p=0.5, training=True))
    x = torch.ones(4096, device=device)
    a, b = fn(x), fn(x)
    assert not torch.equal(a == 0, b == 0), "two calls drew the same dropout mask"


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_module_eval_equals_eager(device):
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2)).to(device)
    model.eval()
    check(model, torch.randn(5, 8, device=device), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_module_train_statistics(device):
    model = nn.Sequential(nn.Dropout(0.25)).to(device).train()
    compiled = compile_ember(model)
    x = torch.rand(N, device=device) + 1
    out = compiled(x)
    frac = (out == 0).float().mean().item()
    assert abs(frac - 0.25) < 0.005
    torch.testing.assert_close(out[out != 0], x[out != 0] / 0.75)


@pytest.mark.parametrize("device", DEVICES)
def test_random_ops_are_not_merged(device):
    """Two draws with the same arguments are different draws (CSE must not merge them)."""

    def fn(x):
        return torch.rand_like(x), torch.rand_like(x), torch.randn_like(x) - torch.randn_like(x)

    a, b, d = compile_ember(fn)(torch.empty(10000, device=device))
    assert not torch.equal(a, b)
    assert d.abs().max() > 0
    assert 0.45 < a.mean().item() < 0.55 and a.min() >= 0 and a.max() < 1
    assert abs(d.std().item() - 2 ** 0.5) < 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_rng_seeding_is_reproducible(device):
    fn = compile_ember(lambda x: x * torch.rand_like(x) + torch.randn(x.shape, device=x.device))
    x = torch.randn(100, device=device)
    torch.manual_seed(7)
    a = fn(x)
    torch.manual_seed(7)
    b = fn(x)
    assert torch.equal(a, b), "the same seed must give the same random numbers"
