"""oneDNN matmul epilogues on the CPU: linear / mm / addmm with bias, activations, scales and residual adds
fused as post-ops (passes/matmul_epilogue.cpp, kernels/cpu/matmul_kernel.cpp), against eager on fresh random
inputs, forward and backward, odd sizes, dynamic batch sizes, weights changed in place between calls.

A kernel whose weights are a parameter runs its first call through ATen and packs the weights on the second
(kernels/cpu/epilogue_support.h), and fewer than 8 rows against unpacked weights run through ATen too: the
tests call each compiled function several times (check_calls) and use 8 rows or more. Fewer float32 rows against
weights as they lie (first sight, changed, or not a parameter) run ember's own loop (kernels/cpu/gemv.cpp):
the few-rows tests below."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
import ember._C
import helpers
from helpers import MATMUL_TOL, check, compile_ember


def check_calls(fn, *inputs, calls=3, **kwargs):
    """check() over `calls` calls of one compiled function, on fresh random inputs shaped and strided like
    `inputs`. A kernel whose weights are a parameter runs its first call through ATen and packs them on the
    second, so a single call would never reach oneDNN."""
    compiled = compile_ember(copy.deepcopy(fn) if isinstance(fn, nn.Module) else fn, options=kwargs.pop("options", None))
    result = None
    for i in range(calls):
        fresh = [helpers.clone_input(x).normal_() if x.is_floating_point() else x for x in inputs]
        result = check(fn, *fresh, compiled=compiled, min_graphs=0 if i else 1, **kwargs)
    return result


def onednn_kernels():
    """The oneDNN steps of every graph ember compiled in this test."""
    return [what for _, compiled in helpers.EMBER_GRAPHS for kind, what in compiled.steps()
            if kind == "kernel" and what.startswith("onednn")]


@functools.lru_cache(maxsize=1)
def _onednn_built():
    import ember

    lin = nn.Linear(4, 4)
    before = len(helpers.EMBER_GRAPHS)
    with torch.no_grad():
        report = ember.explain(lambda x: torch.relu(lin(x)))(torch.randn(2, 4))
    del helpers.EMBER_GRAPHS[before:]  # the probe's graph is not the calling test's (onednn_kernels counts those)
    return any(g.onednn for g in report.graphs)


needs_onednn = pytest.mark.skipif("not _onednn_built()", reason="ember was built without oneDNN")

ACTIVATIONS = {
    "none": lambda y: y,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "hardswish": F.hardswish,
    "relu6": F.relu6,  # hardtanh(0, 6): oneDNN's clip maps NaN, so ATen clamps in place after the call
}


@needs_onednn
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(9, 13, 5), (2, 5, 17, 9)], ids=["2d", "4d"])
def test_linear_activation_inference(act, bias, shape):
    *batch, k, n = shape
    lin = nn.Linear(k, n, bias=bias)
    fn = lambda x: ACTIVATIONS[act](lin(x))  # noqa: E731
    with torch.no_grad():
        check_calls(fn, torch.randn(*batch, k), grad=False, **MATMUL_TOL)
    kernels = onednn_kernels()
    assert len(kernels) == 1, kernels
    assert ("+bias" in kernels[0]) == bias, kernels
    if act != "none":
        assert kernels[0].split()[-1] == {"relu6": "clamp"}.get(act, act), kernels


@needs_onednn
@pytest.mark.parametrize("act", ["relu", "gelu", "tanh"])
def test_linear_activation_training(act):
    """relu's and tanh's backward read the activation's output: the matmul and its activation are one oneDNN
    call. gelu's reads its input, which leaves the matmul alone, and a lone matmul in a training graph stays
    ATen's (passes/matmul_epilogue.cpp, item 3)."""
    lin = nn.Linear(11, 6)
    check_calls(lambda x: ACTIVATIONS[act](lin(x)), torch.randn(5, 11, requires_grad=True), **MATMUL_TOL)
    assert bool(onednn_kernels()) == (act != "gelu")


@needs_onednn
@pytest.mark.parametrize("case", ["residual", "residual_first", "scale_shift", "div", "row_add"])
def test_residual_scale_and_row_epilogues(case):
    w, b = torch.randn(6, 10), torch.randn(6)
    fns = {
        "residual": lambda x, r: torch.relu(F.linear(x, w, b)) + r,
        "residual_first": lambda x, r: r + F.linear(x, w, b),
        "scale_shift": lambda x, r: F.linear(x, w) * 0.5 - 1.0,
        "div": lambda x, r: torch.sigmoid(F.linear(x, w, b) / 3.0),
        "row_add": lambda x, r: torch.mm(x.flatten(0, -2), w.t()) + b,
    }
    with torch.no_grad():
        check_calls(fns[case], torch.randn(3, 4, 10), torch.randn(3, 4, 6), grad=False, **MATMUL_TOL)
    assert len(onednn_kernels()) == 1


@needs_onednn
@pytest.mark.parametrize("library", ["onednn", "torch", "aten", None])
@pytest.mark.parametrize("act", ["tanh", "silu", "gelu", "sigmoid"])
def test_two_scales_around_an_activation(act, library, monkeypatch):
    """x @ w * 0.5, an activation, * 3 + 1: two scale-and-shift post-ops in one chain, where Debian's oneDNN 2.6
    applied the first one's numbers in the second's place (fuzz seed 1943321); the second now runs through ATen.
    Weights made in the graph (plain) and passed in (packed from their second call)."""
    if library:
        monkeypatch.setattr(ember.config, "cpu_matmul", library)
    f = {"tanh": torch.tanh, "silu": F.silu, "gelu": F.gelu, "sigmoid": torch.sigmoid}[act]
    w = torch.randn(64, 32) * 0.3
    made = lambda x: f(torch.mm(x, (torch.arange(64 * 32.0).reshape(64, 32) % 7 - 3) * 0.1) * 0.5) * 3.0 + 1.0
    passed = lambda x, w: f(torch.mm(x, w) * 0.5) * 3.0 + 1.0
    with torch.no_grad():
        check_calls(made, torch.randn(13, 64), grad=False, **MATMUL_TOL)
        check_calls(passed, torch.randn(13, 64), w, grad=False, **MATMUL_TOL)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("k,n", [(1, 5), (15, 3), (16, 4), (17, 9), (300, 129), (1030, 70)])
def test_few_rows_against_weights_that_change_every_call(rows, k, n):
    """Fresh weights each call are never packed: 1-7 rows run ember's loop, blocks of rows and of columns with
    their tails, vector bodies and scalar tails over K, one thread or several (the (1030, 70) weights)."""
    fn = lambda x, w, b: torch.relu(F.linear(x, w, b))  # noqa: E731
    with torch.no_grad():
        check_calls(fn, torch.randn(rows, k), torch.randn(n, k), torch.randn(n), grad=False, **MATMUL_TOL)
    assert len(onednn_kernels()) == 1


@needs_onednn
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_few_rows_epilogues(act):
    """Bias, each activation, a scale and a residual add, applied by ember's loop on its results."""
    fn = lambda x, w, b, r: ACTIVATIONS[act](F.linear(x, w, b)) * 0.5 + r  # noqa: E731
    with torch.no_grad():
        check_calls(fn, torch.randn(3, 40), torch.randn(33, 40), torch.randn(33), torch.randn(3, 33), grad=False,
                    **MATMUL_TOL)


@needs_onednn
@pytest.mark.parametrize("rows", [3, 12], ids=["loop", "onednn"])
def test_row_addend_then_residual(rows):
    """A broadcast row and then a [M, N] residual added to the matmul: the residual's row stride is the first
    of the [M, N] addends', not the second Add's (both kernels once read it by the Add's position)."""
    fn = lambda x, w, row, r: torch.relu(torch.mm(x, w.t()) + row) + r  # noqa: E731
    with torch.no_grad():
        check_calls(fn, torch.randn(rows, 40), torch.randn(33, 40), torch.randn(33), torch.randn(rows, 33), grad=False,
                    **MATMUL_TOL)
    kernels = onednn_kernels()
    assert len(kernels) == 1 and kernels[0].count("add") == 2, kernels


@needs_onednn
def test_few_rows_non_contiguous_source_and_weights():
    """Source rows apart by more than K (a slice) take the loop; weights with rows contiguous (not transposed)
    and a transposed source go through ATen."""
    with torch.no_grad():
        check_calls(lambda x, w: torch.mm(x[:, 3:], w.t()), torch.randn(4, 43), torch.randn(9, 40), grad=False,
                    **MATMUL_TOL)
        check_calls(lambda x, w: torch.mm(x, w), torch.randn(4, 40), torch.randn(40, 9), grad=False, **MATMUL_TOL)
        check_calls(lambda x, w: torch.mm(x.t(), w.t()), torch.randn(40, 4), torch.randn(9, 40), grad=False,
                    **MATMUL_TOL)


@needs_onednn
def test_few_rows_propagate_nan_and_inf():
    lin = nn.Linear(40, 20)
    compiled = compile_ember(lambda x, w: torch.relu(F.linear(x, w, lin.bias)))
    x, w = torch.randn(3, 40), lin.weight.detach().clone()
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    with torch.no_grad():
        expected = torch.relu(F.linear(x, w, lin.bias))
        torch.testing.assert_close(compiled(x, w), expected, equal_nan=True, **MATMUL_TOL)
    assert expected[0].isnan().all() and expected[1].isinf().any()


def _sprinkle(t):
    """t with NaN, +-Inf and a large value at random places (fresh each call)."""
    flat = t.view(-1)
    where = torch.randperm(flat.numel())[:4]
    flat[where] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    return t


@needs_onednn
@pytest.mark.parametrize("library", ["onednn", "torch", "aten"])
@pytest.mark.parametrize("epilogue", ["relu", "add_relu", "sigmoid", "relu_scale", "relu6", "hardswish"])
def test_matmul_epilogues_keep_nan(library, epilogue, monkeypatch):
    """torch.relu keeps NaN; oneDNN's relu post-op (max(x, 0)) maps it to 0, so the relu and what follows run
    through ATen after the library call (kernels/cpu/epilogue_support.h, library_exact_ops). NaN and Inf in the
    source reach the result through rows of the product, on packed parameter weights, weights passed in, and
    few rows (ember's loop)."""
    monkeypatch.setattr(ember.config, "cpu_matmul", library)
    lin = nn.Linear(24, 40).eval()
    w = torch.randn(24, 40)
    tails = {"relu": lambda y, r: torch.relu(y), "add_relu": lambda y, r: torch.relu(y + r),
             "sigmoid": lambda y, r: torch.sigmoid(y), "relu_scale": lambda y, r: torch.relu(y) * 2.0 - 1.0,
             "relu6": lambda y, r: F.relu6(y), "hardswish": lambda y, r: F.hardswish(y)}
    tail = tails[epilogue]
    for fn in (lambda x, r: tail(lin(x), r), lambda x, r: tail(torch.mm(x, w), r)):
        compiled = compile_ember(fn)
        with torch.no_grad():
            for rows in (33, 33, 33, 5, 5):
                x, r = _sprinkle(torch.randn(rows, 24)), _sprinkle(torch.randn(rows, 40))
                expected = fn(x, r)
                torch.testing.assert_close(compiled(x, r), expected, equal_nan=True, **MATMUL_TOL)
                assert expected.isnan().any()


@pytest.mark.parametrize("route", ["torch", "onednn"])
@pytest.mark.parametrize("epilogue", ["relu", "add_relu", "sigmoid", "relu6", "hardswish"])
def test_conv2d_epilogues_keep_nan(route, epilogue, monkeypatch):
    """The fuzzer's repro mismatch_2846: relu after a convolution through torch's oneDNN call (its relu post-op
    maps NaN to 0) or ember's (EMBER_ONEDNN_CONV=1, where a sigmoid does too)."""
    if route == "torch" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without mkldnn")
    if route == "onednn":
        if not _onednn_built():
            pytest.skip("ember was built without oneDNN")
        monkeypatch.setattr(ember.config, "onednn_conv", True)
    conv = nn.Conv2d(4, 6, 3, padding=1).eval()
    tails = {"relu": lambda y, r: torch.relu(y), "add_relu": lambda y, r: torch.relu(y + r),
             "sigmoid": lambda y, r: torch.sigmoid(y), "relu6": lambda y, r: F.relu6(y),
             "hardswish": lambda y, r: F.hardswish(y)}
    fn = lambda x, r: tails[epilogue](conv(x), r)  # noqa: E731
    compiled = compile_ember(fn)
    with torch.no_grad():
        for _ in range(3):  # call 2 on: packed weights
            x, r = _sprinkle(torch.randn(2, 4, 7, 9)), _sprinkle(torch.randn(2, 6, 7, 9))
            expected = fn(x, r)
            torch.testing.assert_close(compiled(x, r), expected, equal_nan=True, **MATMUL_TOL)
            assert expected.isnan().any()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(x, r)
    assert len(onednn_kernels()) == 1
    if route == "torch":  # torch's call, not ATen's fallback (a rejected call falls back for good)
        assert "mkldnn::_convolution_pointwise" in {e.key for e in prof.key_averages()}


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_one_mlp_first_call_then_packed(threads):
    """An inference MLP at batch 1: the loop on the first call, oneDNN on packed weights after; also on one
    thread."""
    model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)).eval()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            check_calls(model, torch.randn(1, 512), grad=False, **MATMUL_TOL)
    finally:
        torch.set_num_threads(saved)
    assert len(onednn_kernels()) == 3


@needs_onednn
@pytest.mark.parametrize("library", ["timed", "onednn", "aten", "torch"])
def test_large_problems_match_eager_through_either_library(library, monkeypatch, tmp_path):
    """Problems of 2^22 multiply-adds or more run through whichever of oneDNN, ATen and torch's own oneDNN
    (mkldnn::_linear_pointwise) was fastest when timed (kernels/cpu/matmul_kernel.cpp, points 5 and 6);
    EMBER_CPU_MATMUL forces one. Each way, with a bias and GELU, a bias, ReLU and a residual add, a bias and a
    residual add (torch's .binary form), or a scale, packed parameter weights and weights passed in, every call
    matches eager, the call that times included. A problem is timed once per process, so two kernels of the
    same problem time it once (ember._C.cpu_matmul_timings()), and a weight changed in place is still read. The
    cache folder is the test's own: a choice timed by an earlier process would be read from it instead."""
    monkeypatch.setattr(ember.config, "cache_dir", str(tmp_path))
    if library != "timed":
        monkeypatch.setattr(ember.config, "cpu_matmul", library)
    timed_before = len(ember._C.cpu_matmul_timings())
    # Odd sizes of their own (72 x 264 x 232 = 4.4M multiply-adds), so that no earlier test timed them.
    model = nn.Sequential(nn.Linear(264, 232), nn.GELU(), nn.Linear(232, 264), nn.ReLU()).eval()
    twin = copy.deepcopy(model)
    w = torch.randn(232, 264)
    residual = nn.Linear(264, 264).eval()
    fns = [
        lambda x, r: model(x) + r,
        lambda x, r: twin(x) + r,  # the same problems again, in kernels of their own
        lambda x, r: torch.relu(F.linear(x, w) * 0.5 + r[:, :232]),
        lambda x, r: residual(x) + r,
    ]
    with torch.no_grad():
        for fn in fns:
            compiled = compile_ember(fn)
            for step in range(4):  # call 1: ATen (first sight), 2: packs and times, 3-4: the library chosen
                x, r = torch.randn(72, 264), torch.randn(72, 264)
                torch.testing.assert_close(compiled(x, r), fn(x, r), **MATMUL_TOL)
                if step == 2:
                    for m in (model[0], twin[0], residual):
                        m.weight.mul_(-1.0)
    assert len(onednn_kernels()) >= 5
    timed = [line for line in ember._C.cpu_matmul_timings()[timed_before:] if line.startswith("72x")]
    if library == "timed":
        # Each problem once, though twin's kernels meet model's again: model's two packed matmuls (bias + gelu,
        # bias + relu + add), the scaled one, the residual one, and the first again on weights changed and not
        # yet repacked.
        problems = [line.split(":")[0] for line in timed]
        assert len(problems) == len(set(problems)), "\n".join(timed)
        assert {"72x232x264 matmul f32 +bias gelu (packed)",
                "72x264x232 matmul f32 +bias relu add (packed)",
                "72x232x264 matmul f32 scale (packed)",
                "72x264x264 matmul f32 +bias add (packed)"} <= set(problems), "\n".join(timed)
        assert all(line.endswith(("-> onednn", "-> aten", "-> torch")) for line in timed), timed
        # torch's call is timed where the weights lie as nn.Linear's: every problem here (where torch has it).
        if torch.backends.mkldnn.is_available():
            assert all(", torch " in line for line in timed), timed
    else:
        assert timed == []


@needs_onednn
def test_torch_linear_leaves_to_aten_what_it_rejects(monkeypatch):
    """Torch's own oneDNN (EMBER_CPU_MATMUL=torch) on a bf16 problem: hosts without bf16 instructions reject it
    with oneDNN's own error, which the kernel takes for a no (ATen runs that call, Debian's oneDNN the next); hosts with
    them run it. Either way every call matches eager."""
    monkeypatch.setattr(ember.config, "cpu_matmul", "torch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(264, 232), nn.GELU()).eval().to(torch.bfloat16)
    compiled = compile_ember(model)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(72, 264, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_weights_changed_in_place_between_calls_are_repacked():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    compiled = compile_ember(model)
    with torch.no_grad():
        for step in range(4):  # calls 2+ run on packed weights
            x = torch.randn(9 if step % 2 else 2, 16)  # 9 rows: oneDNN; 2 rows: oneDNN once packed
            torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
            if step == 1:
                model[0].weight.mul_(-1.5)
                model[2].bias.add_(1.0)
    assert len(onednn_kernels()) >= 2  # (the second batch size recompiles with a dynamic batch)


@needs_onednn
def test_dynamic_batch_sizes_and_empty_batch():
    model = nn.Sequential(nn.Linear(9, 7), nn.SiLU()).eval()
    compiled = compile_ember(model, dynamic=True)
    with torch.no_grad():
        for rows in (3, 8, 5, 3, 0):
            x = torch.randn(rows, 9)
            torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)


@needs_onednn
def test_non_contiguous_source():
    lin = nn.Linear(12, 4)
    with torch.no_grad():
        check_calls(lambda x: torch.relu(lin(x.t())), torch.randn(12, 9), grad=False, **MATMUL_TOL)


@needs_onednn
def test_bfloat16_linear_relu():
    lin = nn.Linear(32, 16).to(torch.bfloat16)
    with torch.no_grad():
        check_calls(lambda x: torch.relu(lin(x)), torch.randn(10, 32, dtype=torch.bfloat16), grad=False)
    assert onednn_kernels() and "bf16" in onednn_kernels()[0]


def test_mlp_training_step_matches_eager():
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 3))
    check_calls(model, torch.randn(8, 20), **MATMUL_TOL)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_transformer_encoder_layer(train):
    # The quickstart's --model transformer: the MHA fast path off so that eager and ember both run it op by op.
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        model = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        x = torch.randn(2, 7, 32)
        if train:
            check_calls(model.train(), x, **MATMUL_TOL)
        else:
            with torch.no_grad():
                check_calls(model.eval(), x, grad=False, **MATMUL_TOL)
            steps = [what for _, c in helpers.EMBER_GRAPHS for kind, what in c.steps() if kind == "aten"]
            # canonicalize drops the clones functionalization leaves around dropout and the projections
            assert steps.count("aten::clone") <= 2, steps
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_epilogue_pass_can_be_switched_off():
    lin = nn.Linear(5, 3)
    with torch.no_grad():
        check(lambda x: torch.relu(lin(x)), torch.randn(4, 5), grad=False, options={"disable_passes": "epilogue"},
              **MATMUL_TOL)
    assert not onednn_kernels()


@pytest.mark.usefixtures("onednn_conv")
@needs_onednn
def test_conv2d_residual_and_repeated_calls():
    conv = nn.Conv2d(6, 6, 3, padding=1, bias=False).eval()
    compiled = compile_ember(lambda x, r: torch.relu(conv(x) + r))
    with torch.no_grad():
        for step in range(3):  # calls 2+ run on packed weights
            x, r = torch.randn(2, 6, 9, 9), torch.randn(2, 6, 9, 9)
            torch.testing.assert_close(compiled(x, r), torch.relu(conv(x) + r), **MATMUL_TOL)
            if step == 1:
                conv.weight.mul_(0.5)
    assert onednn_kernels() == ["onednn conv2d f32 add relu"]


def test_conv2d_training_matches_eager():
    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, 4, 3, stride=2))
    check_calls(model, torch.randn(2, 3, 10, 10), **MATMUL_TOL)


class SqueezeExcitation(nn.Module):
    def __init__(self, c, squeezed):
        super().__init__()
        self.conv, self.fc1, self.fc2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, squeezed, 1), nn.Conv2d(squeezed, c, 1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        w = torch.sigmoid(self.fc2(torch.relu(self.fc1(F.adaptive_avg_pool2d(y, 1)))))
        return torch.relu(y * w + x)


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_small_pointwise_convolutions_run_as_matmuls(train, batch):
    """Squeeze-excitation's 1x1 convolutions over a 1x1 image are ATen's matmul of [N, C] rows (kernels/cpu/
    conv_kernel.cpp, item 3), not torch's oneDNN call; the 3x3 one stays there. Results and gradients against
    eager over calls on fresh inputs."""
    model = SqueezeExcitation(24, 6).eval()
    check_calls(model, torch.randn(batch, 24, 6, 5, requires_grad=train), **MATMUL_TOL)
    compiled = compile_ember(model)
    x = torch.randn(batch, 24, 6, 5, requires_grad=train)
    with torch.set_grad_enabled(train):
        compiled(x), compiled(x)  # the compile, then packed weights
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                compiled(x)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::addmm", 0) >= 6, counts
    assert counts.get("mkldnn::_convolution_pointwise", 0) + counts.get("aten::convolution", 0) == 3, counts


def test_clone_of_input_returned_through_a_view_stays_a_copy():
    def fn(x):
        return x.clone().view(-1), (x.clone() * 2).t()

    x = torch.randn(3, 4)
    out, _ = compile_ember(fn)(x)
    assert out.data_ptr() != x.data_ptr()
    out.add_(1)
    torch.testing.assert_close(x + 1, out.view(3, 4))


@pytest.fixture
def onednn_conv(monkeypatch):
    """Convolutions through oneDNN (off by default: passes/matmul_epilogue.cpp, item 5)."""
    monkeypatch.setattr(ember.config, "onednn_conv", True)


needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without mkldnn")


@needs_mkldnn
@pytest.mark.parametrize("route", ["torch", "aten"])
def test_convolutions_by_default_run_torchs_onednn_with_batchnorm_folded(route, monkeypatch):
    if route == "aten":
        monkeypatch.setattr(ember.config, "cpu_conv", "aten")
    model = conv_bn_blocks((3, 8, 16), True, False)
    with torch.no_grad():
        check_calls(model, torch.randn(2, 3, 11, 9), grad=False, calls=3, **MATMUL_TOL)
    steps = [what for _, g in helpers.EMBER_GRAPHS for _, what in g.steps()]
    assert steps.count("fold_batchnorm") == 2
    torch_convs = [what for what in steps if what.startswith("onednn conv2d") and what.endswith("via torch")]
    if route == "torch":
        assert torch_convs == ["onednn conv2d f32 +bias relu via torch", "onednn conv2d f32 +bias via torch"], steps
    else:
        assert steps.count("aten::convolution") == 2 and not torch_convs


@pytest.mark.parametrize("route", ["torch", "onednn"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("groups,stride,padding,dilation", [(1, 1, 1, 1), (2, 2, 1, 1), (1, 1, 2, 2), (4, 2, 0, 1)])
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "hardswish", "relu6", "none"])
def test_conv2d_epilogues(route, channels_last, groups, stride, padding, dilation, act, monkeypatch):
    """Both routes: torch's oneDNN call (the default) and ember's oneDNN (EMBER_ONEDNN_CONV=1)."""
    if route == "torch" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without mkldnn")
    if route == "onednn":
        if not _onednn_built():
            pytest.skip("ember was built without oneDNN")
        monkeypatch.setattr(ember.config, "onednn_conv", True)
    conv = nn.Conv2d(8, 12, 3, stride=stride, padding=padding, dilation=dilation, groups=groups).eval()
    x = torch.randn(2, 8, 13, 11)
    if channels_last:
        conv = conv.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    fn = lambda x: ACTIVATIONS[act](conv(x))  # noqa: E731
    with torch.no_grad():
        eager, compiled = check_calls(fn, x, grad=False, calls=3, **MATMUL_TOL)  # calls 2+ on packed weights
    assert compiled.stride() == eager.stride()
    kernels = onednn_kernels()
    assert len(kernels) == 1 and kernels[0].endswith("via torch") == (route == "torch"), kernels
    assert kernels[0].startswith("onednn conv2d f32 +bias" + ("" if act == "none" else " "))


@needs_mkldnn
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_torch_conv_residual_relu_repacks_when_weights_change(channels_last):
    conv = nn.Conv2d(6, 6, 3, padding=1, bias=False).eval()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv = conv.to(memory_format=fmt)
    compiled = compile_ember(lambda x, r: torch.relu(conv(x) + r))
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(2, 6, 9, 9).contiguous(memory_format=fmt)
            r = torch.randn(2, 6, 9, 9).contiguous(memory_format=fmt)
            expected = torch.relu(conv(x) + r)
            out = compiled(x, r)
            torch.testing.assert_close(out, expected, **MATMUL_TOL)
            assert out.stride() == expected.stride()
            if step in (1, 3):
                conv.weight.mul_(-0.5)  # in place: the packed copy is stale from here
    assert onednn_kernels() == ["onednn conv2d f32 add relu via torch"]


@needs_mkldnn
def test_torch_conv_layouts_that_disagree_and_strided_inputs_match_eager():
    conv = nn.Conv2d(5, 7, 3, padding=1).eval().to(memory_format=torch.channels_last)  # NCHW source below
    with torch.no_grad():
        eager, compiled = check_calls(lambda x: torch.relu(conv(x)), torch.randn(2, 5, 8, 9), grad=False, calls=3,
                                      **MATMUL_TOL)
        assert compiled.stride() == eager.stride()
        wide = torch.randn(2, 5, 8, 18)[..., ::2]  # a strided source
        check_calls(lambda x: torch.relu(conv(x)), wide, grad=False, calls=2, **MATMUL_TOL)


@needs_mkldnn
def test_torch_conv_stops_at_an_epilogue_it_does_not_apply():
    conv = nn.Conv2d(4, 6, 3).eval()
    fn = lambda x: torch.relu(conv(x) * 2.0 + 1.0) + torch.relu(conv(x)).sum()  # noqa: E731
    with torch.no_grad():
        check_calls(fn, torch.randn(3, 4, 7, 7), grad=False, calls=2, **MATMUL_TOL)
    assert all(k.endswith("via torch") for k in onednn_kernels())


@needs_mkldnn
@pytest.mark.parametrize("act", ["relu", "none"])
def test_torch_conv_bf16(act):
    conv = nn.Conv2d(8, 16, 3, padding=1).eval().to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 10, 10, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        check_calls(lambda x: ACTIVATIONS[act](conv(x)), x, grad=False, calls=3, atol=5e-2, rtol=2e-2)


def conv_bn_blocks(channels, bias, channels_last):
    """Two conv-bn(-relu) blocks in eval mode with non-trivial running statistics and affine parameters."""
    c0, c1, c2 = channels
    model = nn.Sequential(
        nn.Conv2d(c0, c1, 3, padding=1, bias=bias), nn.BatchNorm2d(c1), nn.ReLU(),
        nn.Conv2d(c1, c2, 1, stride=2, bias=bias), nn.BatchNorm2d(c2, affine=False),
    )
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                if m.affine:
                    m.weight.normal_()
                    m.bias.normal_()
    model = model.eval()
    return model.to(memory_format=torch.channels_last) if channels_last else model


@pytest.mark.usefixtures("onednn_conv")
@needs_onednn
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("channels", [(3, 8, 16), (5, 7, 3)], ids=["even", "odd"])
def test_conv_batchnorm_folded_in_inference(channels, bias, channels_last):
    model = conv_bn_blocks(channels, bias, channels_last)
    x = torch.randn(2, channels[0], 11, 9)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        eager, compiled = check_calls(model, x, grad=False, calls=4, **MATMUL_TOL)
    assert compiled.stride() == eager.stride()
    steps = [what for _, g in helpers.EMBER_GRAPHS for _, what in g.steps()]
    assert steps.count("fold_batchnorm") == 2
    assert not any("batch_norm" in what for what in steps)
    assert "onednn conv2d f32 +bias relu" in steps


@pytest.mark.usefixtures("onednn_conv")
@needs_onednn
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_folded_batchnorm_follows_parameter_changes(channels_last):
    # The parameter cache refreshes the folded weights in place; the convolution's packed copy of them must
    # notice (a stale packing gave errors of 5 here with channels-last weights).
    model = conv_bn_blocks((4, 6, 5), False, channels_last)
    compiled = compile_ember(model)
    with torch.no_grad():
        for step in range(5):  # the fold is cached from the second call on, the weights packed from the third
            x = torch.randn(2, 4, 8, 8)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
            if step == 2:
                model[1].running_var.mul_(3)
                model[0].weight.add_(0.5)


def test_batchnorm_with_grad_is_not_folded():
    # Eval mode with grad on: the backward reads the convolution's result, so the batch norm stays.
    model = conv_bn_blocks((3, 5, 4), True, False)
    check_calls(model, torch.randn(2, 3, 8, 8), **MATMUL_TOL)
    assert not any(what == "fold_batchnorm" for _, g in helpers.EMBER_GRAPHS for _, what in g.steps())


def test_batchnorm_in_training_is_not_folded():
    # Training mode normalizes with batch statistics (another op): nothing to fold. A fresh model: check()
    # compares .grad of the eager module with that of a fresh deep copy (deepcopy drops .grad), so a module
    # that went through an earlier check with grad carries stale gradients into the comparison.
    model = conv_bn_blocks((3, 5, 4), True, False).train()
    check(model, torch.randn(2, 3, 8, 8), **MATMUL_TOL)
    assert not any(what == "fold_batchnorm" for _, g in helpers.EMBER_GRAPHS for _, what in g.steps())


@needs_onednn
@pytest.mark.parametrize("params_made_in_inference_mode", [False, True], ids=["params", "inference_params"])
def test_folded_batchnorm_under_inference_mode(params_made_in_inference_mode):
    # Called under inference_mode the folded tensors are still made as normal tensors (cached, packed); with
    # inference-tensor parameters (no version counter) the fold is redone on every call.
    with torch.inference_mode(params_made_in_inference_mode):
        model = conv_bn_blocks((3, 6, 5), False, False)
    compiled = compile_ember(model)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(2, 3, 9, 9)
            torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
    assert [what for _, g in helpers.EMBER_GRAPHS for _, what in g.steps()].count("fold_batchnorm") == 2


class BasicBlock(nn.Module):
    """ResNet's basic block: with both batch norms folded, two oneDNN convolutions carry every other op."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


@pytest.mark.usefixtures("onednn_conv")
@needs_onednn
def test_basic_block_becomes_two_convolutions_with_residual_post_op():
    import ember

    model = BasicBlock(7).eval()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.running_mean.normal_()
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.normal_()
        check_calls(model, torch.randn(2, 7, 10, 9), grad=False, calls=3, **MATMUL_TOL)
        report = ember.explain(model)(torch.randn(2, 7, 10, 9))
    assert report.graphs[0].onednn == ["conv2d f32 +bias relu", "conv2d f32 +bias add relu"]
    # ATen copies the NCHW input to channels-last and the result back (layout.py's CPU rewrite), nothing else
    assert report.graphs[0].folded_batchnorms == 2 and report.graphs[0].aten_ops == {"aten::clone": 2}
    assert "folded  2 batch norm(s)" in str(report)


def _has_avx512():
    with open("/proc/cpuinfo") as f:
        return "avx512f" in f.read()


@pytest.mark.skipif(not _has_avx512(), reason="the AVX2 build is the one this CPU runs anyway")
def test_avx2_build_of_the_cpu_kernels():
    """ember's CPU kernels are built for AVX2 and for AVX-512 and the widest one the CPU runs is taken: on an
    AVX-512 machine the AVX2 build runs only where ATEN_CPU_CAPABILITY=avx2 caps it. This runs the few-rows
    loop's tests and the CPU fused-kernel tests in a process so capped."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "(cpu or few_rows) and not avx2_build",
                        "test_onednn.py", "test_pointwise.py", "test_reductions.py"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=here)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _addmm_in_place_calls(fn, *inputs):
    """How many aten::addmm_ calls a call of fn makes, under torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*inputs)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::addmm_")


@needs_onednn
def test_shared_weight_gradients_accumulate_in_place():
    """A weight used by three layers (ALBERT's sharing) gets the sum of three matmuls as its gradient. Each
    matmul whose addend (the sum so far) dies there is written into the addend by one addmm_ (kernels/cpu/
    matmul_kernel.cpp, point 8) instead of a new result; gradients match eager over calls on fresh inputs."""
    torch.manual_seed(0)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(640, 640, bias=False)  # a 1.6 MiB gradient: past point 8's 1 MiB

        def forward(self, x):
            for _ in range(3):
                x = torch.tanh(self.lin(x))
            return x

    model = Shared()
    x = torch.randn(24, 640)
    check_calls(model, x, **MATMUL_TOL)
    compiled = compile_ember(copy.deepcopy(model))
    for _ in range(2):
        compiled(torch.randn(24, 640)).sum().backward()
    assert _addmm_in_place_calls(lambda t: compiled(t).sum().backward(), torch.randn(24, 640)) >= 2


@needs_onednn
def test_matmul_addend_read_later_is_not_overwritten():
    """The same sum where the addend lives on (an output reads it, or a later op): the matmul writes a new
    result, and every output matches eager."""
    def fn(x1, y1, x2, y2, x3, y3):
        a = x1.t() @ y1
        s = a + x2.t() @ y2
        t = s + x3.t() @ y3
        return t, a * 2, s.sum()

    compiled = compile_ember(fn)
    for _ in range(3):
        inputs = [torch.randn(24, 640) for _ in range(6)]
        check(fn, *inputs, grad=False, compiled=compiled, min_graphs=0, **MATMUL_TOL)
