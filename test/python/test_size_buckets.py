"""pad_to_buckets (python_bindings/ember/buckets.py, backend/runtime/size_buckets.cpp): a symbolic size padded with
zeros up to a bucket, outputs sliced back. Each test calls one compiled function at many sizes on fresh random
inputs and compares with eager; the padding itself is checked where it shows (the sizes the plan ran at, the
sizes that hold CUDA graphs, an op that does see the padded rows)."""

import random
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
from ember import EmberError
from helpers import DEVICES, EMBER_GRAPHS, compile_ember

BUCKETS = (8, 16, 32)
TOL = dict(atol=1e-4, rtol=1e-3)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def padded_graphs():
    return [g for kind, g in EMBER_GRAPHS if kind == "inference" and g.size_buckets()]


def sizes_run():
    """The sizes the padded graphs ran at (-1: above the largest bucket, at the call's own)."""
    return sorted({size for g in padded_graphs() for per_symbol in g.size_bucket_calls() for size, _ in per_symbol})


def rows_model(device):
    """Every op works per row: linears, GELU, a layer norm and a softmax over the features."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 7), nn.Softmax(-1)).to(device).eval()


def many_sizes(top, repeat=2, seed=0):
    sizes = list(range(2, top + 1)) * repeat
    random.Random(seed).shuffle(sizes)
    return sizes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("buckets", [BUCKETS, "pow2"])
@torch.no_grad()
def test_rows_independent_match_eager(device, buckets):
    model = rows_model(device)
    compiled = compile_ember(model, dynamic=True, options={"pad_to_buckets": buckets})
    for n in many_sizes(40):
        x = torch.randn(n, 12, device=device)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert len(padded_graphs()) == 1, [g.size_buckets() for _, g in EMBER_GRAPHS]
    allowed = {8, 16, 32, -1} if buckets == BUCKETS else {2, 4, 8, 16, 32, 64}
    assert set(sizes_run()) <= allowed and len(sizes_run()) >= 4, sizes_run()


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_automatic_dynamic_with_int_and_square_outputs(device):
    """Dynamo's automatic dynamic (the second size recompiles symbolically); outputs carrying the size twice
    ([n, n]) and the size itself as an int, which the graph returns, are all given back at the call's size."""

    def fn(x, y):
        h = torch.tanh(x @ y.t() + 1)
        return h, (x * y).sum(-1), x.shape[0], torch.relu(h).t() + 1

    compiled = compile_ember(fn, options={"pad_to_buckets": BUCKETS})
    for n in [5] + many_sizes(20):
        x, y = torch.randn(n, 6, device=device), torch.randn(n, 6, device=device)
        out, expected = compiled(x, y), fn(x, y)
        assert out[2] == expected[2]
        for a, b in zip(out[:2] + out[3:], expected[:2] + expected[3:]):
            assert a.shape == b.shape and a.is_contiguous() == b.is_contiguous()
            torch.testing.assert_close(a, b, **TOL)
    assert sizes_run() and set(sizes_run()) <= {8, 16, 32}, sizes_run()


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_padding_is_zeros_up_to_the_bucket(device):
    """A softmax over the padded dim sees the padded rows (the reason the option is off by default, and a case
    buckets.py cannot see: the dim survives). What it computes shows the padding exactly: zeros up to the bucket."""

    def fn(x):
        return torch.softmax(x, 0) * 2

    compiled = compile_ember(fn, dynamic=True, options={"pad_to_buckets": BUCKETS})
    for n in (3, 9, 13, 16, 30):
        x = torch.randn(n, 5, device=device)
        bucket = next(b for b in BUCKETS if b >= n)
        expected = fn(F.pad(x, (0, 0, 0, bucket - n)))[:n]
        out = compiled(x)
        assert out.shape == (n, 5)
        torch.testing.assert_close(out, expected, **TOL)
        if bucket != n:
            assert not torch.allclose(out, fn(x), **TOL)


@pytest.mark.parametrize("device", DEVICES)
@torch.no_grad()
def test_sequence_dim(device):
    """pad_dims=(1,): the symbolic length of dim 1 (marked dynamic), for a per-position model; dim 0 stays."""
    model = rows_model(device)

    def fn(x):
        return model(x).transpose(0, 1) * 3

    compiled = compile_ember(fn, options={"pad_to_buckets": "pow2", "pad_dims": (1,)})
    for n in many_sizes(19):
        x = torch.randn(3, n, 12, device=device)
        torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x)
        assert out.shape == (n, 3, 7)
        torch.testing.assert_close(out, fn(x), **TOL)
    assert set(sizes_run()) <= {2, 4, 8, 16, 32} and 32 in sizes_run(), sizes_run()


@torch.no_grad()
def test_distinct_sizes_bounded_by_the_buckets():
    """Sizes 2..64 run at the three buckets and, above the largest, at their own (counted apart); ember.explain
    lists what is padded and the calls per size."""
    model = rows_model("cpu")
    compiled = compile_ember(model, dynamic=True, options={"pad_to_buckets": BUCKETS})
    for n in many_sizes(64, repeat=1):
        x = torch.randn(n, 12)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    (graph,) = padded_graphs()
    (calls,) = graph.size_bucket_calls()
    assert dict(calls) == {8: 7, 16: 8, 32: 16, -1: 32}, calls
    (line,) = graph.size_buckets()
    assert "to buckets 8, 16, 32" in line and "8 x7, 16 x8, 32 x16, above the largest x32" in line, line

    report = str(ember.explain(model, dynamic=True, options={"pad_to_buckets": BUCKETS})(torch.randn(11, 12)))
    assert re.search(r"padded  s\d+ to buckets 8, 16, 32: pads inputs .*; calls per size: 16 x1", report), report


@torch.no_grad()
def test_off_changes_nothing():
    """Off (the default), and on for a graph without symbolic sizes: nothing is padded."""
    model = rows_model("cpu")
    compiled = compile_ember(model, dynamic=True)
    for n in (3, 9, 17):
        x = torch.randn(n, 12)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert EMBER_GRAPHS and not padded_graphs()
    assert all(g.size_bucket_calls() == [] for _, g in EMBER_GRAPHS)

    EMBER_GRAPHS.clear()
    torch._dynamo.reset()
    static = compile_ember(model, options={"pad_to_buckets": BUCKETS})
    x = torch.randn(5, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(static(x), model(x), **TOL)
    assert EMBER_GRAPHS and not padded_graphs()


def _mean_over_rows(x):
    return x.mean(0) + 1


def _centered(x):
    return x - x.mean(0, keepdim=True)


def _flattened(x):
    return (x * 2).flatten()


def _row_count(x):
    return x * x.shape[0]


def _mixed_by_rows(x):
    return (x @ x.t()) @ x


@pytest.mark.parametrize("fn, why", [
    (_mean_over_rows, "mixes the rows along the padded size"),
    (_centered, "mixes the rows along the padded size"),
    (_flattened, "a padded size within another"),
    (_row_count, "as a value, which padding would make the bucket"),
    (_mixed_by_rows, "contracts over the padded size"),
])
@torch.no_grad()
def test_unsafe_graphs_are_left_unpadded(fn, why):
    """A graph whose outputs padding would change runs at its own sizes, with one warning saying why; results match
    eager at every size, and ember.explain says why the graph is not padded."""
    compiled = compile_ember(fn, dynamic=True, options={"pad_to_buckets": BUCKETS})
    with pytest.warns(UserWarning, match="pad_to_buckets leaves .* at its own sizes: .*" + why):
        compiled(torch.randn(5, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (3, 7, 9, 21):
            x = torch.randn(n, 4)
            torch.testing.assert_close(compiled(x), fn(x), **TOL)
    assert not padded_graphs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = str(ember.explain(fn, dynamic=True, options={"pad_to_buckets": BUCKETS})(torch.randn(6, 4)))
    assert "not padded: " in report and why in report, report


def test_training_graphs_are_left_unpadded():
    model = rows_model("cpu").train()
    compiled = compile_ember(model, dynamic=True, options={"pad_to_buckets": BUCKETS})
    with pytest.warns(UserWarning, match="padding is for inference graphs alone"):
        compiled(torch.randn(5, 12, requires_grad=True)).sum().backward()
    for n in (3, 9):
        x = torch.randn(n, 12, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        out = compiled(x)
        torch.testing.assert_close(out, model(x_eager), **TOL)
        out.sum().backward()
        model(x_eager).sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad, **TOL)
    assert not padded_graphs()


@pytest.mark.parametrize("value, message", [
    ([0, 8], "pad_to_buckets must be"),
    ("powers", "pad_to_buckets must be"),
    ([8.0], "pad_to_buckets must be"),
])
def test_bad_values_raise(value, message):
    compiled = torch.compile(lambda x: x + 1, backend="ember", options={"pad_to_buckets": value})
    with pytest.raises(Exception, match=message) as caught:
        compiled(torch.randn(3))
    assert isinstance(getattr(caught.value, "inner_exception", caught.value), EmberError)


def test_values_read_from_code_and_environment():
    assert ember.config.SETTINGS["pad_to_buckets"].parse("32,8,16") == (8, 16, 32)
    assert ember.config.SETTINGS["pad_to_buckets"].parse("pow2") == "pow2"
    assert ember.config.SETTINGS["pad_to_buckets"].parse("off") is None
    assert ember.config.SETTINGS["pad_dims"].parse("1,0") == (0, 1)
    with ember.config.patch(pad_to_buckets=[16, 8]):
        assert ember.config.pad_to_buckets == (8, 16)
    with pytest.raises(EmberError, match="pad_dims must be"):
        ember.config.pad_dims = [-1]


# ---- CUDA (the GPU machine runs these; they skip elsewhere)


@needs_cuda
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@torch.no_grad()
def test_cuda_modes_match_eager(mode, monkeypatch):
    """torch.compile takes a mode or options, not both: with a mode, the buckets come from ember.config."""
    monkeypatch.setattr(ember.config, "pad_to_buckets", BUCKETS)
    monkeypatch.setattr(ember.config, "fallback", "raise")
    model = rows_model("cuda")
    compiled = torch.compile(model, backend="ember", dynamic=True, mode=mode)
    for n in many_sizes(40, repeat=3):
        x = torch.randn(n, 12, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert set(sizes_run()) == {8, 16, 32, -1}, sizes_run()
    (graph,) = padded_graphs()
    assert graph.cuda_graphs == (mode is not None)


@needs_cuda
@torch.no_grad()
def test_cuda_graphs_hold_bucket_sizes_only():
    """reduce-overhead over sizes 2..32: graphs captured at the three bucket sizes alone (ember.explain's `sizes
    captured`), however many sizes come; an output still held across a replay of its bucket keeps its value (it is
    a view of graph memory, which the runner copies out before overwriting)."""
    model = rows_model("cuda")
    compiled = torch.compile(model, backend="ember", dynamic=True,
                             options={"pad_to_buckets": BUCKETS, "cudagraphs": True, "fallback": "raise"})
    for n in many_sizes(32, repeat=3):
        x = torch.randn(n, 12, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    x9 = torch.randn(9, 12, device="cuda")
    held, expected = compiled(x9), model(x9)
    compiled(torch.randn(10, 12, device="cuda"))  # a replay of the same bucket (16)
    torch.testing.assert_close(held, expected, **TOL)

    (graph,) = padded_graphs()
    assert graph.cuda_graphs
    report = graph.cuda_graph_report()
    captured = int(re.search(r"signatures: (\d+) captured", report).group(1))
    assert captured <= len(BUCKETS), report
    sizes = re.search(r"sizes captured: (.*)", report).group(1)
    assert set(re.findall(r"\[(\d+), 12\]", sizes)) <= {"8", "16", "32"}, report
    assert "signatures evicted" not in report, report


@torch.no_grad()
def test_padding_comes_back_from_the_compile_cache(tmp_path, monkeypatch):
    """A compile cache hit (no tracing) pads as the fresh compile did: the plan is stored with the graph."""
    monkeypatch.setattr(ember.config, "compile_cache", True)
    monkeypatch.setattr(ember.config, "cache_dir", str(tmp_path))
    model = rows_model("cpu")
    options = {"pad_to_buckets": BUCKETS, "fallback": "raise"}
    for hit in (False, True):
        torch._dynamo.reset()
        EMBER_GRAPHS.clear()
        report = str(ember.explain(model, dynamic=True, options=options)(torch.randn(11, 12)))
        assert ("from the compile cache" in report) == hit, report
        assert re.search(r"padded  s\d+ to buckets 8, 16, 32", report), report
    compiled = compile_ember(model, dynamic=True, options={"pad_to_buckets": BUCKETS})
    for n in (3, 11, 20):
        x = torch.randn(n, 12)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert set(sizes_run()) == {8, 16, 32}, sizes_run()
