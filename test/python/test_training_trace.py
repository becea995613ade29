"""Training graphs traced call by call without AOTAutograd (python_bindings/ember/joint.py): gradients against
eager's, which graphs take that path and which stay with AOTAutograd."""

import pytest
import torch
import torch.nn.functional as F

import ember
import ember._C
import ember.joint
from helpers import canonical_ir, check, record_returns


def _traces(monkeypatch):
    """What joint.trace_training returned, call by call: (forward, backward, spec or why not, pinned)."""
    return record_returns(monkeypatch, ember.joint, "trace_training")


class Block(torch.nn.Module):
    """A transformer-like layer: attention through views and transposes, a residual, layer norms, GELU."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.norm1 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.norm2 = torch.nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        scores = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        x = self.norm1(x + self.out((scores @ v).transpose(1, 2).reshape(b, t, d)))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


def test_repeated_layers_train_without_aot_autograd(monkeypatch):
    """A stack of identical layers (enough calls, few distinct) is traced call by call by default, and runs as
    one C++ autograd function; loss and every gradient (input and parameters) match eager's."""
    traces = _traces(monkeypatch)
    direct = record_returns(monkeypatch, ember.backend, "_joint_traced_call")
    model = torch.nn.Sequential(*[Block() for _ in range(8)])
    check(model, torch.randn(2, 5, 16), atol=1e-5, rtol=1e-4)
    assert [t[0] is not None for t in traces] == [True], [t[2] for t in traces]
    assert len(direct) == 1 and isinstance(direct[0], ember._C.DirectCall)


def test_repeated_layers_give_aot_autograds_graphs():
    """The forward and backward traced call by call are AOTAutograd's (same decompositions, default partition):
    the same IR text, saved tensors and gradients in the same order, for a stack of transformer-like layers."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from ember.decompositions import decomposition_table

    graphs = {}

    def both_ways(gm, example_inputs):
        forward, backward, _, _ = ember.joint.trace_training(gm, example_inputs, decomposition_table())
        graphs["call_by_call"] = (canonical_ir(forward), canonical_ir(backward))

        def keep(kind):
            def compiler(g, _):
                graphs.setdefault("aot_autograd", {})[kind] = canonical_ir(g)
                return make_boxed_func(g.forward)
            return compiler

        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return aot_module_simplified(gm, example_inputs, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                         decompositions=decomposition_table())

    model = torch.nn.Sequential(*[Block() for _ in range(6)])
    torch._dynamo.reset()
    torch.compile(lambda x: model(x).square().mean(), backend=both_ways, fullgraph=True)(torch.randn(2, 5, 16))
    aot = graphs["aot_autograd"]
    assert graphs["call_by_call"] == (aot["forward"], aot["backward"])


def _attention(x, w):
    b, t, d = x.shape
    q = (x @ w).view(b, t, 2, d // 2).transpose(1, 2)
    return (torch.softmax(q @ q.transpose(-1, -2), -1) @ q).transpose(1, 2).reshape(b, t, d).sum()


def _chunks(x, w):
    a, b, c = (x @ w).chunk(3, dim=-1)  # c gets no gradient: its backward part is traced without it
    return (a * torch.sigmoid(b)).sum() + c.detach().mean()


def _reused(x, w):
    y = torch.tanh(x @ w)
    z = y.contiguous()  # y is contiguous: the call returns its input
    return (z * y + y.exp()).mean()


def _integer_path(x, w):
    index = x.argmax(-1)  # needs no gradient
    picked = torch.gather(x, -1, index.unsqueeze(-1))
    return (picked * w.sum()).sum() + F.embedding(index, w).sum()


def _broadcast(x, w):
    return ((x * w[0].expand(x.shape)).relu() + w[1:2]).pow(2).sum()


def _casts(x, w):
    return (x.to(torch.float64) @ w.double()).float().logsumexp(-1).sum()


def _no_tensor_call(x, w):
    torch._C._log_api_usage_once("ember.test")  # a call Dynamo keeps, of no tensors (as transformers' models make)
    return torch.ones(6).add(x @ w).sum()


def _two_outputs(x, w):
    y = x @ w
    return y.square().mean(), (y > 0).float()  # the second output needs no gradient


@pytest.mark.parametrize("fn", [_attention, _chunks, _reused, _integer_path, _broadcast, _casts, _no_tensor_call, _two_outputs],
                         ids=lambda f: f.__name__.strip("_"))
def test_traced_call_by_call_matches_eager(monkeypatch, fn):
    """EMBER_TRACE_BY_NODE=1 traces any graph it can call by call: gradients laid out otherwise than the
    outputs (transposes), outputs that get no gradient, a call returning its input, integer values, expands,
    dtype casts, calls of no tensors, an output that needs no gradient. Everything against eager on random inputs."""
    monkeypatch.setattr(ember.config, "trace_by_node", True)
    traces = _traces(monkeypatch)
    x, w = torch.randn(3, 4, 6), torch.randn(6, 6)
    check(fn, x, w, atol=1e-5, rtol=1e-4)
    assert [t[0] is not None for t in traces] == [True], [t[2] for t in traces]


def test_traced_call_by_call_with_an_input_that_needs_no_gradient(monkeypatch):
    """Only the inputs that need a gradient get one; the others' are None, as AOTAutograd's."""
    monkeypatch.setattr(ember.config, "trace_by_node", True)
    traces = _traces(monkeypatch)
    check(lambda x, w, s: ((x @ w) * s).sin().sum(), torch.randn(4, 5), torch.randn(5, 3), torch.randn(3), grad=[1])
    assert [t[0] is not None for t in traces] == [True]
    assert traces[0][2]["no_edge"] == [False, False, False]


@pytest.mark.parametrize("case", ["in_place", "output_view"])
def test_training_graphs_that_need_aot_autograd(monkeypatch, case):
    """What AOTAutograd's wrapper or functionalization handles stays with it, and matches eager: an in-place
    call, an output that is a view."""
    monkeypatch.setattr(ember.config, "trace_by_node", True)
    traces = _traces(monkeypatch)

    def fn(x, w):
        y = x @ w
        if case == "in_place":
            y.mul_(2)
        if case == "output_view":
            return y.t()
        return y.sum()

    check(fn, torch.randn(4, 5), torch.randn(5, 3))
    why = {"in_place": "writes memory or global state", "output_view": "an output is a view"}[case]
    assert [t[0] for t in traces] == [None] and why in traces[0][2]


def test_graph_break_input_that_needs_a_gradient(monkeypatch):
    """A graph after a break takes an intermediate that needs a gradient (not a leaf): its gradient flows
    back through the first graph to the leaves."""
    monkeypatch.setattr(ember.config, "trace_by_node", True)
    traces = _traces(monkeypatch)

    def fn(x, w):
        y = torch.tanh(x @ w)
        torch._dynamo.graph_break()
        return (y * y.sum(0)).mean()

    check(fn, torch.randn(4, 5), torch.randn(5, 3), min_graphs=2)
    assert [t[0] is not None for t in traces] == [True, True]
