"""The fuse pass and ember's generated kernels: pointwise chains and last-dimension reductions (softmax,
layer norm, the entropy scorer) that run as one fused kernel. Each test checks against eager and, where
ember has a kernel generator for the device, that a fused kernel really ran (so a group silently left
to ATen cannot pass for a working kernel)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember._C
from helpers import DEVICES, EMBER_GRAPHS, MATMUL_TOL, assert_tensor_close, check, compile_ember

HAS_FUSE = "fuse" in ember._C.pass_names()
pytestmark = pytest.mark.skipif(not HAS_FUSE, reason="this ember has no fuse pass")


def fused_kernels(kind=None):
    """How many fused-kernel steps the plans compiled in this test have (of one graph kind, or all)."""
    return sum(g.describe().count("fused group") for k, g in EMBER_GRAPHS if kind in (None, k))


def expect_fused(device, kind=None, at_least=1):
    n = fused_kernels(kind)  # CPU and CUDA kernels both describe themselves as "... fused group ..."
    assert n >= at_least, f"expected a fused kernel, plans: " + "\n".join(g.describe() for _, g in EMBER_GRAPHS)


# ---------------------------------------------------------------------------------------------------
# pointwise groups
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 70), (4100,), (2, 2500)],
                         ids=["rank0", "one", "seven", "3x5", "rows_of_70", "two_tiles", "long_rows"])
def test_pointwise_chain(device, shape):
    def fn(x, y):
        z = torch.sigmoid(x) * y + torch.tanh(y) - x.exp().log1p()
        return F.gelu(z).abs() + F.silu(z) * F.leaky_relu(x, 0.2), torch.clamp(z, -0.5, 0.7)

    check(fn, torch.randn(shape, device=device), torch.randn(shape, device=device))
    expect_fused(device, "forward")
    expect_fused(device, "backward")


@pytest.mark.parametrize("device", DEVICES)
def test_pointwise_every_lowered_op(device):
    def fn(x, y):
        p = x.abs() + 0.1
        outs = [
            x.neg(), x.exp(), p.log(), x.log1p().nan_to_num(0.0), x.expm1(), x.sin(), x.cos(), x.tanh(), x.sigmoid(),
            x.relu(), p.sqrt(), p.rsqrt(), p.reciprocal(), torch.erf(x), x + y, x - y, x * y, x / p,
            torch.maximum(x, y), torch.minimum(x, y), x ** 2, x ** 3, p ** 0.5, p ** -1, p ** 1.7, x ** 4,
            torch.clamp(x, min=-0.3), torch.clamp(x, max=0.3), F.hardtanh(x), F.gelu(x, approximate="tanh"),
            torch.where(x > y, x, y), (x >= y).float(), (x < 0.2).float(), (x <= y).float(), (x == x).float(),
            (x != y).float(), torch.logical_not(x > 0).float(), torch.rsub(x, 2.0), x.half().float(),
            x.bfloat16().float(),
        ]
        return tuple(o * 1.5 + 1 for o in outs)  # each op in a group with at least two more

    check(fn, torch.randn(5, 67, device=device), torch.randn(5, 67, device=device), atol=1e-4, rtol=1e-4)
    # Siblings reading x share groups (passes/fuse.cpp rule 5): a few groups of many outputs.
    expect_fused(device, "forward", at_least=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_hard_activations_fuse_with_their_neighbours(device, dtype):
    """hardswish (which the decompositions keep whole) and hardsigmoid run inside the fused kernel of what
    surrounds them, in ATen's form (relu6(x + 3) / 6, times x for hardswish): at the kinks, at +-inf and NaN
    too, and the backward (ATen's hardswish_backward) still matches."""

    def fn(x, y):
        return F.hardswish(x * 2 + y) - y, F.hardsigmoid(x - y) * y

    x = torch.randn(7, 129, device=device) * 4
    x[0, :8] = torch.tensor([-1.5, 1.5, -1.0, 0.0, float("inf"), float("-inf"), float("nan"), -3.0])
    y = torch.randn(7, 129, device=device)
    y[0, :8] = 0.0  # x * 2 + y: -3, 3, -2, 0, inf, -inf, NaN, -6
    x, y = x.to(dtype), y.to(dtype)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    check(fn, x, y, grad=False, **tol)
    assert not any("aten::hardswish" in g.describe() for _, g in EMBER_GRAPHS), "hardswish ran as an ATen call"
    expect_fused(device, "inference")
    check(fn, torch.randn(5, 67, device=device, dtype=dtype), torch.randn(5, 67, device=device, dtype=dtype), **tol)
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_channels_last_pointwise_groups_keep_eager_layout(device, dtype):
    """A pointwise chain over channels_last tensors, with a per-channel broadcast and an input in NCHW beside
    them, runs as one kernel in memory order on the CPU as on CUDA: eager's values and strides, forward and
    backward, and under a symbolic batch one kernel serves every size."""

    def fn(x, y, s):
        return torch.relu(x * s + y) * 0.5, (x - y).sigmoid()

    def inputs(n, c=16, h=7, w=9, y_layout=torch.channels_last):
        x = torch.randn(n, c, h, w, device=device).to(dtype=dtype, memory_format=torch.channels_last)
        y = torch.randn(n, c, h, w, device=device).to(dtype=dtype, memory_format=y_layout)
        return x, y, torch.randn(c, 1, 1, device=device, dtype=dtype)

    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for y_layout in (torch.channels_last, torch.contiguous_format):
        torch._dynamo.reset()
        eager, compiled = check(fn, *inputs(3, y_layout=y_layout), **tol)
        assert [t.stride() for t in compiled] == [t.stride() for t in eager]
    expect_fused(device, "forward")
    expect_fused(device, "backward")
    torch._dynamo.reset()
    compiled = compile_ember(fn)
    with torch.no_grad():
        for n in (2, 5, 8, 1):
            x, y, s = inputs(n)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
            for got, want in zip(compiled(x, y, s), fn(x, y, s)):
                assert_tensor_close(got, want, **tol)
                if n > 1:
                    assert got.stride() == want.stride()


@pytest.mark.parametrize("device", DEVICES)
def test_batch_norm_after_a_linear_fuses_in_inference(device):
    """LeViT's Linear -> BatchNorm1d over the flattened rows -> reshape -> hardswish, in eval mode: the norm
    becomes a per-channel multiply-add (scale and shift computed once from the cached parameters) and the
    hardswish joins its fused kernel across the reshape, on the CPU as on CUDA, at a static batch and at a
    symbolic one, and the results stay eager's."""

    class LinearNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(32, 48, bias=False), nn.BatchNorm1d(48)

        def forward(self, x):
            return F.hardswish(self.bn(self.fc(x).flatten(0, 1)).reshape(x.shape[0], x.shape[1], -1))

    model = LinearNorm().eval().to(device)
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.normal_()
        model.bn.bias.normal_()
    compiled = compile_ember(model)
    before = len(EMBER_GRAPHS)
    with torch.no_grad():
        for batch in (2, 2, 5):  # the second call runs on the cached scale and shift
            x = torch.randn(batch, 9, 32, device=device)
            assert_tensor_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    plans = "\n".join(g.describe() for _, g in EMBER_GRAPHS[before:])
    assert "_native_batch_norm" not in plans, plans
    # The hardswish behind the reshape joins the multiply-add's kernel (fuse's lift_over_reshapes).
    assert "aten::hardswish" not in plans, plans
    expect_fused(device, "inference")


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_and_strided_inputs(device):
    def fn(x, row, col, s, t, sl):
        return (x * row + col - s).sin() * t + sl

    x = torch.randn(6, 80, device=device)
    row = torch.randn(80, device=device)
    col = torch.randn(6, 1, device=device)
    s = torch.randn((), device=device)
    t = torch.randn(80, 6, device=device).t()  # transposed: inner stride 6
    sl = torch.randn(12, 80, device=device)[::2]  # sliced rows
    check(fn, x, row, col, s, t, sl)
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
def test_short_rows_with_broadcast_gather(device):
    def fn(x, y):
        return (x * y).exp() + y

    check(fn, torch.randn(3, 5, 7, device=device), torch.randn(5, 1, device=device)[:, ::1])
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
def test_integer_and_bool_inputs_into_float_groups(device):
    def fn(i, m, x):
        return (i * x + m).sin(), torch.where(m, x, -x) * 2, (x > 0) & m

    check(fn, torch.randint(-5, 5, (4, 9), device=device), torch.rand(4, 9, device=device) > 0.5,
          torch.randn(4, 9, device=device), grad=[2])
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_storage(device, dtype):
    def fn(x, y):
        return (x * y).sigmoid() + x.tanh(), (x - y).softmax(-1), x.float() * 2

    check(fn, torch.randn(4, 33, device=device, dtype=dtype), torch.randn(4, 33, device=device, dtype=dtype),
          atol=1e-2, rtol=1e-2)
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_through_fused_kernels(device):
    x = torch.randn(3, 70, device=device)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 7] = float("-inf")

    def fn(x):
        y = x * 2
        return (y.relu() + 1, torch.clamp(y, -1, 1) * 3, torch.maximum(y, -y) + 0, y.amax(-1) + 1, y.amin(-1) - 1,
                (y - 1).sum(-1), (y * 0.5).softmax(-1), y.sigmoid() * 2, y.isnan().float() + 1)

    check(fn, x, grad=False)
    expect_fused(device, "inference")


# ---------------------------------------------------------------------------------------------------
# row reductions
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(4, 1), (3, 7), (2, 3, 300), (300,), (5, 2100)],
                         ids=["last_dim_1", "3x7", "rank3", "rank1", "long_rows"])
def test_softmax_layernorm_entropy_groups(device, shape):
    n = shape[-1]
    model = nn.LayerNorm(n).to(device)
    with torch.no_grad():
        model.weight.uniform_(0.5, 1.5)
        model.bias.uniform_(-0.5, 0.5)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = model

        def forward(self, x):
            h = self.ln(x * 2 + 1).relu()
            p = torch.softmax(h, -1)
            entropy = -(p * torch.log(p + 1e-8)).sum(-1)
            return p, F.log_softmax(x - 1, -1), entropy, (x * x).mean(-1, keepdim=True).rsqrt() * x

    check(M().to(device), torch.randn(shape, device=device) * 3, **MATMUL_TOL)
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keepdim", [False, True], ids=["nokeep", "keep"])
def test_reductions_then_row_and_full_consumers(device, keepdim):
    def fn(x, b_row, b_full):
        m = x.amax(-1, keepdim=keepdim)
        s = (x - (m if keepdim else m.unsqueeze(-1))).exp().sum(-1, keepdim=keepdim)
        r = s.log() * 2 + m  # row consumers
        lo = x.amin(-1, keepdim=True) + b_full  # keepdim row value broadcast over full rows
        return r + b_row, lo, (x * 3).mean(-1)

    b_row = torch.randn(5, 1, device=device) if keepdim else torch.randn(5, device=device)
    check(fn, torch.randn(5, 9, device=device), b_row, torch.randn(9, device=device), **MATMUL_TOL)
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
def test_square_row_broadcast_is_not_confused_with_rows(device):
    """x is n x n: a non-keepdim row value r (shape [n]) broadcasts along the LAST dim in x + r."""

    def fn(x):
        r = (x * 2).sum(-1)
        return (x + r).exp(), (x + r.unsqueeze(-1)).exp()

    check(fn, torch.randn(6, 6, device=device) * 0.1, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_reductions(device):
    def fn(x, y):
        return (x * 2).sum(-1) + 1, (x * 2).mean(-1) + 1, (y * 2).softmax(-1) + 1, (y + 1).sum(-1) * 2

    check(fn, torch.randn(3, 0, device=device), torch.randn(0, 5, device=device), grad=False)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_reduction_over_non_contiguous_rows(device):
    def fn(x, y):
        return (x * 2).softmax(-1), (y * 2).sum(-1), F.layer_norm(y + 1, (y.shape[-1],))

    x = torch.randn(70, 8, device=device).t()  # rows with stride 8... reading along stride 8
    y = torch.randn(16, 70, device=device)[::2, 3:]
    check(fn, x, y, **MATMUL_TOL)
    expect_fused(device, "forward")


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_shapes_through_fused_kernels(device):
    def fn(x, b):
        return ((x + b) * x.shape[0]).softmax(-1), F.layer_norm(x, (x.shape[-1],)).sigmoid() * 2

    compiled = compile_ember(fn, dynamic=True)
    for i, (n, m) in enumerate([(3, 5), (7, 9), (16, 130)]):
        check(fn, torch.randn(n, m, device=device), torch.randn(m, device=device), compiled=compiled,
              min_graphs=0 if i else 1, **MATMUL_TOL)
    expect_fused(device, "forward")
    assert len(EMBER_GRAPHS) <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_disabling_fuse_gives_the_same_results(device):
    def fn(x):
        return (x.sin() * 2 + 1).softmax(-1), F.gelu(x) * x

    x = torch.randn(4, 50, device=device)
    e, with_fuse = check(fn, x)
    n_fused = fused_kernels()
    EMBER_GRAPHS.clear()
    torch._dynamo.reset()
    _, without = check(fn, x, options={"disable_passes": ["fuse"]})
    assert fused_kernels() == 0
    if device == "cpu":
        assert n_fused >= 1
    for a, b in zip(with_fuse, without):
        assert_tensor_close(a, b, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------
# regressions: each case below once gave wrong results in fused kernels (the reason says how)
# ---------------------------------------------------------------------------------------------------


def devices_with_cpu_bug(reason):
    """Every device; `reason` records the fused-kernel bug this case caught (fixed)."""
    return DEVICES


@pytest.mark.parametrize("device", devices_with_cpu_bug(
    "fused kernels load every input as float32, so comparisons of int64/int32 values above 2**24 or of float64 "
    "values lose precision"))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float64], ids=["int64", "int32", "float64"])
def test_exact_comparisons_of_wide_dtypes(device, dtype):
    if dtype.is_floating_point:
        a = torch.ones(8, dtype=dtype, device=device) + 1e-10
        b = torch.ones(8, dtype=dtype, device=device)
    else:
        a = torch.full((8,), 2 ** 24 + 1, dtype=dtype, device=device)
        b = torch.full((8,), 2 ** 24, dtype=dtype, device=device)

    def fn(a, b, x, y):
        return torch.where(a > b, x, y), (a == b).float() * x

    check(fn, a, b, torch.randn(8, device=device), torch.randn(8, device=device))


@pytest.mark.parametrize("device", devices_with_cpu_bug(
    "the fuse pass puts ops reading float8 / uint16 / uint32 tensors into fused groups, whose CPU kernel then "
    "raises at run time ('fused CPU kernel: unsupported input dtype ...'), with no fallback"))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32],
                         ids=["f8e4m3", "f8e5m2", "u16", "u32"])
def test_inputs_of_dtypes_the_kernel_cannot_load(device, dtype):
    def fn(x):
        return x.to(dtype).to(torch.float32) * 2 + 1

    check(fn, torch.rand(4, 8, device=device) * 5, grad=False)


@pytest.mark.parametrize("device", devices_with_cpu_bug(
    "fused kernels keep fp16/bf16 intermediates in float32 instead of rounding each value to its storage dtype "
    "as eager does (the comment in kernels/program.cpp define() says they are rounded)"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_intermediates_round_like_eager(device, dtype):
    big = 1024.0 if dtype == torch.float16 else 256.0  # where the dtype's spacing is 1.0

    def fn(x):
        return (x + big) - big, (x * 1000) * 1000 / 1e6

    x = torch.randn(64, device=device).to(dtype) * 3
    check(fn, x, grad=False)


@pytest.mark.parametrize("device", devices_with_cpu_bug(
    "fused kernels always allocate contiguous outputs, not eager's strides (e.g. permuted layouts), so a later "
    "aten::view in the graph fails"))
def test_fused_output_keeps_eager_layout(device):
    def fn(x):
        y = (x.permute(1, 0, 2) * 2).sin()  # eager: y keeps x's memory order, strides (5, 20, 1)
        return y, y.transpose(0, 1).view(-1)  # valid view for eager's layout only

    x = torch.randn(3, 4, 5, device=device)
    e, c = check(fn, x)
    assert c[0].stride() == e[0].stride()


@pytest.mark.parametrize("device", DEVICES)
def test_steps_on_constants_fold_at_compile_time(device):
    """An arange and a causal mask built from shapes alone (as HF's GPT-2 builds its mask) run once, at
    compile time (runtime/plan.cpp, fold_constant_steps); each call still sees the right values, with
    gradients, and a folded value returned to the caller stays a fresh tensor per call."""

    def fn(x):
        n = x.shape[-1]
        pos = torch.arange(n, device=x.device, dtype=x.dtype) * 0.5
        mask = torch.ones(n, n, device=x.device, dtype=torch.bool).tril()
        scores = (x.unsqueeze(-1) * x.unsqueeze(-2) + pos).masked_fill(~mask, float("-inf"))
        return scores.softmax(-1), pos

    compiled = compile_ember(fn)
    for _ in range(3):
        x = torch.randn(4, 9, device=device)
        check(fn, x, compiled=compiled, min_graphs=0)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "folded into constants at compile time" in listing, listing
    with torch.no_grad():
        first = compiled(torch.randn(4, 9, device=device))[1]
        first.zero_()  # the caller writes to what it got
        again = compiled(torch.randn(4, 9, device=device))[1]
    assert_tensor_close(again, torch.arange(9, device=device, dtype=torch.float32) * 0.5)


# ---------------------------------------------------------------------------------------------------
# column groups: reductions over leading dimensions (a bias gradient's sum over the batch)
# ---------------------------------------------------------------------------------------------------


def column_kernels():
    return sum(g.describe().count("column reductions") for _, g in EMBER_GRAPHS)


def expect_columns(device, at_least=1):
    assert column_kernels() >= at_least, "\n".join(g.describe() for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(64, 33), (5, 7, 130), (1000, 10), (3, 2000), (2, 3, 5, 6), (600, 1)],
                         ids=["64x33", "5x7x130", "tall_narrow", "wide", "rank4", "one_column"])
def test_column_reductions_with_prologue_and_epilogue(device, shape):
    def fn(x, b, scale):
        y = torch.relu(x * 2 + b)  # full output, read by the caller
        return (y, y.sum(0) * scale - 1, (x * x).mean(0, keepdim=True).sqrt(), (x - b).amax(0), (x + 1).amin(0) * 2)

    x = torch.randn(shape, device=device)
    check(fn, x, torch.randn(shape[-1], device=device), torch.randn(shape[1:], device=device), **MATMUL_TOL)
    expect_columns(device)


@pytest.mark.parametrize("device", DEVICES)
def test_column_reductions_over_several_leading_dims(device):
    def fn(x, g):
        return (x * g).sum((0, 1)), (x * g).sum((0, 1), keepdim=True) + 1, g.mean((0, 1, 2)) * 3

    x = torch.randn(4, 9, 5, 6, device=device)
    check(fn, x, torch.randn(4, 9, 5, 6, device=device), **MATMUL_TOL)
    expect_columns(device)


@pytest.mark.parametrize("device", DEVICES)
def test_column_reductions_read_strided_and_broadcast_inputs(device):
    def fn(x, y, c):
        return (x * y + c).sum(0) * c, (x.exp() * y).amax(0)

    x = torch.randn(40, 70, device=device)[::2, 3:]  # strided rows
    y = torch.randn(67, 20, device=device).t()  # transposed
    c = torch.randn(67, device=device)
    check(fn, x, y, c, **MATMUL_TOL)
    expect_columns(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_column_reductions_in_low_precision(device, dtype):
    def fn(x, b):
        y = (x * 1.5 + b).relu()
        return y, y.sum(0), (x * x).mean(0)

    x = torch.randn(300, 48, device=device, dtype=dtype)
    check(fn, x, torch.randn(48, device=device, dtype=dtype), atol=2e-2, rtol=2e-2, grad=False)
    expect_columns(device)


@pytest.mark.parametrize("device", DEVICES)
def test_column_reductions_propagate_nan_and_inf(device):
    def fn(x):
        return (x * 2).sum(0), (x * 2).amax(0), (x + 1).amin(0), (x * 3).mean(0)

    x = torch.randn(50, 8, device=device)
    x[3, 1] = float("nan")
    x[7, 2] = float("inf")
    x[9, 3] = float("-inf")
    check(fn, x, grad=False)
    expect_columns(device)


@pytest.mark.parametrize("device", DEVICES)
def test_column_reductions_of_empty_tensors(device):
    def fn(x, y):
        return (x * 2).sum(0) + 1, (x * 2).mean(0) + 1, (y * 2).sum(0) + 1

    check(fn, torch.randn(0, 5, device=device), torch.randn(4, 0, device=device), grad=False)


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_backward_fuses_bias_gradients(device):
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 7)).to(device)
    check(model, torch.randn(33, 24, device=device), **MATMUL_TOL)
    backward = [g for k, g in EMBER_GRAPHS if k == "backward"]
    assert backward and "column reductions" in backward[0].describe(), backward[0].describe()


@pytest.mark.parametrize("device", DEVICES)
def test_large_column_sums_round_like_eager(device):
    """A sum down 20000 rows: on the CPU folded 128 rows at a time, on CUDA split into chunks of rows
    over blocks and combined in chunk order; either way within float32 rounding of eager's."""
    def fn(x):
        return (x + 0.5).sum(0), (x * x).mean(0)

    check(fn, torch.randn(20000, 12, device=device), grad=False, atol=1e-3, rtol=1e-5)
    expect_columns(device)
    check(fn, torch.randn(1000, 12, device=device), grad=False, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1024, 768), (1000, 3072), (4096, 96), (200000, 4), (64, 768), (8, 128, 768)],
                         ids=["bias_grad", "odd_rows", "narrow", "tall", "few_rows", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_column_reductions_split_over_row_chunks(shape, dtype):
    """CUDA column kernels split many rows over few columns into chunks (call_plan.h): every reduction
    kind, an epilogue reading a column input, a full output; and the same bits on every call (the
    chunks combine in order, whichever block ends last)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lead = tuple(range(len(shape) - 1))

    def fn(x, c):
        y = x * 1.5 - 0.25
        return y, y.sum(lead) * c, (x * x).mean(lead), x.amax(lead), (x - 1).amin(lead) + c

    x = torch.randn(shape, device="cuda", dtype=dtype)
    c = torch.randn(shape[-1], device="cuda", dtype=dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-4)
    check(fn, x, c, grad=False, **tol)
    expect_columns("cuda")
    compiled = compile_ember(fn)
    first = compiled(x, c)
    for _ in range(3):
        for a, b in zip(first, compiled(x, c)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(3001, 24), (1000, 8), (513, 200), (700, 3), (45, 7), (4, 3, 50, 16), (49, 1024),
                                   (3, 5000)],
                         ids=["bn_rows", "c8", "c200", "c3", "few_rows", "rank4", "row_per_block", "wider_than_blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_column_reductions_over_few_columns_in_row_blocks(shape, dtype):
    """The CPU runs column groups of up to 4096 columns in blocks of whole rows (kernels/cpu/interpreter.cpp,
    run_columns): a short last block, several parts over the threads, every reduction kind, an input broadcast
    along the rows, a full output; a batch norm backward's shape of group (ReLU backward, scale, two sums)."""
    lead = tuple(range(len(shape) - 1))

    def fn(g, y, x, mean, scale):
        t = torch.ops.aten.threshold_backward(g, y, 0)
        return (t * scale, (t * (x - mean)).sum(lead) * scale, t.sum(lead), (x * x).mean(lead), x.amax(lead),
                (x - mean).amin(lead))

    g, y, x = (torch.randn(shape, dtype=dtype) for _ in range(3))
    mean, scale = torch.randn(shape[-1], dtype=dtype), torch.rand(shape[-1], dtype=dtype)
    tol = dict(atol=5e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-4)
    check(fn, g, y, x, mean, scale, grad=False, **tol)
    expect_columns("cpu")


def test_lone_column_sums_run_as_cuda_kernels():
    """A bias gradient's sum over the rows of a matmul's result (nothing to fuse it with) is a column
    kernel of its own on CUDA, keepdim or not, over one leading dim or two."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def fn(a, w):
        m = a @ w
        return m.sum(0), m.sum(0, keepdim=True), m.view(4, 256, 96).sum((0, 1)), m.mean(0)

    check(fn, torch.randn(1024, 64, device="cuda"), torch.randn(64, 96, device="cuda"), **MATMUL_TOL)
    expect_columns("cuda", at_least=1)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradient_of_a_residual_sum_made_in_a_matmul_epilogue(device):
    """z feeds a linear and a residual add: its gradient is one matmul's result plus the add's, which the
    CPU adds in the matmul's epilogue (oneDNN), viewed as [B*S, H] in the same group. The next bias
    gradient's sum over that view must not read the epilogue's inner [B, S, H] value, which no buffer holds
    (it did: 'Expected Tensor but got None', ELECTRA's and ALBERT's training steps)."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            z = self.a(x)
            return self.c(torch.tanh(z + self.b(z)))

    check(Residual().to(device), torch.randn(2, 5, 16, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradients_of_3d_linears_fuse_through_the_reshape(device):
    """Linear layers over [B, S, H]: AOTAutograd's backward sums each bias gradient over a [B*S, H] view
    of the gradient; the fuse pass reads the [B, S, H] gradient instead, so the sum joins the kernel that
    makes it (gelu's backward); a residual's gradient terms, one per matmul, add up in one kernel."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
            self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = x + self.down(F.gelu(self.up(x)))
            return h + self.q(h) * self.k(h).sigmoid() + self.v(h)

    model = Block().to(device)
    check(model, torch.randn(4, 32, 64, device=device), **MATMUL_TOL)
    backward = [g for k, g in EMBER_GRAPHS if k == "backward"]
    assert backward, [k for k, _ in EMBER_GRAPHS]
    steps = backward[0].steps()
    assert not any(what == "aten::gelu_backward" for kind, what in steps), steps
    if device == "cuda":
        assert backward[0].describe().count("column reductions") >= 5, backward[0].describe()
        assert not any(what == "aten::sum.dim_IntList" for kind, what in steps), steps


@pytest.mark.parametrize("device", DEVICES)
def test_silu_backward_fuses(device):
    """SiLU's backward (kept whole by the decompositions) is lowered into the fused kernel with its neighbours
    (kernels/program.cpp), as gelu's is; gradients against eager."""
    model = nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 48), nn.SiLU()).to(device)
    check(model, torch.randn(6, 20, 48, device=device), **MATMUL_TOL)
    backward = [g for k, g in EMBER_GRAPHS if k == "backward"]
    assert backward, [k for k, _ in EMBER_GRAPHS]
    steps = backward[0].steps()
    assert not any(what == "aten::silu_backward" for kind, what in steps), steps


def _rotary(device, dtype=torch.float32, heads=4, head_dim=32):
    """A rotary embedding as Hugging Face's decoders write it, over a transposed projection of h [b, s, 64]."""
    proj = nn.Linear(64, heads * head_dim, bias=False).to(device, dtype)
    half = head_dim // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def fn(h, cos, sin):
        q = proj(h).view(h.shape[0], h.shape[1], heads, head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin

    return fn


def _rotary_inputs(device, dtype=torch.float32, batch=2, seq=12, head_dim=32):
    h = torch.randn(batch, seq, 64, device=device, dtype=dtype)
    cos, sin = torch.randn(2, 1, 1, seq, head_dim, device=device, dtype=dtype)
    return h, cos, sin


def _aten_steps():
    return [what for _, g in EMBER_GRAPHS for kind, what in g.steps() if "fused" not in what]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rotary_embedding_is_one_kernel(device, dtype):
    """LLaMA's rotary embedding: q * cos + rotate_half(q) * sin, q a transposed projection and rotate_half a cat of
    its negated upper half and its lower half. passes/rotate_half.cpp writes the rotation as a where over q's last
    dim split in two, and the fuse pass makes it, the two multiplies and the add one kernel: no neg, cat, multiply
    or add is left to ATen. Results against eager."""
    tol = MATMUL_TOL if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    with torch.no_grad():
        check(_rotary(device, dtype), *_rotary_inputs(device, dtype), grad=False, **tol)
    steps = _aten_steps()
    assert not any(w in ("aten::neg", "aten::cat", "aten::mul.Tensor", "aten::add.Tensor") for w in steps), steps
    assert fused_kernels() == 1, "\n".join(g.describe() for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_over_symbolic_lengths(device):
    """The same over lengths 12, 20 and 7: the second compiles a graph with the length symbolic (automatic
    dynamic), which serves the third; each against eager, the rotation still in one kernel (its split dim, the
    head size, stays static)."""
    fn = _rotary(device)
    compiled = compile_ember(fn)
    with torch.no_grad():
        for i, seq in enumerate((12, 20, 7)):
            check(fn, *_rotary_inputs(device, seq=seq), grad=False, compiled=compiled, min_graphs=int(i < 2), **MATMUL_TOL)
    assert len(EMBER_GRAPHS) == 2
    symbolic = EMBER_GRAPHS[1][1]
    steps = [what for _, what in symbolic.steps()]
    assert not any(w in ("aten::neg", "aten::cat") for w in steps), steps
    assert symbolic.describe().count("fused group") == 1, symbolic.describe()


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_trains(device):
    """Training: the forward's rotation is rewritten, its cat's backward is not; q's projection, cos and sin get
    eager's gradients, and the rotated tensor, saved for nothing, is not kept as an output of the forward."""
    check(_rotary(device), *_rotary_inputs(device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_rotations_that_are_not_rotate_half_stay_cats(device):
    """Near misses keep their cat and eager's results: halves in the other order, the negation on the lower half,
    slices that do not meet at the middle, and a rotation that is also returned and read by a matmul (flattened
    back for them)."""
    x = torch.randn(3, 5, 16, device=device)
    w = torch.randn(16, 8, device=device)

    def fn(x, w):
        swapped = torch.cat((x[..., :8], -x[..., 8:]), dim=-1)
        lower = torch.cat((x[..., 8:], -x[..., :8]), dim=-1)
        uneven = torch.cat((-x[..., 6:], x[..., :6]), dim=-1)
        rotated = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
        return swapped * 2 + 1, lower * 3 - x, uneven * x, rotated, (rotated * x + 1) @ w

    with torch.no_grad():
        check(fn, x, w, grad=False, **MATMUL_TOL)
    assert _aten_steps().count("aten::cat") == 3, _aten_steps()
