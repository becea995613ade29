"""ember's IR text: real AOTAutograd graphs (captured with ember's own decomposition table) lower to IR
that parses, prints back canonically (roundtrip is idempotent), and compiles to a plan that computes
what the FX graph computes on the real inputs it was called with."""

import contextlib
import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import ember
import ember._C as C
from ember.decompositions import decomposition_table
from ember.lower import lower
from helpers import DEVICES, assert_same, clone_input


def capture(fn, *inputs, dynamic=False, backward=True):
    """Runs fn through torch.compile with a backend that only records the AOTAutograd graphs (ember's
    decompositions, ember's AOT settings) and the real arguments of their first call."""
    graphs = []

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            entry = {"kind": kind, "gm": gm, "args": None}
            graphs.append(entry)
            run_gm = make_boxed_func(gm.forward)

            def run(args):
                if entry["args"] is None:
                    entry["args"] = [clone_input(a) for a in args]
                return run_gm(args)

            run._boxed_call = True
            return run

        return compile_graph

    backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                           inference_compiler=compiler("inference"), decompositions=decomposition_table(),
                           keep_inference_input_mutations=True)
    out = torch.compile(fn, backend=backend, dynamic=dynamic)(*inputs)
    if backward:
        torch.autograd.backward([o for o in out if o.requires_grad] if isinstance(out, tuple) else out.sum())
    return graphs


def check_graph(entry):
    gm, args = entry["gm"], entry["args"]
    ir, constants = lower(gm)
    canonical = C.roundtrip(ir)
    assert C.roundtrip(canonical) == canonical, "roundtrip is not idempotent"
    assert canonical.startswith("graph(")
    # The plan computes what the FX graph computes (on copies: graphs may mutate their inputs).
    compiled = C.compile(ir, constants, [], "", "ir_test_" + entry["kind"])
    assert args is not None, "the graph was never called"
    expected = gm(*[clone_input(a) for a in args])
    actual = compiled([clone_input(a) for a in args])
    assert_same(tuple(actual), tuple(expected), atol=1e-5, rtol=1e-4, what=f"{entry['kind']} graph output")
    return canonical


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(y.mean((2, 3))).log_softmax(-1)


def _models():
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)), (torch.randn(3, 8),)),
        "convnet": (SmallConvNet(), (torch.randn(2, 3, 8, 8),)),
        "encoder_layer": (nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                          (torch.randn(2, 5, 16),)),
        "embedding_ce": (lambda idx, w, t: F.cross_entropy(F.embedding(idx, w) @ w.t(), t),
                         (torch.randint(0, 10, (6,)), torch.randn(10, 4, requires_grad=True), torch.randint(0, 10, (6,)))),
    }


@pytest.mark.parametrize("name", ["mlp", "convnet", "encoder_layer", "embedding_ce"])
def test_model_graphs_roundtrip_and_run(name):
    fn, inputs = _models()[name]
    inputs = tuple(x.requires_grad_() if x.dtype.is_floating_point else x for x in inputs)
    graphs = capture(fn, *inputs)
    kinds = sorted(g["kind"] for g in graphs)
    assert kinds == ["backward", "forward"], kinds
    for g in graphs:
        check_graph(g)


def test_inference_graph_with_literals_of_every_kind():
    """None, bools, ints, negative and special floats, strings, dtypes, devices, memory formats, lists."""

    def fn(x, i, m):
        a = x.masked_fill(m, float("-inf")).softmax(-1)
        b = torch.div(i, 3, rounding_mode="floor")
        c = torch.zeros(2, 3, dtype=torch.float16, device=x.device) + 1e-8
        d = x.to(memory_format=torch.contiguous_format).clamp(min=-0.5, max=float("inf"))
        e = torch.nan_to_num(x / 0.0, nan=0.0, posinf=1e30)
        f = x.sum(dim=[0, 1], keepdim=True) + torch.full((1, 1), -2.5)
        return a, b, c, d, e, f, x.new_ones(3, dtype=torch.bool)

    m = torch.rand(4, 5) > 0.5
    m[:, 0] = False
    graphs = capture(fn, torch.randn(4, 5), torch.randint(-9, 9, (4, 5)), m, backward=False)
    assert [g["kind"] for g in graphs] == ["inference"]
    text = check_graph(graphs[0])
    for piece in ("-inf", "f16", '"floor"', "None" if "None" in text else "", "true"):
        assert piece in text, (piece, text)


def test_graph_with_input_mutation():
    def fn(buf, x):
        buf.add_(x)
        return buf * 2

    graphs = capture(fn, torch.zeros(5), torch.randn(5), backward=False)
    text = check_graph(graphs[0])
    assert "copy_" in text or "add_" in text, text


def test_dynamic_graph_roundtrip_and_run():
    def fn(x, y):
        return (x.view(x.shape[0] * 2, -1) * 2).sum(0) + y[: x.shape[1] // 2].sum()

    torch._dynamo.reset()
    x, y = torch.randn(6, 8, requires_grad=True), torch.randn(10, requires_grad=True)
    graphs = capture(fn, x, y, dynamic=True)
    assert graphs
    for g in graphs:
        text = check_graph(g)
        if g["kind"] == "forward":
            assert re.search(r"\[s\d+, s\d+\]", text), "symbolic sizes must appear in the types: " + text
            assert "prim::" in text, "SymInt arithmetic must be prim ops: " + text


def test_multi_output_ops_and_getitem():
    def fn(x):
        vals, idx = x.max(-1)
        mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)[1:]
        return vals * 2, idx, mean + rstd

    graphs = capture(fn, torch.randn(3, 7), backward=False)
    check_graph(graphs[0])


def test_handwritten_ir_roundtrip():
    text = (
        "graph(%x: f32[2, 3]{3, 1}@cpu, %n: int):\n"
        "  %y: f32[2, 3]{3, 1}@cpu = aten::mul.Tensor(%x, 2)\n"
        "  %m: f32[2, 3]{3, 1}@cpu = aten::clamp(%y, min=-1.5, max=None)\n"
        "  %s: f32[3]{1}@cpu = aten::sum.dim_IntList(%m, [0], false)\n"
        "  %k: int = prim::mul(%n, 3)\n"
        "  return (%s, %k, None)\n"
    )
    canonical = C.roundtrip(text)
    assert C.roundtrip(canonical) == canonical
    g = C.compile(text, {}, [], "", "handwritten")
    x = torch.randn(2, 3)
    s, k, none = g([x, 4])
    torch.testing.assert_close(s, (x * 2).clamp(min=-1.5).sum(0))
    assert k == 12 and none is None


@pytest.mark.parametrize(
    "bad",
    [
        "graph(%x: f32[2]{1}@cpu):\n  return (%y)\n",  # undefined value
        "graph(%x: f32[2]{1}@cpu):\n  %y: f32[2]{1}@cpu = aten::not_an_op(%x)\n  return (%y)\n",
        "graph(%x: f32[2]{1}@cpu:\n  return (%x)\n",  # syntax
        "graph(%x: f32[2]{1}@cpu):\n  %x: f32[2]{1}@cpu = aten::neg(%x)\n  return (%x)\n",  # redefinition
    ],
    ids=["undefined", "unknown_op", "syntax", "redefined"],
)
def test_bad_ir_raises_ember_error(bad):
    with pytest.raises(ember.EmberError):
        C.compile(bad, {}, [], "", "bad")


class _ManyOps(nn.Module):
    """Ops whose decompositions differ in kind: CompositeImplicitAutograd ones (linear, layer_norm, upsampling
    by scale, pooling, dropout), core decompositions (softplus, hardsigmoid, addcmul, roll, lerp, tril), and
    ops ember keeps whole."""

    def __init__(self):
        super().__init__()
        self.emb, self.conv, self.bn = nn.Embedding(50, 8), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.ln, self.fc, self.gn = nn.LayerNorm(8), nn.Linear(8, 5), nn.GroupNorm(2, 8)

    def forward(self, ids, target):
        x = self.emb(ids).permute(0, 3, 1, 2)
        x = F.relu(self.bn(self.conv(x)), inplace=True)
        x = F.interpolate(x, scale_factor=2, mode="nearest") + F.interpolate(x, scale_factor=2, mode="bilinear")
        x = F.dropout(self.gn(F.max_pool2d(x, 2)), 0.1, self.training)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        x = F.silu(self.ln(x)) + F.hardswish(x) + torch.logsumexp(x, -1, keepdim=True) + x.var(-1, keepdim=True)
        # core decompositions proper
        x = torch.addcmul(F.softplus(x), F.hardsigmoid(x), x.roll(1, -1), value=0.5) + torch.lerp(x, x.tril(), 0.25)
        return F.cross_entropy(self.fc(F.gelu(x)), target) + F.mse_loss(x, x.detach() * 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_compile_table_traces_as_the_whole_core_table(training, device):
    """decomposition_table() leaves out torch's CompositeImplicitAutograd entries (they only call the op's own
    decomposition, which tracing below autograd runs anyway; building them took ~180 ms per process): the
    graphs AOTAutograd traces with it are the ones the whole core table gives, forward and backward."""
    eager_backward = hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")  # a torch that has it
    model = _ManyOps().train(training).to(device)
    ids, target = torch.randint(0, 50, (2, 6, 6), device=device), torch.randint(0, 5, (2,), device=device)
    traced = {}

    def backend(gm, example_inputs):
        for label, table in (("compile", decomposition_table()), ("whole", decomposition_table(for_export=True))):
            codes = traced.setdefault(label, [])

            def keep(g, _):
                codes.append(re.sub(r"_tensor_constant\d+", "c", g.code))
                return make_boxed_func(g.forward)

            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True) if eager_backward else contextlib.nullcontext():
                aot_autograd(fw_compiler=keep, bw_compiler=keep, inference_compiler=keep, decompositions=table,
                             keep_inference_input_mutations=True)(copy.deepcopy(gm), example_inputs)
        return gm.forward

    with torch.set_grad_enabled(training):
        torch.compile(model, backend=backend)(ids, target)
    assert len(decomposition_table()) < len(decomposition_table(for_export=True))
    assert len(traced["compile"]) == (2 if training and eager_backward else 1)
    assert traced["compile"] == traced["whole"]
