"""gather / scatter / index_select / index_put / advanced indexing / masked_fill / where / cat / stack /
split / chunk, and multiple outputs of several kinds."""

import pytest
import torch

from helpers import DEVICES, check


@pytest.mark.parametrize("device", DEVICES)
def test_gather(device):
    idx = torch.randint(0, 6, (4, 3), device=device)
    check(lambda x, i: torch.gather(x, 1, i) * 2, torch.randn(4, 6, device=device), idx)


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_and_scatter_add(device):
    idx = torch.randint(0, 5, (3, 4), device=device)  # repeated indices: scatter_add accumulates

    def fn(x, src, i):
        return x.scatter(0, i, src), x.scatter_add(0, i, src), torch.zeros_like(x).scatter_(0, i, 1.5)

    check(fn, torch.randn(5, 4, device=device), torch.randn(3, 4, device=device), idx, grad=[0, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_reduce(device):
    idx = torch.tensor([0, 1, 0, 2, 1, 1], device=device)

    def fn(x, src):
        return x.scatter_reduce(0, idx, src, "sum"), x.scatter_reduce(0, idx, src, "amax", include_self=False)

    check(fn, torch.randn(3, device=device), torch.randn(6, device=device), grad=[1])


@pytest.mark.parametrize("device", DEVICES)
def test_index_select(device):
    idx = torch.tensor([3, 0, 3, 1], device=device)
    check(lambda x: (x.index_select(0, idx), x.index_select(1, idx[:2])), torch.randn(5, 4, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_index_put_and_index_add(device):
    rows = torch.tensor([0, 2, 2], device=device)
    cols = torch.tensor([1, 0, 1], device=device)

    def fn(x, v):
        a = x.index_put((rows, cols), v)
        b = x.index_put((rows, cols), v, accumulate=True)
        c = x.index_add(0, rows, torch.ones(3, x.shape[1], device=x.device) * v.sum())
        return a, b, c

    check(fn, torch.randn(4, 3, device=device), torch.randn(3, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_advanced_indexing(device):
    idx = torch.tensor([[0, 2], [1, 1]], device=device)

    def fn(x, mask):
        a = x[idx]  # (2, 2, 5, 6)
        b = x[:, idx, 1:4]  # middle advanced index
        c = x[idx[0], :, idx[1]]  # separated advanced indices
        d = x[..., -1]
        e = x[mask]  # boolean mask: data-dependent shape
        return a.sum(), b * 2, c, d, e

    mask = torch.rand(3, 5, 6, device=device) > 0.5
    check(fn, torch.randn(3, 5, 6, device=device), mask)


@pytest.mark.parametrize("device", DEVICES)
def test_setitem_on_a_clone(device):
    def fn(x, v):
        y = x.clone()
        y[1] = v
        y[:, 0] = 0.0
        y[y > 1] = -1.0
        return y * 3

    check(fn, torch.randn(4, 5, device=device), torch.randn(5, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_masked_fill_and_where(device):
    def fn(x, y, mask):
        a = x.masked_fill(mask, float("-inf")).softmax(-1)
        b = torch.where(mask, x, y)
        c = torch.where(x > 0, x, 0.0)
        d = x.masked_fill(~mask, 2.5)
        return a, b, c, d

    mask = torch.rand(4, 7, device=device) > 0.5
    mask[:, 0] = False  # no row fully masked
    check(fn, torch.randn(4, 7, device=device), torch.randn(4, 7, device=device), mask)


@pytest.mark.parametrize("device", DEVICES)
def test_cat_stack(device):
    def fn(a, b, c):
        return torch.cat([a, b], 0), torch.cat([a, c.t()], 1), torch.stack([a, b, a], 1), torch.cat([a, b[:0]])

    check(fn, torch.randn(3, 4, device=device), torch.randn(3, 4, device=device), torch.randn(2, 3, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_split_chunk_unbind(device):
    def fn(x):
        a, b, c = x.split([2, 3, 1], dim=1)
        chunks = x.chunk(4, 0)
        rows = x.unbind(0)
        return a * 2 + 1, b.exp(), c, tuple(ch.sum(0) for ch in chunks), rows[-1].sin()

    check(fn, torch.randn(7, 6, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_multiple_outputs_dict_none_and_ints(device):
    def fn(x, y):
        s = x + y
        return {"sum": s, "prod": x * y, "meta": (None, 3, s.shape[0])}, None, [s.relu(), 7]

    check(fn, torch.randn(4, 3, device=device), torch.randn(4, 3, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_same_tensor_returned_twice_and_input_returned(device):
    def fn(x, y):
        z = x * y
        return z, z, x, y.detach()

    e, c = check(fn, torch.randn(5, device=device), torch.randn(5, device=device))
    assert c[0] is c[1] or torch.equal(c[0], c[1])


@pytest.mark.parametrize("device", DEVICES)
def test_topk_sort(device):
    def fn(x):
        v, i = x.topk(3, dim=-1)
        s, si = x.sort(0, descending=True)
        return v * 2, i, s, si

    check(fn, torch.randn(5, 8, device=device))


def test_aten_errors_keep_their_python_type():
    """An ATen op that fails inside a compiled graph raises what eager raises (IndexError here, not a
    RuntimeError), with the step named."""
    def fn(x, i):
        return x[i] * 2

    compiled = torch.compile(fn, backend="ember", options={"fallback": "raise"})
    torch.testing.assert_close(compiled(torch.arange(3.0), torch.tensor([2])), torch.tensor([4.0]))
    with pytest.raises(IndexError, match="out of bounds"):
        fn(torch.randn(3), torch.tensor([5]))
    with pytest.raises(IndexError, match=r"out of bounds.*ember: while running"):
        compiled(torch.randn(3), torch.tensor([5]))
