"""Whole models: MLP, a deep stack of linears, TransformerEncoderLayer, resnet18 (torchvision), a tiny
GPT-2 (transformers). Forward and backward against eager, parameters' gradients and buffers included."""

import copy

import pytest
import torch
import torch.nn as nn

from helpers import DEVICES, EMBER_GRAPHS, MATMUL_TOL, check, compile_ember

MODEL_TOL = dict(atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_mlp(device):
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).to(device)
    check(mlp, torch.randn(8, 16, device=device), **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_training_steps_with_optimizer(device):
    """Three SGD steps, eager and compiled side by side: the parameters stay equal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.SiLU(), nn.Linear(32, 1)).to(device)
    model_c = copy.deepcopy(model)
    compiled = compile_ember(model_c)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_c = torch.optim.SGD(model_c.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = torch.randn(16, 10, device=device), torch.randn(16, 1, device=device)
        for m, o in ((model, opt), (compiled, opt_c)):
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
    for (name, p), p_c in zip(model.named_parameters(), model_c.parameters()):
        torch.testing.assert_close(p_c, p, **MODEL_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_inference_mode(device):
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)
    with torch.inference_mode():
        check(mlp, torch.randn(5, 16, device=device), grad=False, **MATMUL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_twenty_linears(device):
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(20)]).to(device)
    check(model, torch.randn(4, 100, device=device), **MODEL_TOL)


class TiedLM(nn.Module):
    """An embedding shared with the output projection (GPT-2, T5, BART tie them): the backward sums the
    table's two gradients."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids):
        h = torch.tanh(self.norm(self.embed(ids)))
        return h @ self.embed.weight.t()


@pytest.mark.parametrize("device", DEVICES)
def test_tied_embedding_training(device):
    """The two gradients of the shared table: on the CPU the backward adds them into the first, which dies there
    (plan.cpp, point 5; a fresh table-sized result faults in every page); gradients as eager's on two steps."""
    from helpers import EMBER_GRAPHS

    torch.manual_seed(0)
    model = TiedLM(301, 24).to(device)
    compiled = compile_ember(copy.deepcopy(model))
    check(model, torch.randint(0, 301, (3, 11), device=device), compiled=compiled, **MATMUL_TOL)
    backward = [g for kind, g in EMBER_GRAPHS if kind == "backward"]
    assert backward
    if device == "cpu":
        assert "add.Tensor in place" in backward[0].describe(), backward[0].describe()
    check(model, torch.randint(0, 301, (3, 11), device=device), compiled=compiled, min_graphs=0, **MATMUL_TOL)


def _encoder_layer(device, dropout):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=dropout, batch_first=True,
                                      activation="gelu").to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_mask", [False, True], ids=["nomask", "padmask"])
def test_transformer_encoder_layer_train(device, padding_mask):
    # dropout=0 so that training mode can be compared with eager exactly (dropout: test_random.py)
    layer = _encoder_layer(device, dropout=0.0).train()
    x = torch.randn(3, 7, 32, device=device)
    if padding_mask:
        mask = torch.zeros(3, 7, dtype=torch.bool, device=device)
        mask[0, 5:] = True
        mask[2, 3:] = True
        fn = _WithMask(layer)
        check(fn, x, mask, **MODEL_TOL)
    else:
        check(layer, x, **MODEL_TOL)


class _WithMask(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, mask):
        return self.layer(x, src_key_padding_mask=mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_mask", [False, True], ids=["nomask", "padmask"])
def test_transformer_encoder_layer_eval(device, padding_mask):
    layer = _encoder_layer(device, dropout=0.1).eval()
    x = torch.randn(2, 6, 32, device=device)
    if padding_mask:
        mask = torch.zeros(2, 6, dtype=torch.bool, device=device)
        mask[1, 4:] = True
        check(_WithMask(layer), x, mask, **MODEL_TOL)
    else:
        check(layer, x, **MODEL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_encoder_layer_eval_no_grad(device):
    """Inference under no_grad, where eager may take the fused encoder-layer fast path."""
    layer = _encoder_layer(device, dropout=0.1).eval()
    x = torch.randn(2, 6, 32, device=device)
    mask = torch.zeros(2, 6, dtype=torch.bool, device=device)
    mask[1, 4:] = True
    with torch.no_grad():
        check(_WithMask(layer), x, mask, grad=False, **MODEL_TOL)
        check(layer, x, grad=False, **MODEL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_encoder_stack(device):
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True), num_layers=2,
        enable_nested_tensor=False).to(device)
    check(enc, torch.randn(2, 5, 32, device=device), **MODEL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_resnet18(device):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
    # Batch 8: with batch 2 the last BatchNorms normalize 8 values per channel and AOTAutograd's own
    # decompositions (aot_eager, inductor and ember alike) move conv1's gradient by 1.6e-2 of its
    # largest entry on an H200; at batch 8 all three agree with eager to ~5e-6 (bench/grad_sensitivity.py).
    x = torch.randn(8, 3, 64, 64, device=device)
    tol = dict(atol=1e-3, rtol=1e-3)
    model.eval()
    with torch.no_grad():
        check(model, x, grad=False, **tol)
    torch._dynamo.reset()
    model.train()  # batch norm in training mode: running stats compared by check()
    check(model, x, grad_atol=5e-3, grad_rtol=5e-3, **tol)


class Logits(nn.Module):
    """A Hugging Face causal LM's logits, without its KV cache."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_gpt2(device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).to(device).eval()
    ids = torch.randint(0, 101, (2, 9), device=device)
    check(Logits(model), ids, **MODEL_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_llama(device):
    """A LLaMA decoder (grouped-query attention, rotary embeddings), trained one step against eager; its forward
    graph keeps no neg or cat of the rotary embedding's rotate_half (passes/rotate_half.cpp)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).to(device)
    ids = torch.randint(0, 101, (2, 9), device=device)
    check(Logits(model), ids, **MODEL_TOL)
    forward = [what for kind, g in EMBER_GRAPHS if kind == "forward" for _, what in g.steps()]
    assert forward.count("aten::cat") == 1 and "aten::neg" not in forward, forward  # the cat: cos and sin's table
