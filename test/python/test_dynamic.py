"""Dynamic shapes (one compiled function over several batch sizes, forward and backward) and graph
breaks (print and .item() in the middle of a function)."""

import copy
import math

import pytest
import torch

import ember
import torch.nn as nn
import torch.nn.functional as F

from helpers import DEVICES, EMBER_GRAPHS, MATMUL_TOL, check, compile_ember

BATCHES = [3, 7, 16]


def kinds():
    return sorted(kind for kind, _ in EMBER_GRAPHS)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_pointwise_and_reductions(device):
    def fn(x, y):
        z = torch.relu(x * y + 1)
        return z.sum(0), z.mean(-1, keepdim=True) / x.shape[0], z.reshape(x.shape[0] * 2, -1)

    compiled = compile_ember(fn, dynamic=True)
    for i, b in enumerate(BATCHES):
        check(fn, torch.randn(b, 6, device=device), torch.randn(b, 6, device=device), compiled=compiled,
              min_graphs=0 if i else 1)
    # one forward and one backward graph serve every batch size
    assert kinds() == ["backward", "forward"], kinds()


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_square_dims_fuse(device):
    """[s0, s1, s2, s2]'s strides print with a power (s1*s2**2): still contiguous, so the pointwise chain over
    it, with per-channel and per-column inputs, is one fused kernel for every size."""

    def fn(x, w, bias, s):
        return (x * w + bias) * s - x.exp()

    compiled = compile_ember(fn, dynamic=True)
    for i, (n, c, hw) in enumerate([(3, 7, 5), (2, 4, 6), (5, 3, 9)]):
        x = torch.randn(n, c, hw, hw, device=device)
        w, bias, s = torch.randn(c, 1, 1, device=device), torch.randn(hw, device=device), torch.randn((), device=device)
        check(fn, x, w, bias, s, compiled=compiled, min_graphs=0 if i else 1)
    described = "".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "fused group" in described and "aten::exp" not in described, described


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_mlp(device):
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 5)).to(device)
    compiled = compile_ember(copy.deepcopy(model), dynamic=True)
    for i, b in enumerate(BATCHES):
        check(model, torch.randn(b, 12, device=device), compiled=compiled, min_graphs=0 if i else 1, **MATMUL_TOL)
    assert kinds() == ["backward", "forward"], kinds()


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_softmax_attention_over_sequence_length(device):
    def fn(q, k, v):
        att = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return att.softmax(-1) @ v, F.scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = compile_ember(fn, dynamic=True)
    for i, s in enumerate([5, 9, 16]):
        q, k, v = (torch.randn(2, s, 8, device=device) for _ in range(3))
        check(fn, q, k, v, compiled=compiled, min_graphs=0 if i else 1, **MATMUL_TOL)
    assert len(EMBER_GRAPHS) <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_automatic_dynamic_recompiles_at_most_once(device):
    """Default dynamic=None: the first shape compiles static, the second recompiles dynamic, the third
    reuses the dynamic graph."""

    def fn(x):
        return (x.sin() * x.shape[0]).sum(-1)

    compiled = compile_ember(fn)
    for b in BATCHES:
        check(fn, torch.randn(b, 4, device=device), compiled=compiled, min_graphs=0)
    forwards = [k for k in kinds() if k == "forward"]
    assert 1 <= len(forwards) <= 2, kinds()


class _Block(nn.Module):
    """An attention block whose views take the symbolic sequence length (view(b, s, heads, -1))."""

    def __init__(self, dim=32, heads=4, in_place=False):
        super().__init__()
        self.heads, self.in_place = heads, in_place
        self.norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)).softmax(-1) @ v
        y = self.proj(att.transpose(1, 2).reshape(b, s, d))
        if self.in_place:
            y.mul_(0.5)  # a write to an intermediate: functionalization's work, which this graph gets from AOTAutograd
        return x + y, y.sum(-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_place", [False, True], ids=["plain", "in_place"])
def test_symbolic_inference_graphs_compile_once_for_every_size(device, in_place):
    """Under no_grad a graph with a symbolic length is traced without AOTAutograd (trace.py) unless it writes
    an intermediate in place; either way one compile serves every length, each matching eager."""
    from torch._dynamo.utils import counters

    model = _Block(in_place=in_place).to(device).eval()
    compiled = compile_ember(copy.deepcopy(model), dynamic=True)
    counters.clear()
    with torch.no_grad():
        for s in (5, 11, 16, 1 + 2 * 3 * 5):
            check(model, torch.randn(2, s, 32, device=device), grad=False, compiled=compiled, min_graphs=0, **MATMUL_TOL)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["aot_autograd"]["ok"] == (1 if in_place else 0), dict(counters["aot_autograd"])


@pytest.mark.parametrize("device", DEVICES)
def test_symbolic_outputs_reach_the_next_graph_as_dynamic(device):
    """The symbolic dims of a traced graph's outputs are marked as AOTAutograd's wrapper marks them: the graph
    after a break takes them as dynamic at its first compile and does not recompile for the next length."""
    from torch._dynamo.utils import counters

    def fn(x):
        y = (x * 2).relu()
        torch._dynamo.graph_break()
        return y.cumsum(1) + 1

    compiled = compile_ember(fn)
    counters.clear()
    with torch.no_grad():
        for s in (4, 7, 9, 12):
            x = torch.randn(3, s, device=device)
            torch._dynamo.mark_dynamic(x, 1)  # the first graph symbolic from its first compile
            torch.testing.assert_close(compiled(x), fn(x))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # unmarked, the second would recompile
    assert counters["aot_autograd"]["total"] == 0, dict(counters["aot_autograd"])


class CachedDecoder(nn.Module):
    """One attention block with a KV cache, as Hugging Face's causal LMs run it: positions from the cache's
    length (`sum` over SymInts is torch.sym_sum in Dynamo's graph), keys and values concatenated to the cache."""

    def __init__(self, vocab=40, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(64, dim)
        self.norm, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, past_k=None, past_v=None, mask=None):
        start = 0 if past_k is None else past_k.shape[2]
        pos = torch.arange(start, sum([start, ids.shape[1]]), device=ids.device)
        x = self.emb(ids) + self.pos(pos)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if past_k is not None:
            k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past_k is None)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return self.head(x)[:, -1], k, v


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_greedy_decoding(device):
    """A prompt, then one token per call against a cache one position longer each time, under a mask: the
    second step recompiles with a symbolic length and every later step reuses that graph (on CUDA ember's
    attention routing once guarded on the length being a multiple of 16: one more graph there). Each step's
    logits and cache against eager's, the tokens fed back being eager's."""
    torch.manual_seed(0)
    model = CachedDecoder().to(device).eval()
    compiled = compile_ember(copy.deepcopy(model))
    ids = torch.randint(0, 40, (2, 5), device=device)
    with torch.no_grad():
        expected, got = model(ids), compiled(ids)
        for step in range(14):  # cache lengths 6 to 19: past a multiple of 16
            for e, c in zip(expected, got):
                torch.testing.assert_close(c, e, **MATMUL_TOL, msg=lambda m: f"step {step}: {m}")
            token = expected[0].argmax(-1, keepdim=True)
            # a padding-style mask over the cache, the new position always kept
            mask = torch.rand(2, 1, 1, expected[1].shape[2] + 1, device=device) > 0.2
            mask[..., -1] = True
            expected = model(token, expected[1], expected[2], mask)
            got = compiled(token, got[1], got[2], mask)
    # the prompt, maybe one static step, then the dynamic one: no recompile where the length reaches 16
    assert 2 <= len(EMBER_GRAPHS) <= 3, kinds()


class StaticCacheDecoder(CachedDecoder):
    """CachedDecoder over fixed-size key and value buffers written in place at positions held in a tensor,
    the counter advanced in place (transformers' StaticCache): every decode step has the same shapes."""

    def forward(self, ids, cache_k, cache_v, length):
        pos = torch.arange(ids.shape[1], device=ids.device) + length
        length.add_(ids.shape[1])
        x = self.emb(ids) + self.pos(pos)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        cache_k.index_copy_(2, pos, k)
        cache_v.index_copy_(2, pos, v)
        mask = torch.arange(cache_k.shape[2], device=ids.device)[None, :] <= pos[:, None]  # written positions, causal
        att = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)
        return self.head(x + self.proj(att.transpose(1, 2).reshape(b, s, d)))[:, -1]


@pytest.mark.parametrize("mode", [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cuda-graphs", id="cuda-reduce-overhead",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_static_cache_decoding_writes_the_buffers_in_place(mode):
    """Prompt and decode steps against buffers the compiled graph writes in place (index_copy_ at positions
    read from a counter tensor it also advances): each step's logits, both buffers and the counter against
    eager's own; two graphs in all (the prompt's shape, the steps' shape). Under reduce-overhead the buffers
    are marked static, as transformers marks them."""
    device = "cuda" if mode.startswith("cuda") else "cpu"
    torch.manual_seed(0)
    model = StaticCacheDecoder().to(device).eval()
    compiled = compile_ember(copy.deepcopy(model), options={"cudagraphs": True} if mode == "cuda-graphs" else None)

    def fresh():
        buffers = [torch.zeros(2, 4, 24, 8, device=device) for _ in range(2)]
        if mode == "cuda-graphs":
            for t in buffers:
                torch._dynamo.mark_static_address(t)
        return buffers + [torch.zeros((), dtype=torch.long, device=device)]

    ids = torch.randint(0, 40, (2, 5), device=device)
    mine, theirs = fresh(), fresh()
    with torch.no_grad():
        expected, got = model(ids, *mine), compiled(ids, *theirs)
        for step in range(12):
            torch.testing.assert_close(got, expected, **MATMUL_TOL, msg=lambda m: f"step {step}: {m}")
            for e, c in zip(mine, theirs):
                torch.testing.assert_close(c, e, **MATMUL_TOL, msg=lambda m: f"buffers after step {step}: {m}")
            token = expected.argmax(-1, keepdim=True)
            expected, got = model(token, *mine), compiled(token, *theirs)
    assert len(EMBER_GRAPHS) == 2, kinds()


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_view_and_cat_with_symbolic_sizes(device):
    def fn(x):
        n = x.shape[0]
        half = x[: n // 2]
        return torch.cat([half, x.flip(0)], 0).view(-1, 2), x.new_zeros(n + 1).sum()

    compiled = compile_ember(fn, dynamic=True)
    for i, b in enumerate(BATCHES):
        check(fn, torch.randn(b, 4, device=device), compiled=compiled, min_graphs=0 if i else 1)


@pytest.mark.parametrize("device", DEVICES)
def test_symbolic_views_are_built_without_the_dispatcher_and_match_eager(device):
    """Views whose sizes are symbols (view with -1, permute and unsqueeze with negative dims, expand with -1
    and new dims, slices with negative, clamped and stepped bounds, select, transpose, squeeze) take the plan's
    symbolic-view fast path; their geometry, read by the ops after them and returned, is eager's at every size."""

    def fn(x):
        n = x.shape[0]
        y = x * 2
        views = (
            y.view(n, -1),
            y.permute(2, 0, -2),
            y.unsqueeze(-1),
            y.unsqueeze(0),
            y[:, :, None].expand(-1, -1, 3, -1),
            y.expand(2, -1, -1, -1),
            y[1:-1:2],
            y[-(n // 2):],
            y[: n + 5],
            y[:, 1:],
            y.select(2, -1),
            y.select(0, n - 1),
            y.transpose(0, 2),
            y[:, :1].squeeze(1),
            y.squeeze(0),
        )
        return views + tuple((v + 1).sum() for v in views)

    compiled = compile_ember(fn, dynamic=True)
    for i, b in enumerate([3, 4, 7]):
        x = torch.randn(b, 6, 5, device=device)
        expected, got = fn(x), compiled(x)
        for e, g in zip(expected, got):
            assert e.shape == g.shape and e.stride() == g.stride(), (e.shape, g.shape, e.stride(), g.stride())
            torch.testing.assert_close(g, e)
    described = "".join(g.describe() for _, g in EMBER_GRAPHS)
    assert "symbolic view" in described, described


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_symbolic_floats_and_sizes_in_tensor_arguments(device):
    """SymInt / SymFloat values (not literals) feeding Tensor and Scalar arguments."""

    def fn(x):
        n = x.shape[0]
        return x * (n / 3), torch.full((n,), n * 0.5, device=x.device), x.sum(0) / n, x + n

    compiled = compile_ember(fn, dynamic=True)
    for i, b in enumerate(BATCHES):
        check(fn, torch.randn(b, 3, device=device), compiled=compiled, min_graphs=0 if i else 1)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_true_module_floats_stay_in_the_fused_kernel(device):
    """Under dynamic=True Dynamo passes a module's floats (an RMSNorm's eps, a scaling) as 0-dim tensors the graph
    reads with _local_scalar_dense where it uses them: the norm after a matmul is still one fused kernel, the
    floats its runtime scalars, and a new eps reaches it without a recompile being wrong."""

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.weight = nn.Linear(32, 32), nn.Parameter(torch.randn(32))
            self.eps, self.scale = 1e-6, 0.7

        def forward(self, x):
            h = self.proj(x)
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight * self.scale

    model = Norm().to(device)
    copied = copy.deepcopy(model)
    compiled = compile_ember(copied, dynamic=True)
    with torch.no_grad():
        for b in BATCHES:
            x = torch.randn(b, 32, device=device)
            torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
        for m in (model, copied):
            m.eps, m.scale = 1e-2, 1.3
        x = torch.randn(5, 32, device=device)
        torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
    described = "".join(g.describe() for _, g in EMBER_GRAPHS)
    assert described.count("fused group") == 1 and "aten::mul" not in described, described


@pytest.mark.parametrize("device", DEVICES)
def test_symbolic_batch_convolutions_fold_their_batch_norms(device):
    """Eval-mode conv -> batch norm -> ReLU blocks over a symbolic batch fold each batch norm into its convolution
    as the static compile does (passes/fold_batchnorm.cpp): one past a clone that canonicalize bypasses, one past a
    channels_last clone of a channels_last result (layout.py makes the convolutions channels_last). On CUDA the batch
    norms are traced as their op (layout.direct_eval_batch_norms), without the clone cuDNN's route adds."""

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Sequential(*block(3, 8)), nn.Sequential(*block(8, 16)), nn.Sequential(*block(16, 16))

        def forward(self, x):
            y = self.a(x)
            conv, bn, relu = self.b
            y = relu(bn(conv(y).clone()))
            conv, bn, relu = self.c
            return relu(bn(conv(y).clone(memory_format=torch.channels_last))).mean((-1, -2))

    model = Net().to(device).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    compiled = compile_ember(copy.deepcopy(model))
    with torch.no_grad():
        for b in (1, 3, 5, 7):
            x = torch.randn(b, 3, 16, 12, device=device)
            torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
    symbolic = EMBER_GRAPHS[-1][1]
    steps = [what for _, what in symbolic.steps()]
    assert steps.count("fold_batchnorm") == 3 and not any("batch_norm" in what for what in steps), steps


def test_symbolic_eval_batch_norm_traced_as_its_op():
    """layout.direct_eval_batch_norms (forced onto CPU tensors here; it applies to CUDA ones): an eval batch norm
    over a symbolic batch becomes _native_batch_norm_legit_no_training with the same arguments, and one over static
    sizes stays as Dynamo traced it; both compute what eager does."""
    from ember.layout import direct_eval_batch_norms

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)).eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            for t, (lo, hi) in ((m.running_mean, (-1, 1)), (m.running_var, (0.5, 2)), (m.weight, (0.5, 2)),
                                (m.bias, (-1, 1))):
                t.data.uniform_(lo, hi)
    rewrites = []

    def backend(gm, example_inputs):
        rewrites.append(direct_eval_batch_norms(gm, force=True))
        return gm

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for b in (2, 3, 5):
            x = torch.randn(b, 3, 9, 7)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert rewrites == [0, 2], rewrites


@pytest.mark.parametrize("device", DEVICES)
def test_captured_item_unbacked_symbol(device):
    def fn(x):
        k = x.abs().sum().item()
        return x * k + x.mean()

    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = compile_ember(fn, fullgraph=True)
        check(fn, torch.randn(4, 3, device=device), compiled=compiled)


@pytest.mark.parametrize("device", DEVICES)
def test_captured_dynamic_output_shape_ops(device):
    def fn(x):
        return x[x > 0].sum(), x.nonzero(), torch.masked_select(x, x < 0).exp()

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = compile_ember(fn, fullgraph=True)
        check(fn, torch.randn(5, 4, device=device), compiled=compiled)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["ceil", "floor", "int", "round"])
def test_dynamic_python_math_on_sizes(device, op):
    ops = {"ceil": lambda n: math.ceil(n / 4), "floor": lambda n: math.floor(n / 4), "int": lambda n: int(n / 4),
           "round": lambda n: round(n / 4)}

    def fn(x):
        k = ops[op](x.shape[0])
        return x * k, x[:k].sum(0)

    compiled = compile_ember(fn, dynamic=True)
    for i, b in enumerate(BATCHES):
        check(fn, torch.randn(b, 3, device=device), compiled=compiled, min_graphs=0 if i else 1)


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_python_math_supported(device):
    """The SymInt / SymFloat arithmetic ember's prim ops do cover."""

    def fn(x):
        n = x.shape[0]
        return x * math.sqrt(n), x * max(n, 5), x * (n % 4), x * float(n) / (n ** 0.5), x * abs(-n) * (n // 2)

    compiled = compile_ember(fn, dynamic=True)
    for i, b in enumerate(BATCHES):
        check(fn, torch.randn(b, 3, device=device), compiled=compiled, min_graphs=0 if i else 1)


@pytest.mark.parametrize("device", DEVICES)
def test_unsupported_graph_falls_back_to_eager_with_one_warning(device):
    """A graph ember cannot lower (a dtype its IR has no name for: float8_e4m3fnuz) runs eagerly, with a
    warning that names the node, and gives eager's results; fallback="raise" raises EmberError instead."""
    def fn(x):
        return (x * 2).to(torch.float8_e4m3fnuz).to(torch.float32) + 1

    compiled = torch.compile(fn, backend="ember")
    for _ in range(2):
        x = torch.randn(4, 8, device=device)
        with pytest.warns(UserWarning, match="ember could not compile"):
            out = compiled(x)
        torch.testing.assert_close(out, fn(x))
        torch._dynamo.reset()
    with pytest.raises(Exception) as info:  # Dynamo wraps it in BackendCompilerFailed
        compile_ember(fn)(x)
    cause = info.value
    while cause is not None and not isinstance(cause, ember.EmberError):
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    assert isinstance(cause, ember.EmberError) and "node _to_copy" in str(cause), info.value


# ---------------------------------------------------------------------------------------------------
# graph breaks
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_graph_break_print(device, capsys):
    def fn(x, y):
        a = torch.sin(x) * y
        print("ember graph break", a.shape)
        return (a + 1).relu() @ y.t()

    check(fn, torch.randn(4, 5, device=device), torch.randn(4, 5, device=device), min_graphs=2, **MATMUL_TOL)
    assert "ember graph break" in capsys.readouterr().out


@pytest.mark.parametrize("device", DEVICES)
def test_graph_break_item(device):
    def fn(x):
        s = x.abs().sum()
        k = s.item()  # a graph break with default dynamo config
        y = x * k if k > 1.0 else x - k
        return y.softmax(-1), k

    check(fn, torch.randn(3, 6, device=device), min_graphs=2)


@pytest.mark.parametrize("device", DEVICES)
def test_data_dependent_python_branch(device):
    def fn(x):
        if x.sum() > 0:  # graph break on a tensor condition
            return x.exp()
        return x.cos()

    compiled = compile_ember(fn)
    check(fn, torch.ones(3, device=device), compiled=compiled)
    check(fn, -torch.ones(3, device=device), compiled=compiled, min_graphs=0)
