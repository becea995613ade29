"""CUDA GEMMs through cuBLASLt with a plan made once, or ember's own kernels (kernels/cuda/gemm.cpp,
gemm_kernels.cu), against eager: mm, addmm with a row bias, bias + ReLU / tanh-GELU epilogues; f32 (with and
without TF32), f16, bf16; odd sizes, transposed operands (a Linear's weight is one), operands that are neither
(they stay ATen calls), misaligned inputs (ATen's path for that call), CUDA graphs, and training. Each test checks from the plan's listing that the
fast path ran, or that it did not where it must not.
"""

import pytest
import torch
import torch.nn as nn

import ember
from helpers import EMBER_GRAPHS, MATMUL_TOL, assert_same, check, compile_ember

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
TOL = {torch.float32: MATMUL_TOL, torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=5e-2, rtol=3e-2)}


def lt_calls(prefix=("fast path: cublasLt", "fast path: ember gemm kernel")):
    """Calls the GEMM fast path made (through cuBLASLt or, where its timing chose them, ember's own kernels),
    over every graph compiled in this test."""
    total = 0
    for _, g in EMBER_GRAPHS:
        for line in g.describe().splitlines():
            if any(p in line for p in prefix):
                total += int(line.rsplit(", ", 1)[1].split()[0])
    return total


def run_compare(fn, *inputs, dtype, dynamic=None):
    compiled = compile_ember(fn, dynamic=dynamic)
    with torch.no_grad():
        for _ in range(2):  # the second call reuses the plan made at the first
            assert_same(compiled(*inputs), fn(*inputs), **TOL[dtype])
    return compiled


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (32, 100, 100), (33, 65, 17), (257, 128, 96)])
def test_mm_and_linear_shapes(dtype, m, k, n):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    run_compare(lambda a, b: a @ b, a, b, dtype=dtype)
    run_compare(lambda a, w, bias: torch.nn.functional.linear(a, w, bias), a, w, bias, dtype=dtype)
    run_compare(lambda a, b: a.t() @ b.t(), a.t().contiguous(), b.t().contiguous(), dtype=dtype)  # both transposed
    if (m, k, n) == (257, 128, 96):  # 16-byte rows everywhere: cuBLASLt offers an algorithm for every dtype
        assert lt_calls() >= 6


@pytest.mark.parametrize("route", ["lt", "lt_bias", "aten"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_timed_route_matches_eager(route, dtype, monkeypatch):
    """Each way the first call's timing may choose (cuBLASLt with the bias in its epilogue, cuBLASLt then
    the bias added, ATen's mm then the bias added), forced by EMBER_GEMM_ROUTE: same values as eager."""
    monkeypatch.setattr(ember.config, "gemm_route", route)
    m, k, n = 96, 160, 72
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    run_compare(lambda a, w, bias: torch.nn.functional.linear(a, w, bias), a, w, bias, dtype=dtype)
    run_compare(lambda a, w: a @ w.t(), a, w, dtype=dtype)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    if route == "aten":
        assert "(timed: ATen's mm faster)" in listing, listing
    if route == "lt_bias":
        assert "(bias added after)" in listing, listing
    assert lt_calls() >= 4


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_padded_route_for_rows_off_16_bytes(dtype, monkeypatch):
    """The route for results whose rows are not a 16-byte multiple (GPT-2's vocabulary): the weight's rows
    padded with zeros, ATen's mm into a wider result, its leading columns copied out; forced here, with and
    without a bias, for a Linear's transposed weight and for a row-major right operand."""
    monkeypatch.setattr(ember.config, "gemm_route", "padded")
    m, k, n = 70, 96, 45
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    run_compare(lambda a, w, bias: torch.nn.functional.linear(a, w, bias), a, w, bias, dtype=dtype)
    run_compare(lambda a, w: a @ w.t(), a, w, dtype=dtype)
    run_compare(lambda a, b: (a @ b).relu(), a, b, dtype=dtype)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert listing.count("(timed: rows padded to 16 bytes)") >= 3, listing
    assert lt_calls() >= 6


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_lm_head_of_odd_width_returns_padded_rows(dtype, mode):
    """A 16-bit LM head over GPT-2's 50257 words (passes/pad_matmul.cpp): the product is computed 50264
    wide and returned as a view of its leading columns (row stride 50264), with eager's values; a softmax
    reading it inside the graph gets a contiguous product instead."""
    torch.manual_seed(0)
    x = torch.randn(4, 512, 768, device="cuda", dtype=dtype)
    w = torch.randn(50257, 768, device="cuda", dtype=dtype) / 16
    head = lambda x, w: torch.nn.functional.linear(x, w)
    probs = lambda x, w: torch.softmax(torch.nn.functional.linear(x, w).float(), -1)
    for fn, padded in ((head, True), (probs, False)):
        compiled = torch.compile(fn, backend="ember", mode=mode if mode != "default" else None)
        with torch.no_grad():
            for _ in range(3):
                x.normal_()
                got = compiled(x, w)
                assert_same(got, fn(x, w), **TOL[dtype])
        assert (got.stride(1) == 50264) == padded, got.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bias_relu_and_tanh_gelu_epilogues(dtype):
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 40), nn.GELU(approximate="tanh"),
                          nn.Linear(40, 8)).to("cuda", dtype)
    with torch.no_grad():  # one GEMM step per layer: not as a linear chain (test_linear_chains_match_eager)
        check(model, torch.randn(9, 48, device="cuda", dtype=dtype), grad=False, **TOL[dtype],
              options={"disable_passes": "linear_chain"})
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert listing.count("fast path: cublasLt") + listing.count("fast path: ember gemm kernel") >= 3, listing
    assert lt_calls() >= 3


def test_tf32_setting_is_honoured_per_call():
    a = torch.randn(64, 256, device="cuda")
    b = torch.randn(256, 64, device="cuda")
    compiled = compile_ember(lambda a, b: a @ b)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        with torch.no_grad():
            for allow in (False, True, False):
                torch.backends.cuda.matmul.allow_tf32 = allow
                expected = a @ b
                got = compiled(a, b)
                exact = (a.double() @ b.double()).float()
                # Full f32 agrees with eager closely; TF32 is visibly less exact than f32, as eager's is.
                tol = dict(atol=5e-2, rtol=5e-2) if allow else MATMUL_TOL
                assert_same(got, expected, **tol)
                if not allow:
                    assert (got - exact).abs().max() < 1e-3
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert lt_calls() == 3


def test_misaligned_and_strided_operands_take_atens_path():
    base = torch.randn(64 * 33 + 1, device="cuda")
    aligned = base[:64 * 33].view(64, 33)
    misaligned = base[1:].view(64, 33)  # 4 bytes into its storage: cuBLASLt's plan assumed 16
    b = torch.randn(33, 20, device="cuda")
    compiled = compile_ember(lambda a, b: a @ b)
    with torch.no_grad():
        assert_same(compiled(aligned, b), aligned @ b, **MATMUL_TOL)
        calls = lt_calls()
        assert calls == 1
        assert_same(compiled(misaligned, b), misaligned @ b, **MATMUL_TOL)
        assert lt_calls() == calls  # same graph (Dynamo does not guard on alignment), ATen's path
    # Rows and columns both strided: no fast path at all, and still correct.
    wide = torch.randn(64, 66, device="cuda")[:, ::2]
    compiled = compile_ember(lambda a, b: a @ b)
    with torch.no_grad():
        assert_same(compiled(wide, b), wide @ b, **MATMUL_TOL)


def test_reduce_overhead_replays_cublaslt_gemms():
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)]).cuda().eval()
    compiled = torch.compile(model, backend="ember", options={"cudagraphs": True, "disable_passes": "linear_chain"})
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(32, 100, device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            assert_same(compiled(x).clone(), model(x), **MATMUL_TOL)


@pytest.mark.parametrize("cudagraphs", [False, True], ids=["default", "reduce-overhead"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_symbolic_sizes_get_a_plan_per_size(cudagraphs, dtype):
    """A graph with a batch Dynamo made dynamic: each batch size's GEMMs get a cuBLASLt plan of their own at
    that size's second call (the warm-up before a capture), sizes seen once run ATen's op, and every call
    matches eager; the relu joins the first GEMM's epilogue as with constant sizes."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).cuda().to(dtype).eval()
    compiled = compile_ember(model, dynamic=True, options={"cudagraphs": cudagraphs})
    with torch.no_grad():
        for rows in (8, 24, 8, 33, 8, 24, 5):
            x = torch.randn(rows, 64, device="cuda", dtype=dtype)
            torch.compiler.cudagraph_mark_step_begin()
            assert_same(compiled(x).clone(), model(x), **TOL[dtype])
    (graph,) = [g for _, g in EMBER_GRAPHS]
    listing = graph.describe()
    assert "aten::_addmm_activation" in listing, listing
    per_size = [line for line in listing.splitlines() if "fast path: cublasLt per size" in line]
    assert len(per_size) == 2, listing
    # Default mode: 8 (three calls) and 24 (two) have plans, used at their later calls; 33 and 5 were seen
    # once. Under CUDA graphs each size's first call is the warm-up for its capture and makes the plan; the
    # capture runs it again, and replays launch nothing from the host.
    for line in per_size:
        assert f"({4 if cudagraphs else 2} problems: 8x" in line, line
    calls = lt_calls(("fast path: cublasLt per size",))
    assert calls >= 8 if cudagraphs else calls == 6, listing


def test_training_forward_and_backward():
    model = nn.Sequential(nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 7)).cuda()
    check(model, torch.randn(17, 33, device="cuda"), **MATMUL_TOL)
    assert lt_calls() > 0


KERNELS = ["t64", "t32", "t16", "s4", "s16", "k16", "k32"]


def kernel_calls(config):
    return lt_calls(prefix=(f"fast path: ember gemm kernel {config} ",))


@pytest.mark.parametrize("config", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ember_gemm_kernels_match_eager(config, dtype, monkeypatch):
    """Each of ember's own GEMM kernels (gemm_kernels.cu), forced by EMBER_GEMM_ROUTE=kernel and
    EMBER_GEMM_KERNEL: plain, biased, ReLU and tanh-GELU epilogues; sizes off every tile and vector width
    (the skinny kernels' 16-byte loads and their scalar loop); row-major and transposed operands."""
    monkeypatch.setattr(ember.config, "gemm_route", "kernel")
    monkeypatch.setattr(ember.config, "gemm_kernel", config)
    rows = {"s4": [1, 3], "s16": [5, 16]}.get(config, [1, 70])
    shapes = ((7, 5), (264, 130))  # scalar loads, tiny; 16-byte loads, columns past a tile
    for m in rows:
        for k, n in shapes:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(k, n, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)
            bias = torch.randn(n, device="cuda", dtype=dtype)
            run_compare(lambda a, w, bias: torch.nn.functional.linear(a, w, bias), a, w, bias, dtype=dtype, dynamic=False)
            run_compare(lambda a, w, bias: torch.nn.functional.linear(a, w, bias).relu(), a, w, bias, dtype=dtype, dynamic=False)
            run_compare(lambda a, w, bias: torch.nn.functional.gelu(torch.nn.functional.linear(a, w, bias),
                                                                   approximate="tanh"), a, w, bias, dtype=dtype, dynamic=False)
            if config[0] == "t":  # the skinny kernels are offered for K-contiguous right operands only
                run_compare(lambda a, b: a @ b, a, b, dtype=dtype, dynamic=False)
                run_compare(lambda at, b: at.t() @ b, a.t().contiguous(), b, dtype=dtype, dynamic=False)
    assert kernel_calls(config) >= 2 * 3 * len(rows) * len(shapes), "\n".join(g.describe() for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_ember_gemm_kernels_in_training_and_graphs(mode, monkeypatch):
    """Forward and backward GEMMs (transposed operands on both sides) through ember's kernels, eagerly and
    replayed from CUDA graphs, against eager's values and gradients."""
    monkeypatch.setattr(ember.config, "gemm_route", "kernel")
    model = nn.Sequential(nn.Linear(33, 64), nn.ReLU(), nn.Linear(64, 7)).cuda()
    if mode == "default":
        check(model, torch.randn(17, 33, device="cuda"), **MATMUL_TOL)
    else:
        compiled = torch.compile(model, backend="ember", mode="reduce-overhead")
        for _ in range(5):
            x = torch.randn(17, 33, device="cuda")
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x)
            want = model(x)
            assert_same(got.detach().clone(), want.detach(), **MATMUL_TOL)
            g = torch.autograd.grad(got.square().sum(), list(model.parameters()))
            w = torch.autograd.grad(want.square().sum(), list(model.parameters()))
            for x1, x2 in zip(g, w):
                assert_same(x1, x2, **MATMUL_TOL)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert lt_calls(prefix=("fast path: ember gemm kernel",)) > 0, listing


def test_small_linears_choose_by_host_and_gpu_time():
    """Without forcing, the first call's timing decides; 20 x Linear(100, 100) at batch 32 is host-bound, and
    whichever route wins, values match eager."""
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(20)]).cuda().eval()
    with torch.no_grad():  # one GEMM step per layer: not as a linear chain
        check(model, torch.randn(32, 100, device="cuda"), grad=False, **MATMUL_TOL,
              options={"disable_passes": "linear_chain"})
    assert lt_calls() >= 20


def chain_calls():
    """Calls of the linear-chain kernel (kernels/cuda/linear_chain.cpp) over every graph compiled in this test."""
    return lt_calls(prefix=("fast path: ember linear chain kernel",))


def chain_model(widths, acts, bias=True):
    layers = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(k, n, bias=bias))
        if acts[i % len(acts)] == "relu":
            layers.append(nn.ReLU())
        elif acts[i % len(acts)] == "gelu":
            layers.append(nn.GELU(approximate="tanh"))
    return nn.Sequential(*layers)


CHAINS = {
    "linear20": ([100] * 21, ["none"]),  # 16-byte weight rows: cp.async in 16-byte pieces
    "mlp": ([64, 128, 96, 10], ["relu", "gelu", "none"]),
    "odd": ([37, 53, 7, 29], ["gelu", "relu", "none"]),  # rows off 16 (f32: 4-byte pieces) and off 4 bytes (16-bit)
}


@pytest.mark.parametrize("rows", [1, 33, 300])  # one block; blocks of 4 rows with a partial last; blocks of 16
@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_chains_match_eager(dtype, chain, rows):
    """Consecutive small linear layers (passes/linear_chain.cpp) as one kernel (gemm_kernels.cu's
    ember_chain_*): no activation, ReLU and tanh-GELU; widths up to 128 and off every alignment the weight
    copy cares about; 1 to 300 rows; each dtype rounded after every layer as eager's GEMMs are."""
    widths, acts = CHAINS[chain]
    torch.manual_seed(rows)
    model = chain_model(widths, acts).to("cuda", dtype).eval()
    with torch.no_grad():
        check(model, torch.randn(rows, widths[0], device="cuda", dtype=dtype), grad=False, **TOL[dtype])
    assert chain_calls() >= 1, "\n".join(g.describe() for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_linear_chain_operands_of_any_layout(dtype):
    """A transposed input; layers without bias; right operands that are not K-contiguous (copied by the
    threads, not cp.async); an input at an odd element offset."""
    w1 = torch.randn(48, 24, device="cuda", dtype=dtype) / 5
    w2 = torch.randn(32, 48, device="cuda", dtype=dtype) / 5  # used as w2 @ ... : K-major rows
    w3 = torch.randn(16, 32, device="cuda", dtype=dtype) / 5

    def fn(x):
        h = x.t() @ w1.t()
        h = torch.relu(h @ w2.t().contiguous().t().t())
        return h @ w3.t()

    x = torch.randn(24, 40, device="cuda", dtype=dtype)
    compiled = run_compare(fn, x, dtype=dtype, dynamic=False)
    assert chain_calls() >= 2, "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    base = torch.randn(24 * 40 + 1, device="cuda", dtype=dtype)
    with torch.no_grad():
        skewed = base[1:].view(24, 40)
        assert_same(compiled(skewed), fn(skewed), **TOL[dtype])
    b_major = torch.randn(48, 32, device="cuda", dtype=dtype) / 5  # right operand [K, N] row-major
    run_compare(lambda x: torch.relu(x @ w1.t()) @ b_major @ w3.t(), torch.randn(5, 24, device="cuda", dtype=dtype),
                dtype=dtype, dynamic=False)
    assert chain_calls() >= 4


def test_linear_chain_in_reduce_overhead_mode():
    """20 x Linear(100, 100) replayed from a CUDA graph as one chain kernel: fresh inputs each call."""
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(20)]).cuda().eval()
    compiled = torch.compile(model, backend="ember", options={"cudagraphs": True, "fallback": "raise"})
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(32, 100, device="cuda")
            assert_same(compiled(x).clone(), model(x), **MATMUL_TOL)
    assert chain_calls() >= 1, "\n".join(g.describe() for _, g in EMBER_GRAPHS)


def test_linear_chains_sharing_a_kernel_keep_their_shared_memory():
    """Two chains of one dtype and row count share an entry point; the wider one (more shared memory) is
    compiled first, then the narrower, then the wider runs again. Each chain once set the entry point's
    shared-memory limit to its own size, so the wider chain's next launch failed (fuzz seed 708770: a
    forward and its backward)."""
    wide = chain_model([100, 100, 100], ["relu"]).cuda().eval()
    narrow = chain_model([3, 3, 2], ["none"]).cuda().eval()
    compiled_wide = torch.compile(wide, backend="ember", options={"fallback": "raise"})
    compiled_narrow = torch.compile(narrow, backend="ember", options={"fallback": "raise"})
    with torch.no_grad():
        for _ in range(2):
            x, y = torch.randn(2, 100, device="cuda"), torch.randn(2, 3, device="cuda")
            assert_same(compiled_wide(x), wide(x), **MATMUL_TOL)
            assert_same(compiled_narrow(y), narrow(y), **MATMUL_TOL)
    assert chain_calls() >= 4, "\n".join(g.describe() for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("rows", [1, 33, 100, 300])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matmul_softmax_as_one_chain_kernel(dtype, rows):
    """softmax(a @ b, -1) and log_softmax(linear(relu(linear(x))), -1): the GEMMs and the row normalization in
    one kernel (passes/linear_chain.cpp's epilogue), widths off 16 bytes among them."""
    a = torch.randn(rows, 100, device="cuda", dtype=dtype)
    b = torch.randn(100, 100, device="cuda", dtype=dtype) / 10
    run_compare(lambda a, b: torch.softmax(a @ b, -1), a, b, dtype=dtype, dynamic=False)
    model = chain_model([37, 53, 29], ["relu", "none"]).to("cuda", dtype).eval()
    x = torch.randn(rows, 37, device="cuda", dtype=dtype)
    run_compare(lambda x: torch.log_softmax(model(x), -1), x, dtype=dtype, dynamic=False)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "softmax, " in listing and "log_softmax, " in listing, listing
    assert chain_calls() >= 4, listing
