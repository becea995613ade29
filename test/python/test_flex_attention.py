"""flex_attention under ember, compared with eager's flex_attention on fresh random inputs. Calls that need
gradients, float32 and CPU calls become dense ATen ops (attention.py, dense_flex_attention) that AOTAutograd
differentiates; 16-bit CUDA inference calls run the fused kernel (flex.py, kernels/cuda/flex_attention.cpp),
checked against eager on float32 copies. Covered: score_mods with captured buffers, block masks (partial and
full blocks, rows masked whole), documents in an int64 buffer, grouped-query heads, the log-sum-exp output,
decoding (keys split over blocks),
lengths off the 64-row tile, other key and value lengths and widths, gradients (CUDA), CUDA graphs, queries
laid out as transposes, and the translation of the mods itself (on the CPU). The fused kernel's tests run in both
its forms where the GPU has two (Hopper: wgmma, and m16n8k16 MMAs forced by EMBER_FLEX_WGMMA=0)."""

import re

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import ember
from helpers import DEVICES, EMBER_GRAPHS, check

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")

TOL = dict(atol=2e-4, rtol=2e-4)


def grad_on(device):
    """flex_attention refuses inputs that require grad on the CPU (NotImplementedError, raised by its Python
    front end, which Dynamo traces too): gradients are compared on CUDA."""
    return device != "cpu"


def qkv(device, batch=2, heads=4, kv_heads=4, q_len=37, kv_len=45, dim=16, dtype=torch.float32, transposed=False):
    def make(h, length):
        if transposed:  # [B, L, H, E] storage, as a model's projections give
            return torch.randn(batch, length, h, dim, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, h, length, dim, device=device, dtype=dtype)

    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def ir_text():
    return "\n".join(g.ir() for _, g in EMBER_GRAPHS)


@pytest.mark.parametrize("device", DEVICES)
def test_score_mod_with_a_captured_bias(device):
    bias = torch.randn(4, 37, device=device)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5 + bias[h, qi] + (qi - ki) * 0.01)

    check(fn, *qkv(device), grad=grad_on(device), **TOL)
    assert "aten::bmm" in ir_text()  # the scores and the output: dense, as ATen ops ember compiled


@pytest.mark.parametrize("device", DEVICES)
def test_causal_block_mask_grouped_heads_and_lse(device):
    q_len = kv_len = 64
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q_len, kv_len, device=device)

    def fn(q, k, v):
        out, lse = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True)
        return out, lse

    check(fn, *qkv(device, heads=8, kv_heads=2, q_len=q_len, kv_len=kv_len, transposed=True), grad=grad_on(device),
          **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_the_mask_removes_whole_give_zeros(device):
    mask = create_block_mask(lambda b, h, qi, ki: (qi % 3 != 0) & (ki <= qi), None, None, 32, 32, device=device)

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=mask, return_lse=True)

    eager, ours = check(fn, *qkv(device, q_len=32, kv_len=32), grad=grad_on(device), **TOL)
    assert torch.equal(ours[0][:, :, ::3], torch.zeros_like(ours[0][:, :, ::3]))


@pytest.mark.parametrize("device", DEVICES)
def test_sixteen_bit_inputs(device):
    if device == "cpu":
        pytest.skip("eager's 16-bit flex_attention on the CPU is what the CUDA case checks")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.tanh(s / 8) * 8)

    check(fn, *qkv(device, dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)



# ---- the fused CUDA kernel (flex.py, kernels/cuda/flex_attention.cpp) -----------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def kernel_ran(form=None):
    """True when a plan of this test ran ember::flex_attention through the NVRTC kernel (not its dense fallback),
    in `form` where given: "wgmma" or "mma.sync". The kernel counts its calls: a call it declined (the op's
    dense form ran) leaves "0 calls"."""
    described = [g.describe() for _, g in EMBER_GRAPHS]
    return any("flex attention kernel" in d and " 0 calls)" not in d and (form is None or f"({form}," in d)
               for d in described)


@pytest.fixture(params=["default", "mma.sync"])
def kernel_form(request, monkeypatch):
    """The fused kernel's form: the one ember picks for this GPU (wgmma for prefill on Hopper, m16n8k16 MMAs
    elsewhere), or the MMA form forced (EMBER_FLEX_WGMMA=0), so that a Hopper machine tests both."""
    if request.param == "mma.sync":
        monkeypatch.setattr(ember.config, "flex_wgmma", False)
        return "mma.sync"
    return "wgmma" if torch.cuda.get_device_capability() == (9, 0) else "mma.sync"


def against_float32(fn, q, k, v, atol, rtol):
    """fn compiled by ember on 16-bit inputs against eager's flex_attention on their float32 copies: the kernel
    should be as close to the exact result as 16-bit inputs allow, not merely to eager's 16-bit rounding."""
    with torch.no_grad():
        ours = torch.compile(fn, backend="ember", options={"fallback": "raise"})(q, k, v)
        ref = fn(q.float(), k.float(), v.float())
    ours, ref = (ours, ref) if isinstance(ours, tuple) else ((ours,), (ref,))
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape and a.stride() == b.stride(), (i, a.shape, a.stride(), b.shape, b.stride())
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"output {i}: -inf where eager has none, or the reverse"
        torch.testing.assert_close(a.float()[finite], b.float()[finite], atol=atol, rtol=rtol, msg=lambda m: f"output {i}: {m}")
    return ours


FUSED_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [16, 64, 96, 128])
def test_fused_kernel_causal_bias_grouped_heads(dtype, dim, kernel_form):
    length = 200  # three full tiles of 64 and a tail
    bias = torch.randn(8, device="cuda")
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device="cuda")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h], block_mask=mask,
                              enable_gqa=True, return_lse=True)

    q, k, v = qkv("cuda", heads=8, kv_heads=2, q_len=length, kv_len=length, dim=dim, dtype=dtype,
                  transposed=dim == 64)
    against_float32(fn, q, k, v, **FUSED_TOL[dtype])
    assert "ember::flex_attention" in ir_text() and kernel_ran(kernel_form)


@needs_cuda
@pytest.mark.parametrize("dim, scale", [(64, None), (128, 0.3), (64, -0.2)])
def test_fused_kernel_plain_scores(dim, scale, kernel_form):
    """No score_mod: the kernel keeps the scores unscaled until the exponent (a positive scale) or scales them
    first (a negative one). Causal, with a tail past the last whole tile."""
    length = 300
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device="cuda")

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=mask, scale=scale, return_lse=True)

    q, k, v = qkv("cuda", heads=4, kv_heads=4, q_len=length, kv_len=length, dim=dim, dtype=torch.bfloat16)
    against_float32(fn, q, k, v, **FUSED_TOL[torch.bfloat16])
    assert kernel_ran(kernel_form)
    assert any("plain scores" in g.describe() for _, g in EMBER_GRAPHS) == (scale is None or scale > 0)


@needs_cuda
def test_fused_kernel_without_block_mask_other_lengths_and_value_width(kernel_form):
    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.tanh(s / 4) * 4 - (qi - ki).abs() * 0.01,
                              return_lse=True)

    q = torch.randn(3, 4, 137, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, 4, 300, 32, device="cuda", dtype=torch.bfloat16)
    against_float32(fn, q, k, v, **FUSED_TOL[torch.bfloat16])
    assert kernel_ran(kernel_form)


@needs_cuda
def test_fused_kernel_keys_and_values_broadcast_over_heads(kernel_form):
    """K and V expanded over the heads (stride 0): the wgmma form's TMA maps take them as they lie or copy them."""
    length = 160
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device="cuda")

    def fn(q, k, v):
        return flex_attention(q, k, v, block_mask=mask, return_lse=True)

    q = torch.randn(2, 4, length, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1, length, 64, device="cuda", dtype=torch.bfloat16).expand(2, 4, length, 64)
    v = torch.randn(2, 1, length, 64, device="cuda", dtype=torch.bfloat16).expand(2, 4, length, 64)
    against_float32(fn, q, k, v, **FUSED_TOL[torch.bfloat16])
    assert kernel_ran(kernel_form)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernel_document_mask_sliding_window_and_empty_rows(dtype, kernel_form):
    length = 333
    doc = torch.randint(0, 4, (length,), device="cuda").sort().values  # int64 document ids
    window = 70

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi - ki <= window) & (ki <= qi) & (qi % 7 != 3)

    mask = create_block_mask(mask_mod, None, None, length, length, device="cuda")
    scale = torch.rand(2, length, device="cuda")  # a [B, L] table read per (b, q)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * scale[b, qi], block_mask=mask,
                              return_lse=True)

    q, k, v = qkv("cuda", batch=2, heads=3, kv_heads=3, q_len=length, kv_len=length, dim=64, dtype=dtype)
    out, lse = against_float32(fn, q, k, v, **FUSED_TOL[dtype])
    assert kernel_ran(kernel_form)
    assert torch.equal(out[:, :, 3::7], torch.zeros_like(out[:, :, 3::7]))  # rows the mask removes whole
    assert bool((lse[:, :, 3::7] == float("-inf")).all())


@needs_cuda
def test_fused_kernel_over_new_lengths():
    """A prompt length per call, each with its own BlockMask: the graph recompiled with symbolic lengths keeps the
    kernel, the sizes read per call."""
    def fn(q, k, v, mask):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (qi - ki) * 0.02, block_mask=mask)

    compiled = torch.compile(fn, backend="ember", options={"fallback": "raise"})
    with torch.no_grad():
        for length in (128, 200, 333, 517):
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device="cuda")
            q, k, v = qkv("cuda", q_len=length, kv_len=length, dim=64, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(q, k, v, mask).float(), fn(q.float(), k.float(), v.float(), mask),
                                       **FUSED_TOL[torch.bfloat16])
    assert kernel_ran()


@needs_cuda
@pytest.mark.parametrize("q_len, kv_len, heads, kv_heads, dim, mask_heads",
                         [(1, 2000, 4, 4, 64, None), (1, 300, 2, 1, 64, None), (5, 4100, 8, 2, 64, None),
                          (1, 8192, 32, 8, 128, None), (33, 600, 8, 2, 64, None), (3, 900, 8, 2, 64, 8)])
def test_fused_kernel_decoding_splits_the_keys(q_len, kv_len, heads, kv_heads, dim, mask_heads):
    """A few query rows against a long cache: too few query tiles for the SMs, so blocks share a tile's keys and a
    second kernel merges them; with grouped heads a block takes the query heads of one key-value head (rows of
    several heads in one tile), except where the BlockMask differs per head (mask_heads). The mask reads the cache
    position from a tensor and keeps a sliding window (per head, where the BlockMask has heads)."""
    position = torch.tensor(kv_len - 7, device="cuda")

    def mask_mod(b, h, qi, ki):
        window = 1500 if mask_heads is None else 100 + 50 * h
        return (ki <= position + qi) & (position + qi - ki < window)

    mask = create_block_mask(mask_mod, None, mask_heads, q_len, kv_len, device="cuda")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + h * 0.1, block_mask=mask,
                              enable_gqa=True, return_lse=True)

    q, k, v = qkv("cuda", batch=1 if dim == 64 else 2, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                  dim=dim, dtype=torch.bfloat16)
    against_float32(fn, q, k, v, **FUSED_TOL[torch.bfloat16])
    assert kernel_ran()


@needs_cuda
@pytest.mark.parametrize("dim", [64, 128])
def test_fused_kernel_prefill_splits_the_keys(dim, kernel_form):
    """Query rows beyond decoding (the prefill kernel: wgmma on Hopper) but too few query tiles for the SMs, so
    the keys are split over blocks too. At head dim 128 the second tile's upper warpgroup has no query row."""
    q_len, kv_len = 130, 4100
    offset = kv_len - q_len
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi + offset, None, None, q_len, kv_len, device="cuda")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - (qi + offset - ki) * 0.001,
                              block_mask=mask, return_lse=True)

    q, k, v = qkv("cuda", batch=1, heads=2, kv_heads=2, q_len=q_len, kv_len=kv_len, dim=dim, dtype=torch.bfloat16)
    against_float32(fn, q, k, v, **FUSED_TOL[torch.bfloat16])
    assert kernel_ran(kernel_form)


@needs_cuda
def test_fused_kernel_replayed_by_cuda_graphs():
    """reduce-overhead captures the kernel's launch: each replay must read the new inputs."""
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 256, 256, device="cuda")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - (qi - ki) * 0.05, block_mask=mask)

    compiled = torch.compile(fn, backend="ember", options={"fallback": "raise", "cudagraphs": True})
    with torch.no_grad():
        for _ in range(4):
            q, k, v = qkv("cuda", q_len=256, kv_len=256, dim=64, dtype=torch.bfloat16)
            out = compiled(q, k, v).clone()
            torch.testing.assert_close(out.float(), fn(q.float(), k.float(), v.float()), **FUSED_TOL[torch.bfloat16])
    assert kernel_ran()


@needs_cuda
def test_fused_kernel_reads_a_parameter_under_no_grad():
    """A learned per-head bias (a parameter, requires_grad) in inference: no gradient flows, so the kernel runs."""
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(4, device="cuda"))

        def forward(self, q, k, v):
            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + self.bias[h])

    model = Attention()
    q, k, v = qkv("cuda", dim=64, dtype=torch.bfloat16)
    with torch.no_grad():
        ours = torch.compile(model, backend="ember", options={"fallback": "raise"})(q, k, v)
        ref = model(q.float(), k.float(), v.float())
    torch.testing.assert_close(ours.float(), ref, **FUSED_TOL[torch.bfloat16])
    assert kernel_ran()


@needs_cuda
def test_fused_kernel_left_out_where_gradients_are_needed():
    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5)

    check(fn, *qkv("cuda", dim=64, dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)
    assert "ember::flex_attention" not in ir_text()  # the dense form AOTAutograd differentiates


def test_mods_become_cuda_statements():
    """The translation of score_mod / mask_mod graphs (flex.py) on the CPU: what the kernel is compiled with,
    and the mods it leaves to the dense form."""
    from ember.flex import Unsupported, mod_program

    graphs = {}

    def capture(gm, example_inputs):
        graphs.update({name: m for name, m in gm.named_children()})
        return gm.forward

    bias, doc, offset = torch.randn(4), torch.arange(16), torch.tensor(3)
    mask = create_block_mask(lambda b, h, qi, ki: (qi + offset >= ki) & ((qi - ki) % 3 != 1), None, None, 16, 16,
                             device="cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(doc[qi] == doc[ki], s / 2, -s)
                              + bias[h] * (qi // 3), block_mask=mask)

    torch.compile(fn, backend=capture)(*qkv("cpu", q_len=16, kv_len=16))
    score = mod_program(graphs["score_mod_0"], 5, 0)
    masked = mod_program(graphs["mask_fn_0"], 4, 2)
    assert "ld_i64(p.buf[0], (long long)(q) * p.bs[0][0])" in score
    assert "ld_f32(p.buf[1], (long long)(h) * p.bs[1][0])" in score
    assert "py_floordiv(" in score and re.search(r"return \(float\)\(v\d+\);$", score)
    assert "py_mod(" in masked and "(q + ld_i64(p.buf[2], 0))" in masked and ">= kv" in masked

    graphs.clear()
    torch._dynamo.reset()
    torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s.round()),
                  backend=capture)(*qkv("cpu", q_len=16, kv_len=16))
    with pytest.raises(Unsupported):  # round() has no statement: the call stays dense
        mod_program(graphs["score_mod_0"], 5, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_explain_says_how_each_call_runs(device):
    import ember

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5)

    with torch.no_grad():
        text = str(ember.explain(fn)(*qkv(device, dim=64, dtype=torch.bfloat16 if device == "cuda" else torch.float32)))
    if device == "cuda":
        assert "flex_attention: 1 call(s) as ember's CUDA kernel, 0 as dense ATen ops" in text, text
    else:
        assert "flex_attention: 0 call(s) as ember's CUDA kernel, 1 as dense ATen ops (not 16-bit CUDA inputs)" in text, text


def test_exported_package_runs_flex_attention(tmp_path):
    """ember.export of a model calling flex_attention (a learned bias, a causal BlockMask, a projection after it):
    the package holds the dense form and, loaded through the C++ loader, matches eager on new inputs. CPU only
    here: the CUDA export of it was not run on a GPU yet."""
    import ember

    length = 40
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device="cpu")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(4))
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, q, k, v):
            out = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + self.bias[h], block_mask=mask)
            return self.proj(out)

    model = Model()
    path = tmp_path / "flex.ember"
    ember.export(model, qkv("cpu", q_len=length, kv_len=length), str(path))
    loaded = ember.load(str(path))
    for _ in range(2):
        q, k, v = qkv("cpu", q_len=length, kv_len=length)
        with torch.no_grad():
            torch.testing.assert_close(loaded.run([q, k, v])[0], model(q, k, v), atol=1e-5, rtol=1e-5)
