"""Training in mode="reduce-overhead": attention with dropout, and Hugging Face BERT over many steps.

The forward is captured on its second call while its backward still runs eagerly once more: the two
then disagree on where attention's dropout seeds live (cudagraph/attention_seeds.cpp). That crashed the
process in BERT training; these tests hold it. GPU only.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Attention(nn.Module):
    def __init__(self, dim=64, heads=4, dropout=0.1):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-efficient", "bf16-flash"])
def test_attention_dropout_training_survives_capture(dtype):
    torch.manual_seed(0)
    model = Attention().cuda().to(dtype)
    compiled = torch.compile(model, backend="ember", mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(8):
        x = torch.randn(4, 128, 64, device="cuda", dtype=dtype)
        compiled(x).float().pow(2).mean().backward()
        torch.cuda.synchronize()
        for p in model.parameters():
            assert torch.isfinite(p.grad).all()
        opt.step()
        opt.zero_grad()


def test_attention_without_dropout_matches_eager_every_step():
    torch.manual_seed(0)
    model = Attention(dropout=0.0).cuda()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ember", mode="reduce-overhead")
    for _ in range(6):
        x = torch.randn(4, 128, 64, device="cuda")
        compiled(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3)


def _bert(transformers, dropout):
    config = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, vocab_size=1000, max_position_embeddings=128,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return transformers.BertModel(config).cuda()


def _loss(model, ids):
    return model(ids).last_hidden_state.float().pow(2).mean()


def test_bert_training_with_dropout_runs_60_steps():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _bert(transformers, dropout=0.1)
    compiled = torch.compile(model, backend="ember", mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(60):
        ids = torch.randint(0, 1000, (8, 64), device="cuda")
        loss = _loss(compiled, ids)
        loss.backward()
        assert torch.isfinite(loss)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    for p in model.parameters():
        assert torch.isfinite(p).all()


def test_bert_training_matches_eager_at_first_and_last_step():
    """50 AdamW steps; at the first and the last, eager computes the gradients from the same parameters."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _bert(transformers, dropout=0.0)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ember", mode="reduce-overhead")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = 50
    for step in range(steps):
        ids = torch.randint(0, 1000, (8, 64), device="cuda")
        _loss(compiled, ids).backward()
        if step in (0, steps - 1):
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            _loss(ref, ids).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                # The pooler is outside the loss: eager leaves its gradients None, a compiled backward
                # (AOTAutograd's too) fills them from zero tangents.
                expected = q.grad if q.grad is not None else torch.zeros_like(q)
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, expected, atol=2e-4, rtol=2e-3, msg=f"{name} at step {step}")
        opt.step()
        opt.zero_grad()
