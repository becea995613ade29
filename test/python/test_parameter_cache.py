"""Steps over parameters alone (a weight scaled, transposed and copied) run once in inference graphs and
again only when a parameter changes (CompiledGraph::cache_parameter_steps, runtime.h)."""
import os
import re

import pytest
import torch

import ember
from helpers import EMBER_GRAPHS, assert_tensor_close, compile_ember


class Scaled(torch.nn.Module):
    def __init__(self, n=24, m=16):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(m, n))
        self.s = torch.nn.Parameter(torch.rand(m, 1) + 0.5)

    def forward(self, x):
        # w * s and its contiguous transpose read parameters alone: cached steps
        wt = (self.w * self.s).t().contiguous()
        return torch.relu(x @ wt) + 1


def listing():
    return "\n".join(g.describe() for _, g in EMBER_GRAPHS)


def check_now(m, f):
    x = torch.randn(5, 24)
    with torch.no_grad():
        assert_tensor_close(f(x), m(x))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_cached_steps_follow_parameter_changes(device):
    torch.manual_seed(0)
    m = Scaled().to(device)
    f = compile_ember(m)

    def check_now():
        x = torch.randn(5, 24, device=device)
        with torch.no_grad():
            assert_tensor_close(f(x), m(x))

    for _ in range(3):
        check_now()
    assert "cached over parameters" in listing(), listing()
    with torch.no_grad():
        m.w.mul_(-2.0)  # in place: a new version
    check_now()
    with torch.no_grad():
        m.s.copy_(torch.rand(16, 1, device=device))
    check_now()
    m.load_state_dict({"w": torch.randn(16, 24, device=device), "s": torch.rand(16, 1, device=device)})
    check_now()
    check_now()


def test_training_graphs_are_not_cached():
    torch.manual_seed(0)
    m = Scaled()
    f = compile_ember(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref = Scaled()
    ref.load_state_dict(m.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(5, 24)
        for model, fn, o in ((m, f, opt), (ref, ref, ref_opt)):
            o.zero_grad()
            fn(x).sum().backward()
            o.step()
    assert_tensor_close(m.w.detach(), ref.w.detach())
    assert "cached over parameters" not in listing()


def test_inference_mode_parameters_run_every_call():
    torch.manual_seed(0)
    with torch.inference_mode():
        m = Scaled()
        f = compile_ember(m)
        x = torch.randn(5, 24)
        assert_tensor_close(f(x), m(x))
        m.w.mul_(3.0)  # inference tensors have no version counter: the cache must not trust them
        assert_tensor_close(f(x), m(x))


def test_switched_off(monkeypatch):
    monkeypatch.setattr(ember.config, "parameter_cache", False)
    m = Scaled()
    f = compile_ember(m)
    check_now(m, f)
    assert EMBER_GRAPHS and "cached over parameters" not in listing()


def test_outputs_and_views_of_parameters_are_not_cached():
    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return x @ self.w.t(), self.w * 2  # a view read by the matmul; a derived value returned

    m = Views()
    f = compile_ember(m)
    x = torch.randn(3, 8)
    with torch.no_grad():
        a, b = f(x)
        b.add_(1)  # the caller owns its outputs
        a2, b2 = f(x)
        assert_tensor_close(b2, m.w * 2)
        assert_tensor_close(a2, x @ m.w.t())


def test_a_view_between_cached_step_and_its_reader_stays_per_call():
    """pad(w) is cached; the transpose after it (a view the matmul reads) runs per call, so the pad still
    counts as cached (an LM head's weight padded for the GEMM, then transposed)."""

    class Padded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(10, 8))

        def forward(self, x):
            # w is read by a step that stays (the first matmul) before the cached pad, its last use
            return x @ self.w.t() * 2, x @ torch.nn.functional.pad(self.w, (0, 0, 0, 6)).t()

    m = Padded()
    f = compile_ember(m)
    for _ in range(2):
        check_now_padded(m, f)
    text = listing()
    assert "cached over parameters" in text and "constant_pad_nd" in text.split("cached over parameters")[1].split("\n  0:")[0], text
    with torch.no_grad():
        m.w.add_(1.0)
    check_now_padded(m, f)


def check_now_padded(m, f):
    x = torch.randn(3, 8)
    with torch.no_grad():
        for a, b in zip(f(x), m(x)):
            assert_tensor_close(a, b)


class Rotary(torch.nn.Module):
    """A rotary embedding's cos/sin: made from the length and a buffer alone, then applied to the input."""

    def __init__(self, dim=16):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, x):
        t = torch.arange(x.shape[1], device=x.device).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + x.flip(-1) * emb.sin()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_steps_over_sizes_and_parameters_are_cached_per_size(device):
    """In a symbolic graph the steps over the sizes and the parameters alone (the cos/sin above, which a
    static compile folds) are cached per size: more sizes than entries, each seen again after eviction, and a
    changed buffer, all give eager's results."""
    torch.manual_seed(0)
    m = Rotary().to(device)
    f = compile_ember(m, dynamic=True)
    lengths = [3, 5, 9, 3, 12, 17, 20, 23, 30, 33, 41, 5, 3, 12]  # ten sizes: more than a cache keeps
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(2, n, 16, device=device)
            assert_tensor_close(f(x), m(x))
        m.inv_freq.mul_(0.5)  # in place: a new version, every size's entry stale
        for n in (3, 41, 3):
            x = torch.randn(2, n, 16, device=device)
            assert_tensor_close(f(x), m(x))
    text = listing()
    per_call = [line for line in text.splitlines() if re.match(r"\s+\d+: ", line)]
    assert "cached over parameters" in text and "aten::arange" in text, text
    assert not any("aten::arange" in line or "aten::cos" in line for line in per_call), text
