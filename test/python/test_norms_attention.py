"""Normalizations (batch / layer / group norm, running stats included), softmax, attention, embedding,
losses. Forward and backward against eager."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import DEVICES, EMBER_GRAPHS, MATMUL_TOL, Wrap, check


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm2d(device, train):
    bn = nn.BatchNorm2d(6).to(device)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    bn.train(train)
    # check() compares running_mean / running_var / num_batches_tracked after the call (state_dict).
    check(bn, torch.randn(4, 6, 5, 5, device=device) * 2 + 1, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_norm_running_stats_over_steps(device):
    """Several training steps through the same compiled module: running stats keep matching eager."""
    from helpers import compile_ember

    bn = nn.BatchNorm1d(5, momentum=0.3).to(device)

    bn_c = copy.deepcopy(bn)
    compiled = compile_ember(bn_c)
    for step in range(3):
        check(bn, torch.randn(8, 5, device=device) * (step + 1), compiled=compiled, min_graphs=0, **MATMUL_TOL)
    assert bn.num_batches_tracked.item() == 3
    torch.testing.assert_close(bn_c.running_mean, bn.running_mean)
    torch.testing.assert_close(bn_c.running_var, bn.running_var)


@pytest.mark.parametrize("device", DEVICES)
def test_functional_batch_norm_without_running_stats(device):
    check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
          torch.randn(6, 3, 4, device=device), torch.rand(3, device=device) + 0.5, torch.randn(3, device=device),
          **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_layer_norm(device, affine):
    ln = nn.LayerNorm(24, elementwise_affine=affine).to(device)
    if affine:
        with torch.no_grad():
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    check(ln, torch.randn(3, 7, 24, device=device) * 3 + 1, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_multi_dim_and_rms_norm(device):
    model = Wrap(lambda m, x: (m.ln(x), m.rms(x)), ln=nn.LayerNorm([5, 6]), rms=nn.RMSNorm(6)).to(device)
    check(model, torch.randn(2, 3, 5, 6, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_group_norm(device):
    gn = nn.GroupNorm(3, 12).to(device)
    with torch.no_grad():
        gn.weight.uniform_(0.5, 1.5)
        gn.bias.uniform_(-0.5, 0.5)
    check(gn, torch.randn(2, 12, 5, 3, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [0, 2])
def test_weight_norm(device, dim):
    """A weight-normed grouped Conv1d (wav2vec2's positional convolution normalizes over dim=2), training:
    values and gradients against eager, with the norm one ATen _weight_norm_interface call forward and its
    backward op backward (decompositions.py keeps it whole)."""
    import ember

    conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(12, 10, 5, padding=2, groups=2), dim=dim).to(device)
    with torch.no_grad():
        conv.parametrizations.weight.original0.uniform_(0.5, 1.5)  # g
    x = torch.randn(3, 12, 17, device=device)
    check(conv, x, **MATMUL_TOL)
    ops = [g.aten_ops for g in ember.explain(conv)(x).graphs]
    assert [o.get("aten::_weight_norm_interface", 0) for o in ops] == [1, 0], ops
    assert not any("aten::linalg_vector_norm" in o for o in ops), ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_log_softmax(device, dim):
    check(lambda x: (torch.softmax(x, dim), F.log_softmax(x, dim)), torch.randn(4, 9, 5, device=device) * 3)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_fp16_input_fp32_output(device):
    check(lambda x: torch.softmax(x, -1, dtype=torch.float32), torch.randn(3, 17, device=device).half(), atol=1e-3,
          rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_scorer(device):
    def entropy(f):
        p = torch.softmax(f, -1)
        return -(p * torch.log(p + 1e-8)).sum(-1)

    check(entropy, torch.randn(16, 10, device=device) * 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa(device, causal):
    q, k, v = (torch.randn(2, 3, 7, 8, device=device) for _ in range(3))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_with_masks_and_cross_lengths(device):
    q = torch.randn(2, 4, 5, 16, device=device)
    k = torch.randn(2, 4, 9, 16, device=device)
    v = torch.randn(2, 4, 9, 16, device=device)
    bool_mask = torch.rand(2, 1, 5, 9, device=device) > 0.3
    bool_mask[..., 0] = True  # every query sees at least one key
    float_mask = torch.randn(5, 9, device=device)

    def fn(q, k, v, bm, fm):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bm)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=fm, scale=0.3)
        return a, b

    check(fn, q, k, v, bool_mask, float_mask, **MATMUL_TOL)


def _positions(n, device):
    return torch.arange(n, device=device) + 0


def _segments(n, device, split=None):
    """Packed-sequence ids of one row of n positions (transformers' cumsum of position steps): all 0, or a
    second sequence from position `split` on."""
    steps = torch.ones(1, n, dtype=torch.long, device=device)
    if split is not None:
        steps = steps.masked_fill(torch.arange(n, device=device) == split, 0)
    return (steps != 1).cumsum(-1)


# Masks built inside the graph from constants, as transformers 5.17 builds them under torch.compile.
CONSTANT_MASKS = {
    # (the mask for an L x L attention, what ember makes of it: dropped, is_causal or kept)
    "all_true": (lambda n, d: (_positions(n, d)[None, None, :, None] >= 0).expand(2, -1, n, n), "dropped"),
    "zeros": (lambda n, d: torch.zeros(n, n, device=d), "dropped"),
    "causal_bool": (lambda n, d: (_positions(n, d)[None, None, None, :] <= _positions(n, d)[None, None, :, None])
                    .expand(2, 1, n, n), "causal"),
    "causal_additive": (lambda n, d: torch.full((n, n), float("-inf"), device=d).triu(1), "causal"),
    "first_key_hidden": (lambda n, d: (_positions(n, d) >= 1)[None, :].expand(n, n), "kept"),
    "below_diagonal_and_first_key": (lambda n, d: torch.ones(n, n, dtype=torch.bool, device=d).tril(-1)
                                     | torch.eye(n, dtype=torch.bool, device=d)[0], "kept"),
    # GPT-2's under transformers 5.17: causal, and the same packed sequence (segment ids all 0), its
    # comparisons as the operator methods torch 2.11's Dynamo records (call_method __eq__, __le__, __and__)
    "causal_packed_methods": (lambda n, d: _positions(n, d)[None, None, None, :].__le__(
        _positions(n, d)[None, None, :, None]).__and__(_segments(n, d)[:, None, :, None].__eq__(
            _segments(n, d)[:, None, None, :])).expand(2, 1, n, n), "causal"),
    "two_segments_methods": (lambda n, d: _positions(n, d)[None, None, None, :].__le__(
        _positions(n, d)[None, None, :, None]).__and__(_segments(n, d, split=3)[:, None, :, None].__eq__(
            _segments(n, d, split=3)[:, None, None, :])).expand(2, 1, n, n), "kept"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", list(CONSTANT_MASKS))
def test_constant_attention_masks(device, mask):
    """A mask computed from constants alone is read at compile time (attention.py, simplify_masks): one
    that masks nothing is dropped, the causal one becomes is_causal, any other stays. Values and gradients
    match eager's either way."""
    import ember

    build, expected = CONSTANT_MASKS[mask]
    q, k, v = (torch.randn(2, 3, 7, 8, device=device) for _ in range(3))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(7, q.device))

    check(fn, q, k, v, **MATMUL_TOL)
    with ember.config.patch(compile_cache=False):  # a hit (EMBER_TEST_COMPILE_CACHE=1) lowers nothing to report
        report = ember.explain(fn)(q, k, v)
    assert report.masks == {"dropped": [1, 0], "causal": [0, 1], "kept": [0, 0]}[expected], str(report)


# Masks built from the length under dynamic shapes (mask_algebra.py): the table above, plus masks that equal the
# causal one or mask nothing at some lengths only, which must stay.
SIZED_MASKS = {
    **CONSTANT_MASKS,
    "sliding_window_of_4": (lambda n, d: (_positions(n, d)[None, :] <= _positions(n, d)[:, None])
                            & (_positions(n, d)[None, :] > _positions(n, d)[:, None] - 4), "kept"),
    "first_8_keys": (lambda n, d: (_positions(n, d) < 8)[None, :].expand(n, n), "kept"),
    "first_key_shifted": (lambda n, d: (_positions(n, d) - 1 >= 0)[None, :].expand(n, n), "kept"),
    "causal_tril": (lambda n, d: torch.ones(n, n, dtype=torch.bool, device=d).tril(), "causal"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", list(SIZED_MASKS))
def test_attention_masks_built_from_a_symbolic_length(device, mask):
    """Under dynamic shapes a mask built from the length is read for every length at once (mask_algebra.py): one
    that masks nothing is dropped, one that is causal at every length becomes is_causal, any other stays (a window
    of 4 is causal up to length 4, `position < 8` masks nothing up to 8: both stay). Every length, from below those
    to above them, matches eager."""
    import ember

    build, expected = SIZED_MASKS[mask]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=build(q.shape[2], q.device))

    compiled = torch.compile(fn, backend="ember", dynamic=True, options={"fallback": "raise"})
    for n in (3, 6, 11, 20):
        q, k, v = (torch.randn(2, 3, n, 8, device=device) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), **MATMUL_TOL)
    q, k, v = (torch.randn(2, 3, 9, 8, device=device) for _ in range(3))
    with ember.config.patch(compile_cache=False):
        report = ember.explain(fn, dynamic=True)(q, k, v)
    assert report.masks == {"dropped": [1, 0], "causal": [0, 1], "kept": [0, 0]}[expected], str(report)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_masks_from_inputs_or_non_square_stay(device):
    """A mask read from an input, or a causal-looking one over a non-square attention, is not touched."""
    import ember

    q = torch.randn(2, 3, 5, 8, device=device)
    k, v = (torch.randn(2, 3, 9, 8, device=device) for _ in range(2))
    keep = torch.ones(5, 9, dtype=torch.bool, device=device)

    def fn(q, k, v, keep):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        lower = torch.ones(5, 9, dtype=torch.bool, device=q.device).tril()
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=lower)
        return a, b

    check(fn, q, k, v, keep, **MATMUL_TOL)
    assert ember.explain(fn)(q, k, v, keep).masks == [0, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_multihead_attention(device):
    mha = nn.MultiheadAttention(16, 4, batch_first=True).to(device)
    model = Wrap(lambda m, x: m.mha(x, x, x, need_weights=False)[0], mha=mha)
    check(model, torch.randn(2, 6, 16, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding(device):
    emb = nn.Embedding(20, 8, padding_idx=0).to(device)
    idx = torch.randint(0, 20, (3, 5), device=device)
    idx[0, 0] = 0
    idx[1, 2] = idx[1, 3]  # repeated index: its gradient accumulates
    check(emb, idx, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_embedding_grad_op_matches_atens(device, dtype):
    """ember::embedding_grad (the CUDA weight gradient of an embedding, kernels/embedding_grad_op.cpp) against
    aten::embedding_dense_backward: repeated indices accumulate, the padding row gets nothing, 2-D indices."""
    from ember import _C  # noqa: F401  loads libember, which registers the op

    grad = torch.randn(4, 33, 24, device=device, dtype=dtype)
    idx = torch.randint(0, 50, (4, 33), device=device)
    idx[0, :5] = 7  # a row many tokens add into
    idx[1, :3] = 0
    for padding_idx in (-1, 0, 7):
        got = torch.ops.ember.embedding_grad(grad, idx, 50, padding_idx)
        want = torch.ops.aten.embedding_dense_backward(grad.float(), idx, 50, padding_idx, False).to(dtype)
        assert got.dtype == dtype and got.shape == (50, 24)
        torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_embedding_grad_op_on_fresh_pages(dtype):
    """ember::embedding_grad's CPU kernel: a table of 1 MiB or more starts as fresh zero pages (no fill), and gets
    ATen's values: repeated indices accumulate in index order, the padding row gets nothing. The table is an
    ordinary tensor: it takes an in-place add, is written everywhere, and outlives the call's other tensors."""
    from ember import _C  # noqa: F401  loads libember, which registers the op

    num_weights, width = 5000, 96  # 1.8 MiB in float32
    grad = torch.randn(3, 70, width, dtype=dtype)
    idx = torch.randint(0, num_weights, (3, 70))
    idx[0, :6] = 4999
    idx[2, :4] = 3
    for padding_idx in (-1, 3):
        got = torch.ops.ember.embedding_grad(grad, idx, num_weights, padding_idx)
        want = torch.ops.aten.embedding_dense_backward(grad, idx, num_weights, padding_idx, False)
        assert got.dtype == dtype and got.shape == (num_weights, width) and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    del grad, want
    got += 1
    assert torch.equal(got[1000], torch.ones(width, dtype=dtype))
    got.mul_(2)
    assert got.sum().item() > 0


def test_cpu_embedding_gradient_runs_as_one_index_add():
    """A CPU float32 embedding's weight gradient is ember::embedding_grad in the backward plan, with eager's values
    (its table over 1 MiB: fresh pages); a bfloat16 one keeps ATen's embedding_dense_backward."""
    emb = nn.Embedding(4000, 80, padding_idx=1)
    idx = torch.randint(0, 4000, (6, 40))
    idx[0, :4] = 1
    idx[2, :9] = 5
    check(Wrap(lambda m, i: m.emb(i) * 3, emb=emb), idx, **MATMUL_TOL)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "ember::embedding_grad" in listing and "embedding_dense_backward" not in listing, listing
    EMBER_GRAPHS.clear()
    torch._dynamo.reset()
    check(Wrap(lambda m, i: m.emb(i) * 3, emb=copy.deepcopy(emb).to(torch.bfloat16)), idx, atol=2e-2, rtol=2e-2)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "embedding_dense_backward" in listing and "ember::embedding_grad" not in listing, listing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_embedding_gradient_runs_as_one_index_add(dtype):
    """A CUDA embedding's weight gradient is ember::embedding_grad in the backward plan, with eager's values; under
    torch.use_deterministic_algorithms(True) it stays ATen's embedding_dense_backward."""
    emb = nn.Embedding(300, 16, padding_idx=1).to("cuda", dtype)
    idx = torch.randint(0, 300, (6, 40), device="cuda")
    idx[0, :4] = 1
    idx[2, :9] = 5
    tol = MATMUL_TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    check(Wrap(lambda m, i: m.emb(i) * 3, emb=emb), idx, **tol)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "ember::embedding_grad" in listing and "embedding_dense_backward" not in listing, listing
    EMBER_GRAPHS.clear()
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(True)
    try:
        check(Wrap(lambda m, i: m.emb(i) * 3, emb=emb), idx, **tol)
    finally:
        torch.use_deterministic_algorithms(False)
    listing = "\n".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "embedding_dense_backward" in listing and "ember::embedding_grad" not in listing, listing


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy(device):
    def fn(logits, target, soft):
        return (F.cross_entropy(logits, target), F.cross_entropy(logits, target, reduction="none", ignore_index=2),
                F.cross_entropy(logits, target, label_smoothing=0.1), F.cross_entropy(logits, soft.softmax(-1)))

    target = torch.randint(0, 6, (9,), device=device)
    target[0] = 2
    check(fn, torch.randn(9, 6, device=device), target, torch.randn(9, 6, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_other_losses(device):
    def fn(x, y, t):
        return (F.mse_loss(x, y), F.binary_cross_entropy_with_logits(x, t), F.binary_cross_entropy(x.sigmoid(), t),
                F.nll_loss(F.log_softmax(x, -1), t.argmax(-1)), F.smooth_l1_loss(x, y), F.kl_div(x.log_softmax(-1), y.softmax(-1), reduction="batchmean"))

    check(fn, torch.randn(5, 4, device=device), torch.randn(5, 4, device=device),
          torch.rand(5, 4, device=device).round(), grad=[0, 1])


CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float_broadcast", "float_transposed", "float_unaligned"])
def test_cuda_attention_runs_a_fused_kernel(dtype, mask, tmp_path):
    """On CUDA ember sends attention to ATen's cuDNN (16-bit on Hopper) / flash / memory-efficient kernel
    (python_bindings/ember/attention.py), transposed projections and broadcast masks included; values and
    gradients match eager."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 64, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
    masks = {"none": None, "causal": None,
             "bool": torch.rand(2, 1, 16, 16, device="cuda") > 0.2,
             "float_broadcast": torch.randn(16, device="cuda", dtype=dtype).expand(2, 1, 16, 16),
             # T5's position bias: [q, k, heads] permuted to [1, heads, q, k], the last dimension strided
             "float_transposed": torch.randn(16, 16, 4, device="cuda", dtype=dtype).permute(2, 0, 1).unsqueeze(0),
             # rows 17 apart from an offset of 1: no 16-element alignment
             "float_unaligned": torch.randn(2, 1, 16, 17, device="cuda", dtype=dtype)[..., 1:]}
    attn_mask = masks[mask]
    if mask == "bool":
        attn_mask[..., 0] = True

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal")

    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    check(fn, q.detach(), k.detach(), v.detach(), **tol, grad_atol=tol["atol"] * 5, grad_rtol=tol["rtol"] * 5,
          options={"debug_dir": str(tmp_path)})
    graphs = "".join(p.read_text() for p in tmp_path.glob("*.fx.py"))
    kernels = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention")
    assert any(k in graphs for k in kernels)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if dtype != torch.float32 and hopper:
        assert "_scaled_dot_product_cudnn_attention" in graphs
    assert "aten.bmm" not in graphs


@CUDA_ONLY
def test_cuda_attention_outside_the_kernels_constraints_keeps_the_op():
    """Head dim 12 (not a multiple of 8) and dropout: the op is traced as before, and still matches eager."""
    q, k, v = (torch.randn(2, 3, 7, 12, device="cuda") for _ in range(3))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v, **MATMUL_TOL)
