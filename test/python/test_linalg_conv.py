"""matmul / bmm / addmm / linear / einsum and conv2d (stride, padding, dilation, groups, channels_last)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import DEVICES, MATMUL_TOL, Wrap, check


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_then_softmax(device):
    check(lambda a, b: torch.softmax(a @ b, dim=-1), torch.randn(6, 9, device=device), torch.randn(9, 5, device=device),
          **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((7,), (7,)), ((3, 7), (7,)), ((7,), (7, 4)), ((2, 3, 7), (7, 4)), ((2, 1, 3, 7), (5, 7, 2))],
    ids=["dot", "mv", "vm", "batched_2d", "broadcast_batch"],
)
def test_matmul_shapes(device, a_shape, b_shape):
    check(torch.matmul, torch.randn(a_shape, device=device), torch.randn(b_shape, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_bmm_addmm_baddbmm(device):
    def fn(a, b, bias, m1, m2, c):
        return torch.bmm(a, b), torch.addmm(bias, m1, m2, beta=0.5, alpha=2.0), torch.baddbmm(c, a, b)

    check(fn, torch.randn(3, 4, 5, device=device), torch.randn(3, 5, 6, device=device), torch.randn(6, device=device),
          torch.randn(4, 7, device=device), torch.randn(7, 6, device=device), torch.randn(3, 4, 6, device=device),
          **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_transposed_operands(device):
    a = torch.randn(9, 4, device=device).t()
    b = torch.randn(6, 9, device=device).t()
    check(lambda a, b: (a @ b).relu(), a, b, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear(device, bias):
    lin = nn.Linear(10, 7, bias=bias).to(device)
    check(lin, torch.randn(2, 3, 10, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_einsum(device):
    check(lambda a, b: torch.einsum("bij,bjk->bik", a, b).sum(-1), torch.randn(2, 3, 4, device=device),
          torch.randn(2, 4, 5, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(stride=1, padding=0, groups=1),
        dict(stride=2, padding=1, groups=1),
        dict(stride=1, padding="same", groups=1, dilation=2),
        dict(stride=2, padding=1, groups=4),
        dict(stride=1, padding=1, groups=8),  # depthwise
    ],
    ids=["plain", "stride2_pad1", "same_dilated", "groups4", "depthwise"],
)
def test_conv2d(device, cfg):
    conv = nn.Conv2d(8, 8, 3, **cfg).to(device)
    check(conv, torch.randn(2, 8, 11, 10, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_conv2d_channels_last(device):
    model = Wrap(lambda m, x: F.relu(m.conv(x)) + 1, conv=nn.Conv2d(4, 6, 3, padding=1)).to(device)
    x = torch.randn(2, 4, 9, 9, device=device).to(memory_format=torch.channels_last)
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    check(model, x, **MATMUL_TOL)

    conv_cl = nn.Conv2d(4, 6, 3, padding=1).to(device).to(memory_format=torch.channels_last)
    e, c = check(conv_cl, x, **MATMUL_TOL)
    assert c.is_contiguous(memory_format=torch.channels_last) == e.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_pool_block(device):
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    ).to(device)
    check(model, torch.randn(2, 3, 16, 16, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_conv1d_and_conv_transpose2d(device):
    model = Wrap(lambda m, x, y: (m.c1(x), m.ct(y)),
                 c1=nn.Conv1d(3, 5, 4, stride=2, padding=1), ct=nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1))
    check(model.to(device), torch.randn(2, 3, 17, device=device), torch.randn(1, 3, 5, 6, device=device), **MATMUL_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_linear_relu_and_tanh_gelu_fuse_into_addmm_activation(dtype, tmp_path):
    """passes/addmm_activation.cpp: bias + ReLU / tanh-GELU as cuBLASLt's epilogue. Inference: the plan holds
    aten::_addmm_activation instead of addmm + activation, and matches eager. Training: forward and backward
    match eager (there GELU's backward reads the addmm result, which keeps that addmm as it is)."""
    model = nn.Sequential(nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 48), nn.GELU(approximate="tanh"),
                          nn.Linear(48, 5)).to("cuda", dtype)
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else MATMUL_TOL
    with torch.no_grad():
        check(model, torch.randn(7, 33, device="cuda", dtype=dtype), grad=False, **tol,
              options={"debug_dir": str(tmp_path)})
    plans = "".join(p.read_text() for p in tmp_path.glob("*inference*after_addmm_act.ir"))
    assert plans.count("aten::_addmm_activation") == 2, plans
    check(model, torch.randn(7, 33, device="cuda", dtype=dtype), **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_linear_on_transposed_3d_input_folds_to_one_addmm(dtype, tmp_path):
    """fold_matmul + addmm_act on CUDA: a linear on a transposed 3-D input (batch_first attention's input
    projection) reaches the graph as a batched product against the expanded weight, a bias add and the
    activation; it becomes one GEMM with bias and ReLU as its epilogue, and matches eager, forward and
    backward."""
    model = Wrap(lambda m, x: torch.relu(m.lin(x.transpose(0, 1))) + 1, lin=nn.Linear(24, 40)).to("cuda", dtype)
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else MATMUL_TOL
    with torch.no_grad():
        check(model, torch.randn(5, 9, 24, device="cuda", dtype=dtype), grad=False, **tol,
              options={"debug_dir": str(tmp_path)})
    plans = "".join(p.read_text() for p in tmp_path.glob("*inference*after_dce.ir"))
    assert "aten::bmm" not in plans and plans.count("aten::_addmm_activation") == 1, plans
    check(model, torch.randn(5, 9, 24, device="cuda", dtype=dtype), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_chain_op_applies_its_layers_in_order(device):
    """ember::linear_chain (passes/linear_chain.cpp makes it of CUDA linears; kernels/linear_chain_op.cpp is its
    ATen implementation, which runs wherever the chain kernel does not): the same values as the layers one by
    one, with and without biases, for each activation, and with a softmax or log_softmax after the last; a bad
    activation code is a clear error."""
    from ember import _C  # noqa: F401  loads libember, which registers the op

    x = torch.randn(7, 12, device=device)
    w = [torch.randn(12, 9, device=device), torch.randn(9, 5, device=device), torch.randn(5, 3, device=device)]
    b = [torch.randn(9, device=device), None, torch.randn(3, device=device)]
    got = torch.ops.ember.linear_chain(x, w, b, [1, 0, 2])
    want = F.gelu(torch.relu(x @ w[0] + b[0]) @ w[1] @ w[2] + b[2], approximate="tanh")
    torch.testing.assert_close(got, want, **MATMUL_TOL)
    got = torch.ops.ember.linear_chain(x, w[:1], b[:1], [0], 1)
    torch.testing.assert_close(got, torch.softmax(x @ w[0] + b[0], -1), **MATMUL_TOL)
    got = torch.ops.ember.linear_chain(x, w[:2], b[:2], [2, 0], 2)
    torch.testing.assert_close(got, torch.log_softmax(F.gelu(x @ w[0] + b[0], approximate="tanh") @ w[1], -1),
                               **MATMUL_TOL)
    with pytest.raises(RuntimeError, match="activation 3"):
        torch.ops.ember.linear_chain(x, w, b, [3, 0, 0])
    with pytest.raises(RuntimeError, match="needs a bias"):
        torch.ops.ember.linear_chain(x, w, b, [0, 1, 0])


# ---------------------------------------------------------------------------------------------------
# max pooling without indices on the CPU (kernels/cpu/pool.cpp)
# ---------------------------------------------------------------------------------------------------


def _cpu_max_pools():
    """How many of the CPU max-pool fast paths in this test's graphs ran (an input they were not made for,
    channels_last, goes to ATen's op and leaves their call count at 0)."""
    import re

    from helpers import EMBER_GRAPHS

    return sum(int(calls) > 0 for _, g in EMBER_GRAPHS
               for calls in re.findall(r"cpu max pool \S+ with(?:out)? indices \((\d+) calls\)", g.describe()))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("window", [(3, 2, 1), (2, 2, 0), (3, 1, 1), ((3, 2), (2, 1), (1, 0)), (5, 3, 2)],
                         ids=["k3s2p1", "k2s2", "k3s1p1", "k32s21p10", "k5s3p2"])
@pytest.mark.parametrize("size", [(2, 5, 13, 11), (1, 3, 1, 7), (3, 2, 112, 112)], ids=["odd", "one_row", "resnet"])
def test_cpu_max_pool_without_indices(channels_last, window, size):
    """NCHW float32 pooling runs ember's loop, nhwc ATen's kernel; both exact against eager, with a NaN
    winning its windows and a plane of -inf pooling to -inf."""
    from helpers import compile_ember

    k, s, p = window
    kh = k if isinstance(k, int) else k[0]
    if size[2] + 2 * (p if isinstance(p, int) else p[0]) < kh:
        pytest.skip("the window does not fit")
    x = torch.randn(*size)
    x[0, 1, 0, 3] = float("nan")
    x[-1, 0] = float("-inf")
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
    assert _cpu_max_pools() == (0 if channels_last else 2)


@pytest.mark.parametrize("window", [(3, 2, 1), (2, 2, 0), ((3, 2), (2, 1), (1, 0)), (5, 3, 2)],
                         ids=["k3s2p1", "k2s2", "k32s21p10", "k5s3p2"])
@pytest.mark.parametrize("size", [(2, 5, 13, 11), (1, 3, 2, 1), (2, 2, 56, 56)], ids=["odd", "narrow", "large"])
def test_cpu_max_pool_indices_match_aten(window, size):
    """Where the indices are read (returned here; a training graph's backward reads them) both outputs are
    ember's: each index the first maximum of its window in row-major order, or its last NaN, as ATen gives
    it. Ties are common after a ReLU (all-zero windows); a plane of -inf takes each window's first element."""
    from helpers import compile_ember

    k, s, p = window
    kh, kw = (k, k) if isinstance(k, int) else k
    ph, pw = (p, p) if isinstance(p, int) else p
    if size[2] + 2 * ph < kh or size[3] + 2 * pw < kw:
        pytest.skip("the window does not fit")
    x = torch.randn(*size)
    x.view(-1)[::7] = float("nan")
    x[-1, 0] = float("-inf")

    def fn(x):
        return F.max_pool2d(torch.relu(x - 0.5), k, s, p, return_indices=True) + F.max_pool2d(x, k, s, p, return_indices=True)

    compiled = compile_ember(fn)
    with torch.no_grad():
        expected, actual = fn(x), compiled(x)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True)
    assert _cpu_max_pools() == 2


def test_cpu_max_pool_training_gradients_match_eager():
    """The backward scatters the gradient through the forward's indices: ties after a ReLU must go where
    eager sends them."""
    from helpers import compile_ember

    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 17, 15, requires_grad=True)

    def fn(x):
        return (F.max_pool2d(torch.relu(conv(x)), 3, 2, 1) * torch.arange(1.0, 73.0).view(9, 8)).sum()

    compiled = compile_ember(fn)
    compiled(x).backward()
    got = (x.grad.clone(), conv.weight.grad.clone())
    x.grad = None
    conv.weight.grad = None
    fn(x).backward()
    torch.testing.assert_close(got[0], x.grad, atol=0, rtol=0)
    torch.testing.assert_close(got[1], conv.weight.grad)
    assert _cpu_max_pools() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_linalg_ops_with_effect_tokens(device):
    """tensorinv and tensorsolve check their factorization's info through `_linalg_check_errors`, which AOTAutograd
    wraps in with_effects in a gradient graph: ember runs it in its place (fallback="raise" compiles the graph),
    values and gradients match eager's, and a singular input still raises."""
    import ember

    a = torch.randn(4, 4, device=device) + 4 * torch.eye(4, device=device)
    b = torch.randn(2, 2, device=device)
    check(lambda a: torch.linalg.tensorinv(a.reshape(4, 2, 2), ind=1) * 2, a, **MATMUL_TOL)
    check(lambda a, b: torch.linalg.tensorsolve(a.reshape(2, 2, 2, 2), b).sin(), a, b, **MATMUL_TOL)
    compiled = torch.compile(lambda a: torch.linalg.tensorinv(a.reshape(4, 2, 2), ind=1), backend="ember",
                             options={"fallback": "raise"})
    compiled(a.clone().requires_grad_())
    from torch._higher_order_ops.effects import _get_effect

    if _get_effect(torch.ops.aten._linalg_check_errors.default) is None:
        # A torch that does not mark the check as an effect (2.11) drops it from every traced graph as dead code:
        # there aot_eager and inductor return NaNs for a singular input as well.
        pytest.skip("this torch drops _linalg_check_errors from traced graphs (not an effect)")
    with pytest.raises(torch.linalg.LinAlgError, match="could not be completed"):  # eager's error type
        compiled(torch.zeros(4, 4, device=device, requires_grad=True))
    report = ember.explain(lambda a: torch.linalg.tensorinv(a.reshape(4, 2, 2), ind=1))(a.clone().requires_grad_())
    assert "aten::_linalg_check_errors" in str(report), str(report)
