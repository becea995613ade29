"""Reductions over inner and outer dims, keepdim, full reductions, index-returning reductions."""

import pytest
import torch

from helpers import DEVICES, MATMUL_TOL, check

REDUCTIONS = {
    "sum": lambda x, dim, keepdim: x.sum(dim, keepdim=keepdim),
    "mean": lambda x, dim, keepdim: x.mean(dim, keepdim=keepdim),
    "amax": lambda x, dim, keepdim: x.amax(dim, keepdim=keepdim),
    "amin": lambda x, dim, keepdim: x.amin(dim, keepdim=keepdim),
    "var": lambda x, dim, keepdim: x.var(dim, keepdim=keepdim),
    "std": lambda x, dim, keepdim: x.std(dim, keepdim=keepdim, correction=0),
    "logsumexp": lambda x, dim, keepdim: torch.logsumexp(x, dim, keepdim=keepdim),
    "norm": lambda x, dim, keepdim: torch.linalg.vector_norm(x, 2, dim, keepdim=keepdim),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [-1, 0, (0, 2)], ids=["inner", "outer", "multi"])
@pytest.mark.parametrize("keepdim", [False, True], ids=["nokeep", "keep"])
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "var", "std", "logsumexp", "norm"])
def test_reduction_dims(device, op, dim, keepdim):
    x = torch.randn(6, 5, 7, device=device)
    check(lambda x: REDUCTIONS[op](x, dim, keepdim), x, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_full_reductions(device):
    def fn(x):
        return x.sum(), x.mean(), x.amax(), x.var(), x.std(), x.norm(), x.abs().max()

    check(fn, torch.randn(9, 13, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_prod_and_cumsum(device):
    def fn(x):
        return x.prod(1), torch.cumsum(x, 0), torch.cumprod(x, 1)

    check(fn, torch.rand(4, 6, device=device) + 0.5, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_argmin_and_max_with_indices(device):
    def fn(x):
        vals, idx = x.max(dim=1)
        mn, imn = torch.min(x, 0, keepdim=True)
        return x.argmax(-1), x.argmin(0), x.argmax(), vals * 2, idx, mn, imn

    check(fn, torch.randn(5, 8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_reduction_of_non_contiguous(device):
    x = torch.randn(8, 10, device=device).t()[:, ::2]
    assert not x.is_contiguous()
    check(lambda x: (x.sum(0), x.mean(1, keepdim=True), x.amax(0)), x, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_reductions(device, dtype):
    x = torch.randn(4, 300, device=device, dtype=dtype)
    check(lambda x: (x.sum(-1), x.mean(0), x.float().var(-1), x.softmax(-1).amax(-1)), x, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_integer_and_bool_reductions(device):
    def fn(i, b):
        return i.sum(0), i.sum(-1, dtype=torch.float32), b.any(-1), b.all(0), b.sum(), i.amax(1), i.float().mean()

    check(fn, torch.randint(-5, 5, (4, 6), device=device), torch.rand(4, 6, device=device) > 0.3, grad=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["mean", "amax", "sum"])
def test_column_reduction_of_add_with_scalar_alpha(device, op):
    # add(x, 3, alpha=2) before a reduction over the leading dims: the scalar times alpha was read as 0
    # (found by test/fuzz/graph_fuzz.py, repro mismatch_2958).
    fns = {"mean": torch.mean, "amax": torch.amax, "sum": torch.sum}
    for x in (torch.randn(2, 1, 1, device=device), torch.randn(8, 3, 5, device=device)):
        check(lambda t: fns[op](torch.add(t, 3, alpha=2), dim=(0, 1), keepdim=True), x)
        check(lambda t: fns[op](torch.sub(t, 0.5, alpha=3), dim=0), x)


@pytest.mark.parametrize("device", DEVICES)
def test_keepdim_shaped_nodes_reading_no_register_are_rows(device):
    """A minimum's backward over a [1, 1] and a [4] input: the group sums the [1, 4] gradient into [1, 1] rows,
    and the comparisons of the two [1, 1] inputs that pick where it goes read no value the group makes. They
    are rows all the same (kernels/program.cpp, node_is_row): lowered as full nodes, the result was stored
    [1, 4] and the gradient came back 4 times too large (fuzz seed 812592)."""

    def fn(a, b, c):
        return torch.minimum(torch.minimum(a + c, a), b.reshape(-1))

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(s, generator=g).to(device) for s in ([1, 1], [1, 1, 4], [1, 1]))
    check(fn, a, b, c, grad=[2])
