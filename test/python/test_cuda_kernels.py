"""ember's generated CUDA kernels against eager: the flat kernel's 16-byte vector path and its strided
fallback (broadcast, transposed and misaligned inputs), and the row kernels (a warp per row, a block per
row with the row in registers, the general kernel for long rows) for softmax, log_softmax, layer norm
and the entropy scorer, in f32, f16 and bf16, at row lengths around every variant's edges.

Inputs go to eager and ember as they are (not copied), so a slice that starts one element into its
storage reaches the kernel misaligned. Each test also checks that a CUDA fused kernel ran.
"""

import pytest
import torch
import torch.nn.functional as F

import ember
from helpers import EMBER_GRAPHS, assert_same, compile_ember

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# Row reductions in 16-bit: eager reduces in float and rounds once, as ember does, but the pre-scale
# rounds differently inside a fused group than between two eager kernels.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.6e-2, 2e-2)}


def cuda_fused_kernels():
    return sum(g.describe().count("cuda fused group") for _, g in EMBER_GRAPHS)


def compare(fn, *inputs, dynamic=False, compiled=None):
    """fn eagerly and through ember on the same inputs; the outputs must agree."""
    atol, rtol = TOL[inputs[0].dtype]
    before = cuda_fused_kernels()
    compiled = compiled or compile_ember(fn, dynamic=dynamic)
    with torch.no_grad():
        expected = fn(*inputs)
        actual = compiled(*inputs)
    assert_same(actual, expected, atol=atol, rtol=rtol)
    return compiled, cuda_fused_kernels() - before


def misaligned(*shape, dtype):
    """A contiguous tensor whose data starts one element into its storage: no 16-byte loads."""
    n = 1
    for s in shape:
        n *= s
    t = torch.randn(n + 1, device="cuda", dtype=dtype)[1:].view(shape)
    assert t.data_ptr() % 16 != 0
    return t


# ---------------------------------------------------------------------------------------------------
# flat groups
# ---------------------------------------------------------------------------------------------------


def silu_add(x, y):
    return x * torch.sigmoid(x) + y


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", [1, 7, 8, 1023, 4097, 1 << 20 | 3])
def test_flat_contiguous_and_tail(dtype, numel):
    x, y = (torch.randn(numel, device="cuda", dtype=dtype) for _ in range(2))
    _, kernels = compare(silu_add, x, y)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", [1, 7, 1023, 4097])
def test_flat_broadcast_transposed_misaligned(dtype, cols):
    def fn(x, bias, col, scalar, xt, xm):
        return (x * bias + col).sin() * scalar + xt - xm * 0.5

    rows = 33
    x = torch.randn(rows, cols, device="cuda", dtype=dtype)
    bias = torch.randn(cols, device="cuda", dtype=dtype)  # broadcast over rows
    col = torch.randn(rows, 1, device="cuda", dtype=dtype)  # broadcast over columns
    scalar = torch.randn((), device="cuda", dtype=dtype)  # one value for all
    xt = torch.randn(cols, rows, device="cuda", dtype=dtype).t()  # non-contiguous
    xm = misaligned(rows, cols, dtype=dtype)
    _, kernels = compare(fn, x, bias, col, scalar, xt, xm)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", [(1 << 24) + 5, 3 * 1024 * 8 + 8])
def test_flat_vector_entry_grid_stride(dtype, numel):
    """Contiguous inputs, a bias and one value: the vector entry without strided inputs, over many
    iterations of its one-wave grid (16M elements) and over a count that leaves some of a thread's
    4 vectors past the end."""

    def fn(x, y, bias, scalar):
        return x * torch.sigmoid(x) + y * bias - scalar

    cols = 8 * 16
    x, y = (torch.randn(numel // cols, cols, device="cuda", dtype=dtype) for _ in range(2))
    bias = torch.randn(cols, device="cuda", dtype=dtype)
    scalar = torch.randn((), device="cuda", dtype=dtype)
    _, kernels = compare(fn, x, y, bias, scalar)
    assert kernels >= 1
    flat = torch.randn(numel, device="cuda", dtype=dtype)
    compare(silu_add, flat, flat.flip(0))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hw", [(6, 6), (7, 7), (16, 16), (1, 1)], ids=["6x6", "7x7", "16x16", "1x1"])
def test_flat_per_channel_inputs_read_by_channel(dtype, hw):
    """NCHW per-channel tensors ([C, 1, 1], [1, C, 1, 1]) and per-sample ones ([N, 1, 1, 1]) beside a
    contiguous input: read by channel in the vector entry, whether or not a vector stays in one channel
    (H * W a multiple of the vector width or not)."""

    def fn(x, w, b, s):
        return torch.relu((x - b) * w + b) * s

    n, c = 4, 24
    x = torch.randn(n, c, *hw, device="cuda", dtype=dtype)
    w = torch.randn(c, 1, 1, device="cuda", dtype=dtype)
    b = torch.randn(1, c, 1, 1, device="cuda", dtype=dtype)
    s = torch.randn(n, 1, 1, 1, device="cuda", dtype=dtype)
    _, kernels = compare(fn, x, w, b, s)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_flat_tail_reads_inputs_by_their_mode(dtype, dynamic):
    """Element counts that leave a tail past the last vector (525 = 3 * 7 * 5 * 5, then 1155): the tail
    reads each input as its vectors do, contiguous, by channel ([C, 1, 1]), as a repeating period (a
    bias over the last dim) and as one value."""

    def fn(x, w, bias, s):
        return (x * w + bias) * s - x.exp()

    compiled, kernels = None, 0
    for n, c in [(3, 7), (3, 11)]:  # under dynamic shapes the second runs the first's kernels
        x = torch.randn(n, c, 5, 5, device="cuda", dtype=dtype)
        w = torch.randn(c, 1, 1, device="cuda", dtype=dtype)
        bias = torch.randn(5, device="cuda", dtype=dtype)
        s = torch.randn((), device="cuda", dtype=dtype)
        compiled, new = compare(fn, x, w, bias, s, dynamic=dynamic, compiled=compiled)
        kernels += new
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_flat_sin_cos_over_every_argument_range(dtype):
    """sin and cos inline only their short-argument path (|x| < 48039) and call one out-of-line copy
    beyond it: arguments on both sides of that bound, up to 1e30, and inf and nan, in one kernel."""

    def fn(x):
        return x.sin() * 2.0 + x.cos()

    mags = torch.logspace(-3, 4.8 if dtype == torch.float16 else 30, 4099, device="cuda")
    x = (mags * torch.randn(4099, device="cuda").sign()).to(dtype)
    x[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    x[3:7] = torch.tensor([48038.0, 48039.0, 48040.0, -48039.0], dtype=dtype)
    _, kernels = compare(fn, x)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_flat_strided_vector_entry_misaligned_one_input(dtype):
    """One misaligned input beside aligned ones: the strided vector entry."""
    n = (1 << 16) + 9
    x = misaligned(n, dtype=dtype)
    y = torch.randn(n, device="cuda", dtype=dtype)
    _, kernels = compare(silu_add, y, x)
    assert kernels >= 1


def strided_heads(layout, dtype, b=2, s=12, h=4, d=32):
    """A [b, h, s, d] view of a [b, s, h * d] projection, as attention heads are (q.view(...).transpose(1, 2)),
    laid out as `layout` says."""
    if layout == "heads":  # rows contiguous and aligned: a vector load per row piece
        return torch.randn(b, s, h * d, device="cuda", dtype=dtype).view(b, s, h, d).transpose(1, 2)
    if layout == "heads_misaligned":  # the same one element into its storage: one offset, element loads
        return misaligned(b, s, h * d, dtype=dtype).view(b, s, h, d).transpose(1, 2)
    if layout == "padded_rows":  # a row pitch of h * d + 1: rows start unaligned
        return torch.randn(b, s, h * d + 1, device="cuda", dtype=dtype)[..., : h * d].view(b, s, h, d).transpose(1, 2)
    if layout == "inner_strided":  # the innermost dim strided (s apart)
        return torch.randn(b, h, d, s, device="cuda", dtype=dtype).transpose(-1, -2)
    if layout == "odd_rows":  # rows of 30: a vector crosses rows, each element through its strides
        return torch.randn(b, s, h * 30, device="cuda", dtype=dtype).view(b, s, h, 30).transpose(1, 2)
    raise ValueError(layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["heads", "heads_misaligned", "padded_rows", "inner_strided", "odd_rows"])
def test_flat_strided_inputs_read_a_vector_per_row(dtype, layout):
    """The strided vector entry where the innermost size is a multiple of the vector width: an input read
    through its strides takes one offset per vector (and a vector load where its rows are contiguous and
    aligned), beside a broadcast [1, 1, s, d] input and a contiguous one, as in a rotary embedding. Also
    under dynamic shapes, whose sizes reach the kernel per call."""

    def fn(x, cos, y):
        return x * cos + y * 0.5

    for dynamic in (False, True):
        x = strided_heads(layout, dtype)
        cos = torch.randn(1, 1, *x.shape[2:], device="cuda", dtype=dtype)
        y = torch.randn(x.shape, device="cuda", dtype=dtype)
        _, kernels = compare(fn, x, cos, y, dynamic=dynamic)
        assert kernels >= 1


@pytest.mark.parametrize("rows", [1, 3000])
def test_bf16_stores_round_as_eager(rows):
    """bf16 outputs convert with eager's rounding and eager's NaN (of either sign, any payload, in): a flat
    kernel's outputs must be eager's bits, NaNs included; a row kernel's NaNs must fall where eager's do, with
    eager's bits (its sums may round otherwise than eager's). Eager's CUDA kernels store __float2bfloat16's
    0x7fff on sm_80+ (as seen on an H200), c10's host rule 0x7fc0 before."""
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16) * 4
    bits = x.view(torch.int16)
    bits[0, 5] = 0x7FC1  # a NaN with a payload
    bits[0, 18] = -0x0001  # 0xffff: a negative NaN
    x[0, 31] = float("inf")
    x[-1, 1023] = float("nan")

    def flat(x):
        return x * 3 + 1

    def rows_fn(x):
        return torch.softmax(x / 8, -1)

    for fn in (flat, rows_fn):
        compiled = compile_ember(fn)
        with torch.no_grad():
            expected, actual = fn(x), compiled(x)
        nan = expected.isnan()
        assert torch.equal(actual.isnan(), nan)
        assert torch.equal(actual.view(torch.int16)[nan], expected.view(torch.int16)[nan])
        if fn is flat:
            assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))


def test_flat_mixed_dtypes_and_bool():
    def fn(x, h, m):
        return torch.where(m, x.float() * 2, h.float()).exp().half(), (x * 3 > 0)

    x = torch.randn(1000, 37, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(1000, 37, device="cuda", dtype=torch.float16)
    m = torch.randn(1000, 37, device="cuda") > 0
    _, kernels = compare(fn, x, h, m)
    assert kernels >= 1


def test_flat_misaligned_output_sized_inputs_and_shapes_under_dynamic():
    compiled = None
    for n in (4097, 8, 1 << 16, 3):
        x = misaligned(n, dtype=torch.float32)
        y = torch.randn(n, device="cuda")
        compiled, _ = compare(silu_add, x, y, dynamic=True, compiled=compiled)
        compiled, _ = compare(silu_add, y, y, dynamic=True, compiled=compiled)


# ---------------------------------------------------------------------------------------------------
# row groups
# ---------------------------------------------------------------------------------------------------


def scaled_softmax(x):
    return torch.softmax(x * 0.75, -1)


def scaled_log_softmax(x):
    return torch.log_softmax(x * 0.75 + 0.1, -1)


def entropy(x):
    p = torch.softmax(x, -1)
    return -(p * torch.log(p + 1e-8)).sum(-1)


def make_layer_norm(cols, dtype):
    w = torch.randn(cols, device="cuda", dtype=dtype)
    b = torch.randn(cols, device="cuda", dtype=dtype)

    def layer_norm(x):
        return F.layer_norm(x * 2.0, (cols,), w, b, 1e-5)

    return layer_norm


ROW_FNS = {"softmax": lambda cols, dtype: scaled_softmax, "log_softmax": lambda cols, dtype: scaled_log_softmax,
           "entropy": lambda cols, dtype: entropy, "layer_norm": make_layer_norm}
# 1, 7: a warp per row, mostly idle lanes; 33: columns beyond one vector per lane; 1023: not a
# multiple of the vector width (no vector loads); 1024: the largest f32 warp variant; 4097 and 8200:
# a block per row, and past the register variants (the general kernel) for f32.
COLS = [1, 7, 33, 1023, 1024, 4097, 8200]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("family", list(ROW_FNS))
def test_rows(family, cols, dtype):
    fn = ROW_FNS[family](cols, dtype)
    x = torch.randn(37, cols, device="cuda", dtype=dtype) * 3
    _, kernels = compare(fn, x)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", [7, 1024, 4097])
@pytest.mark.parametrize("family", list(ROW_FNS))
def test_rows_transposed_and_misaligned(family, cols, dtype):
    fn = ROW_FNS[family](cols, dtype)
    xt = torch.randn(cols, 19, device="cuda", dtype=dtype).t()  # columns 19 elements apart
    compare(fn, xt)
    xm = misaligned(19, cols, dtype=dtype)  # rows contiguous, data one element off
    compare(fn, xm)
    xs = torch.randn(19, cols + 8, device="cuda", dtype=dtype)[:, 8:]  # aligned rows, padded: vector loads
    compare(fn, xs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", [12, 1024])
@pytest.mark.parametrize("family", list(ROW_FNS))
def test_rows_one_misaligned_row(family, cols, dtype):
    """A single row (a 1-d input) one element into its storage: its row offset is the same on every trip
    of the row loop, and the compiler hoisted a plain asm vector load out of that loop and out of the
    p.vec check that guards it (cuda_prelude.h: ld_words), a misaligned address (fuzz seed 200718)."""
    fn = ROW_FNS[family](cols, dtype)
    compare(fn, misaligned(cols, dtype=dtype))

    def mixed(x):  # a bf16 row read by a group whose f32 outputs set the vector width
        y = x.float() + x
        return torch.log_softmax(y, dim=0), y

    compare(mixed, misaligned(cols, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_rows_fast_division_by_the_row_value(dtype):
    """x / x.sum(-1) in 16 bits divides by one reciprocal per row (div_row in cuda_prelude.h): row sums
    that are subnormal (bf16: scaled first, so the reciprocal does not overflow), zero, infinite or NaN
    must give eager's results."""

    def fn(x):
        y = x * 2
        return y / y.sum(-1, keepdim=True)

    x = torch.rand(6, 100, device="cuda", dtype=dtype) + 0.5
    if dtype == torch.bfloat16:
        x[0] *= 1e-40
        x[0, 20:] = 0.0  # the row sums to about 4e-39: below float32's smallest normal (1.2e-38)
    x[1] = 0.0
    x[2, 3] = float("inf")
    x[3, 7] = float("nan")
    x[4, :50] *= -1  # a sum near zero: large quotients of either sign
    _, kernels = compare(fn, x)
    assert kernels >= 1


def test_rows_many_rows_and_3d():
    x = torch.randn(8, 1000, 1024, device="cuda", dtype=torch.bfloat16)
    _, kernels = compare(scaled_softmax, x)
    assert kernels >= 1
    compare(entropy, torch.randn(4, 196, 768, device="cuda"))


@pytest.mark.parametrize("layout", ["contiguous", "misaligned", "strided_3d"])
def test_rows_load_the_next_row_ahead(layout):
    """bf16 softmax(x / 8) over 1024 columns (bench/bandwidth.py's case): its warp variant loads each warp's
    next row while the row before computes (loads_ahead in cuda_source.cpp). 20000 rows give every warp of
    the one-wave grid several, by vector loads, element loads, and offsets through a strided leading dim."""

    def fn(x):
        return torch.softmax(x / 8, -1)

    if layout == "contiguous":
        x = torch.randn(20000, 1024, device="cuda", dtype=torch.bfloat16) * 8
    elif layout == "misaligned":
        x = (torch.randn(20000 * 1024 + 1, device="cuda", dtype=torch.bfloat16) * 8)[1:].view(20000, 1024)
        assert x.data_ptr() % 16 != 0
    else:
        x = (torch.randn(40, 1000, 1024, device="cuda", dtype=torch.bfloat16) * 8)[::2]  # rows 2 x 1000 apart
    x[(5, 3) if x.dim() == 2 else (2, 5, 3)] = float("nan")
    x[(7, 9) if x.dim() == 2 else (3, 7, 9)] = float("inf")
    _, kernels = compare(fn, x)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", [768, 1024, 2048])
@pytest.mark.parametrize("family", list(ROW_FNS))
def test_rows_many_rows_per_variant(family, cols, dtype):
    """Thousands of rows: each warp or block of the one-wave grid runs many rows in turn (values kept
    across phases, inputs loaded per phase, outputs stored per vector)."""
    fn = ROW_FNS[family](cols, dtype)
    x = torch.randn(4099, cols, device="cuda", dtype=dtype) * 3
    _, kernels = compare(fn, x)
    assert kernels >= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows", [3, 4099])
def test_residual_bias_layer_norm(rows, dtype):
    """GPT-2's block end: a projection's bias and the residual added, then a layer norm, the sum and the norm
    both outputs. Three full rows are read before the output phase; in 16 bits they fit the w4 variant
    (cuda_source.cpp: held_rows_fit), in f32 the group stays a block per row."""
    cols = 768
    bias, w, b = (torch.randn(cols, device="cuda", dtype=dtype) for _ in range(3))

    def fn(x, h):
        s = (x + bias) + h
        return s, F.layer_norm(s, (cols,), w, b, 1e-5)

    x, h = (torch.randn(rows, cols, device="cuda", dtype=dtype) * 3 for _ in range(2))
    _, kernels = compare(fn, x, h)
    assert kernels >= 1
    compare(fn, misaligned(rows, cols, dtype=dtype), h)  # element by element, not 16-byte vectors


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cols", [768, 1024])
def test_layer_norm_gelu_linear_layer_norm(cols, dtype):
    """The harness's LayerNorm-GELU-Linear-LayerNorm as modules, small: the norm + GELU reads one full row
    before its output phase, which in f32 fits w8's registers (cuda_source.cpp: held_rows_fit), and the
    second norm may take the linear's bias."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(cols), torch.nn.GELU(), torch.nn.Linear(cols, cols),
                                torch.nn.LayerNorm(cols)).to("cuda", dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)  # norms' weights and biases not 1 and 0
    for rows in (3, 1031):
        x = torch.randn(rows, cols, device="cuda", dtype=dtype) * 3
        _, kernels = compare(model, x)
        assert kernels >= 2
    compare(model, misaligned(5, cols, dtype=dtype))  # element by element, not 16-byte vectors


@pytest.mark.parametrize("family", ["softmax", "layer_norm"])
def test_rows_dynamic_lengths_pick_variants_per_call(family):
    """Symbolic columns: one module holds every variant; each call picks by its row length."""
    compiled = None
    for cols in (5, 200, 1024, 3000, 5000, 9000):
        fn = ROW_FNS[family](cols, torch.float32)
        if family == "layer_norm":
            compiled = None  # its weights are closed over per length
        x = torch.randn(11, cols, device="cuda")
        compiled, _ = compare(fn, x, dynamic=True, compiled=compiled)


def test_softmax_nan_inf_rows():
    x = torch.randn(6, 300, device="cuda")
    x[1, 5] = float("nan")
    x[2, :] = float("-inf")
    x[3, 7] = float("inf")
    compare(scaled_softmax, x)


def test_layer_norm_backward_row_kernels():
    """Training: the backward's row groups (grad of the input) run through the same kernels."""
    cols = 768
    w = torch.randn(cols, device="cuda", requires_grad=True)
    b = torch.randn(cols, device="cuda", requires_grad=True)

    def fn(x):
        return F.layer_norm(x * 2.0, (cols,), w, b, 1e-5).sin().sum()

    x = torch.randn(64, cols, device="cuda", requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    fn(xe).backward()
    ge = xe.grad
    xc = x.detach().clone().requires_grad_()
    compile_ember(fn)(xc).backward()
    torch.testing.assert_close(xc.grad, ge, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------
# channels_last: pointwise groups iterate in memory order; eval batch norms fuse with what follows
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_flat_channels_last_writes_eager_layout(dtype):
    """A pointwise chain over channels_last tensors (with a per-channel broadcast and a contiguous input
    beside them) runs as one kernel in memory order and returns eager's strides."""

    def fn(x, y, s):
        return torch.relu(x * s + y) * 0.5

    x = torch.randn(3, 16, 7, 9, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    y = torch.randn(3, 16, 7, 9, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
    s = torch.randn(16, 1, 1, device="cuda", dtype=dtype)
    _, kernels = compare(fn, x, y, s)
    assert kernels >= 1
    compiled = compile_ember(fn)
    with torch.no_grad():
        assert compiled(x, y, s).stride() == fn(x, y, s).stride()
        # A contiguous second input beside a channels_last first one: strided reads, same values.
        yc = y.contiguous()
        assert_same(compiled(x, yc, s), fn(x, yc, s), atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("symbolic", ["batch", "all"])
def test_flat_channels_last_under_dynamic_shapes(dtype, symbolic):
    """The same chain with symbolic sizes: the batch alone (its strides stay constants) or every dim (strides
    are products of symbols). One compiled kernel serves each shape in memory order, with eager's strides."""

    def fn(x, y, s):
        return torch.relu(x * s + y) * 0.5

    compiled, kernels = None, 0
    for n, c, h in [(3, 16, 7), (5, 16, 7), (2, 24, 5)] if symbolic == "all" else [(3, 16, 7), (5, 16, 7), (9, 16, 7)]:
        x = torch.randn(n, c, h, h + 2, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        y = torch.randn(n, c, h, h + 2, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
        s = torch.randn(c, 1, 1, device="cuda", dtype=dtype)
        if symbolic == "batch":
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        compiled, new = compare(fn, x, y, s, dynamic=None if symbolic == "batch" else True, compiled=compiled)
        kernels += new
        with torch.no_grad():
            assert compiled(x, y, s).stride() == fn(x, y, s).stride()
    assert kernels >= 1


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["channels_last", "nchw"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_eval_batch_norm_fuses_with_relu_and_residual(dtype, layout):
    """conv -> batch norm -> relu, then batch norm + residual add + relu in eval mode (a resnet block),
    channels_last and NCHW: the batch norms become pointwise ops in the kernels of the ops after them."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    bn2 = torch.nn.BatchNorm2d(8)
    for bn in (block[1], bn2):  # statistics away from the defaults
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    block, bn2 = (m.to("cuda", dtype).eval().to(memory_format=layout) for m in (block, bn2))

    def fn(x):
        return torch.relu(bn2(block(x)) + x)

    x = torch.randn(4, 8, 11, 13, device="cuda", dtype=dtype).to(memory_format=layout)
    # (fold_batchnorm would make the conv -> batch norm -> relu one cuDNN call: the next test)
    compiled, kernels = compare(fn, x, compiled=compile_ember(fn, options={"disable_passes": ["fold_batchnorm"]}))
    assert kernels >= 2
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "batch_norm" not in listing, listing
    # Inference: each batch norm's scale and shift are computed once over the channels and cached; a
    # changed running variance must reach the next call.
    assert "cached over parameters" in listing, listing
    with torch.no_grad():
        bn2.running_var.mul_(3.0)
    compare(fn, x, compiled=compiled)
    # With grad enabled (a forward graph, nothing cached) the per-element form runs.
    atol, rtol = TOL[dtype]
    with torch.enable_grad():
        grad_fn = compile_ember(fn)
        assert_same(grad_fn(x), fn(x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_eval_conv_batch_norm_relu_become_one_cudnn_call(dtype, layout):
    """A resnet bottleneck in eval mode (passes/fold_batchnorm.cpp, point 5): conv -> batch norm -> relu,
    and conv -> batch norm -> + downsampled residual -> relu, each one cuDNN call with the batch norm folded
    into weights and bias and the residual and relu in its epilogue; the downsample's batch norm (no relu)
    stays a fused kernel. Odd sizes, a strided convolution, a conv with a bias of its own."""
    torch.manual_seed(0)
    conv1 = torch.nn.Conv2d(6, 12, 3, padding=1, stride=2, bias=False)
    conv2 = torch.nn.Conv2d(12, 12, 1, bias=True)
    down = torch.nn.Conv2d(6, 12, 1, stride=2, bias=False)
    norms = [torch.nn.BatchNorm2d(12) for _ in range(3)]
    for bn in norms:
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    conv1, conv2, down, *norms = (m.to("cuda", dtype).eval().to(memory_format=layout) for m in (conv1, conv2, down, *norms))

    def fn(x):
        y = torch.relu(norms[0](conv1(x)))
        return torch.relu(norms[1](conv2(y)) + norms[2](down(x)))

    x = torch.randn(3, 6, 13, 11, device="cuda", dtype=dtype).to(memory_format=layout)
    # Folding changes the rounding (16-bit folded weights are rounded once): within the dtype's own error.
    # (conftest.py switches TF32 off, under which an f32 convolution would round other products than eager's.)
    atol, rtol = TOL[dtype]
    before = len(EMBER_GRAPHS)
    compiled = compile_ember(fn)
    with torch.no_grad():
        assert_same(compiled(x), fn(x), atol=atol, rtol=rtol)
        listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS[before:])
        assert "cudnn_convolution_relu" in listing and "cudnn_convolution_add_relu" in listing, listing
        # A changed running variance and weight reach the next call (the fold is redone).
        norms[1].running_var.mul_(3.0)
        conv1.weight.mul_(-1.0)
        x = torch.randn_like(x)
        assert_same(compiled(x), fn(x), atol=atol, rtol=rtol)
    # With grad enabled (a training graph's forward: nothing cached) the convolutions stay as they are.
    with torch.enable_grad():
        before = len(EMBER_GRAPHS)
        grad_fn = compile_ember(fn)
        assert_same(grad_fn(x), fn(x), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        assert "cudnn_convolution" not in "\n".join(g.describe() for _, g in EMBER_GRAPHS[before:])


# ---------------------------------------------------------------------------------------------------
# max pooling without indices (kernels/cuda/pool.cpp)
# ---------------------------------------------------------------------------------------------------


def max_pool_fast_paths():
    return sum(g.describe().count("cuda max pool") for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("channels", [16, 5], ids=["c16", "c5"])
@pytest.mark.parametrize("window", [(3, 2, 1), (2, 2, 0), (3, 1, 1), ((3, 2), (2, 1), (1, 0))],
                         ids=["k3s2p1", "k2s2", "k3s1p1", "k32s21p10"])
def test_max_pool_without_indices(dtype, channels_last, channels, window):
    k, s, p = window
    x = torch.randn(2, channels, 13, 11, device="cuda", dtype=dtype)
    x[0, 3, 4, 5] = float("nan")  # NaN wins its windows, as in eager
    x[1, 2] = float("-inf")       # a channel of -inf pools to -inf
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    def fn(x):
        return F.max_pool2d(x, k, s, p), F.max_pool2d(torch.relu(x * 2), k, s, p)

    compiled = compile_ember(fn)
    with torch.no_grad():
        expected = fn(x)
        actual = compiled(x)
    for a, e in zip(actual, expected):
        assert a.stride() == e.stride(), (a.stride(), e.stride())
        torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True)  # a max is exact
    assert max_pool_fast_paths() >= 2, "\n".join(g.describe() for _, g in EMBER_GRAPHS)


def test_max_pool_module_compiles_in_background():
    """With background compiles on and no cache, the pooling module starts compiling when the plan is built
    (kernels/cuda/pool.cpp): calls before it loads run ATen's op, every call is exact, and after
    ember.wait_for_compiles() calls run ember's kernel. In a process of its own, since the module compiles once
    per process."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json
        import torch
        import torch.nn.functional as F
        import ember, ember.backend

        ember.config.compile_cache = False  # the graph compiles here, not from an earlier run's entry
        graphs = []
        original = ember.backend.compile_fx_graph
        def counting(gm, config, kind, *args):
            graphs.append(original(gm, config, kind, *args))
            return graphs[-1]
        ember.backend.compile_fx_graph = counting

        def calls():  # the pooling fast path's count, from its description "... without indices (N calls)"
            text = graphs[0].describe().split("cuda max pool 3x3 without indices (")[1]
            return int(text.split(" calls)")[0])

        x = torch.randn(2, 16, 13, 11, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        x[0, 3, 4, 5] = float("nan")
        fn = lambda x: F.max_pool2d(torch.relu(x * 2), 3, 2, 1)
        compiled = torch.compile(fn, backend="ember", options={"fallback": "raise"})
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), fn(x), atol=0, rtol=0, equal_nan=True)
            first = calls()
            ember.wait_for_compiles()
            for _ in range(2):
                out = compiled(x)
                assert out.stride() == fn(x).stride()
                torch.testing.assert_close(out, fn(x), atol=0, rtol=0, equal_nan=True)
        print(json.dumps({"first": first, "later": calls()}))
    """)
    env = {**os.environ, "EMBER_CUDA_BACKGROUND": "1", "EMBER_CACHE_DIR": "off"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts["later"] == counts["first"] + 2, counts  # both later calls ran ember's kernel


def test_max_pool_with_indices_read_stays_aten():
    """Training needs the indices for the backward: the pooling stays ATen's, and gradients match."""
    x = torch.randn(2, 8, 9, 9, device="cuda", requires_grad=True)
    compiled = compile_ember(lambda x: F.max_pool2d(x, 3, 2, 1).sum())
    compiled(x).backward()
    expected = torch.autograd.grad(F.max_pool2d(x, 3, 2, 1).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)
    assert max_pool_fast_paths() == 0


# ---------------------------------------------------------------------------------------------------
# compiling
# ---------------------------------------------------------------------------------------------------


def test_identical_groups_compile_once(monkeypatch):
    """Six layers' identical pointwise groups, generated in parallel, make one NVRTC compile of each module
    (a general and a vector entry), not one per group racing the others. The chain of ops is drawn at random
    so that no earlier test, nor the disk cache (off here), holds its source."""
    import random

    import ember

    monkeypatch.setattr(ember.config, "cache_dir", "off")
    ops = [torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.abs, torch.neg, torch.exp, torch.erf]
    chain = [random.choice(ops) for _ in range(8)]
    weights = [torch.randn(96, 96, device="cuda") / 10 for _ in range(6)]

    def fn(x):
        for w in weights:
            for op in chain:
                x = op(x)
            x = x @ w
        return x

    x = torch.randn(64, 96, device="cuda")
    with torch.no_grad():
        report = ember.explain(fn, options={"fallback": "raise"})(x)
        assert_same(torch.compile(fn, backend="ember")(x), fn(x), atol=1e-4, rtol=1e-4)
    (graph,) = report.graphs
    assert len(graph.kernels) == 6, str(report)
    assert graph.timings["codegen: modules compiled"] <= 2, str(report)
    assert "codegen: modules compiled" in str(report)


def _background_groups():
    """A row group (softmax over 1000 columns) and a flat group, their sources new to the process (a random
    scale), and inputs."""
    import random

    scale = random.uniform(0.5, 2.0)

    def fn(x, y):
        return torch.softmax(x * scale, -1), torch.sigmoid(y * scale) * y

    return fn, torch.randn(300, 1000, device="cuda"), torch.randn(4097, device="cuda")


def test_deferred_kernels_run_their_aten_ops_until_compiled(monkeypatch):
    """With background compiles on (the default outside these tests), codegen hands both groups' modules to
    threads of their own: explain counts them, the plan holds each group's ATen ops as its stand-in, the
    first call runs those (eager's own kernels: eager's bits), and after ember.wait_for_compiles() calls run
    the fused kernels. Every call agrees with eager."""
    import ember

    monkeypatch.setattr(ember.config, "cache_dir", "off")
    monkeypatch.setattr(ember.config, "cuda_background", True)
    fn, x, y = _background_groups()
    with torch.no_grad():
        report = ember.explain(fn, options={"fallback": "raise"})(x, y)
    (graph,) = report.graphs
    assert graph.timings["codegen: modules in background"] == 2, str(report)
    ember.wait_for_compiles()

    fn, x, y = _background_groups()
    compiled = compile_ember(fn)
    before = len(EMBER_GRAPHS)
    with torch.no_grad():
        first, expected = compiled(x, y), fn(x, y)
    described = [g.describe() for _, g in EMBER_GRAPHS[before:]]
    assert sum(d.count("while it compiles") for d in described) == 2, described
    atol, rtol = TOL[torch.float32]
    assert_same(first, expected, atol=atol, rtol=rtol)
    ember.wait_for_compiles()
    for _ in range(2):
        compare(fn, x, y, compiled=compiled)
    assert all("failed to compile" not in g.describe() for _, g in EMBER_GRAPHS)


def test_background_compile_waits_before_cuda_graph_capture(monkeypatch):
    """reduce-overhead captures after one warm-up call: a kernel still compiling then waits for its compile,
    so that the graph holds the kernels later calls would run, not their ATen stand-ins. Replays agree with
    eager."""
    monkeypatch.setattr(ember.config, "cache_dir", "off")
    monkeypatch.setattr(ember.config, "cuda_background", True)
    fn, x, y = _background_groups()
    compiled = torch.compile(fn, backend="ember", options={"fallback": "raise", "cudagraphs": True})
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        compare(fn, x, y, compiled=compiled)
