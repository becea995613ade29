"""flex_attention under ember: each call becomes dense ATen ops (attention.py, dense_flex_attention) that
AOTAutograd differentiates, compared with eager's flex_attention (its own dense path) on fresh random inputs:
score_mods with captured buffers, block masks, grouped-query heads, the log-sum-exp output, gradients (CUDA),
16-bit inputs and queries laid out as transposes."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

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

