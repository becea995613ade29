"""Control flow in compiled graphs: torch.cond, while_loop, scan and map run as ember::cond / while_loop / scan steps
over subgraphs ember compiled itself (backend/runtime/control_flow.cpp), and regions marked with
torch.compiler.nested_compile_region are inlined (lower.py). Each test compares with eager on fresh random
inputs, and checks that ember compiled the graph (fallback="raise") with the control flow in its IR; packages
(ember.export) carry the subgraphs to ember.load."""

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import ember
import ember._C
from helpers import DEVICES, EMBER_GRAPHS, MATMUL_TOL, Wrap, check, compile_ember

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def ir_texts():
    return "\n".join(g.ir() for _, g in EMBER_GRAPHS)


def branches(x, w):
    return torch.cond(
        x.sum() > 0,
        lambda x, w: ((x @ w).relu() + 1, x.sin()),
        lambda x, w: (torch.tanh(x @ w.t()) * 2, x.cos() - x),
        (x, w),
    )


def around(x, w):
    a, b = branches(x * 1.5, w)
    return F.softmax(a, -1), b.sum(0)


@pytest.mark.parametrize("device", DEVICES)
def test_cond_takes_each_branch(device):
    w = torch.randn(24, 24, device=device)
    compiled = compile_ember(around)
    for sign in (1, -1, 1, -1):
        x = (torch.randn(17, 24, device=device).abs() + 0.1) * sign
        check(around, x, w, grad=False, compiled=compiled, min_graphs=0, **MATMUL_TOL)
    assert len(EMBER_GRAPHS) == 1, "both branches run in the one graph compiled at the first call"
    assert "ember::cond(" in ir_texts()


@pytest.mark.parametrize("device", DEVICES)
def test_cond_gradients(device):
    lin_a, lin_b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def fn(m, x):
        out = torch.cond(x.mean() > 0, lambda x: m.a(x).relu(), lambda x: m.b(x).sigmoid(), (x,))
        return out * x

    model = Wrap(fn, a=lin_a, b=lin_b).to(device)
    for sign in (1, -1):
        torch._dynamo.reset()
        x = (torch.randn(5, 16, device=device).abs() + 0.1) * sign
        check(model, x, **MATMUL_TOL)
        assert "ember::cond(" in ir_texts()


def test_cond_with_dynamic_shapes():
    def fn(x):
        return torch.cond(x[:, 0].sum() > 0, lambda t: t.exp(), lambda t: (t * t).sum(-1, keepdim=True) + t, (x,))

    compiled = compile_ember(fn, dynamic=True)
    for rows in (5, 9, 3, 12):
        check(fn, torch.randn(rows, 7), grad=False, compiled=compiled, min_graphs=0)
    assert len(EMBER_GRAPHS) == 1
    assert "ember::cond(" in ir_texts()


@pytest.mark.parametrize("device", DEVICES)
def test_while_loop(device):
    def fn(n, x, w):
        i, y = while_loop(lambda i, y: i < n, lambda i, y: (i + 1, torch.tanh(y @ w) + y * 0.5), (torch.zeros_like(n), x))
        return i, y * 2

    compiled = compile_ember(fn)
    w = torch.randn(8, 8, device=device) * 0.3
    for steps in (3, 0, 6):
        n = torch.tensor(steps, device=device)
        check(fn, n, torch.randn(4, 8, device=device), w, grad=False, compiled=compiled, min_graphs=0, **MATMUL_TOL)
    assert "ember::while_loop(" in ir_texts()


@pytest.mark.parametrize("device", DEVICES)
def test_scan_with_carry_and_outputs(device):
    def step(h, x, w):
        h = torch.tanh(x + h @ w)
        return h, h.sum(-1)

    def fn(xs, h0, w):
        h, ys = scan(lambda h, x: step(h, x, w), h0, xs)
        return h, ys

    xs, h0 = torch.randn(9, 3, 6, device=device), torch.randn(3, 6, device=device)
    w = torch.randn(6, 6, device=device) * 0.5
    check(fn, xs, h0, w, **MATMUL_TOL)
    assert "ember::scan(" in ir_texts()


@pytest.mark.parametrize("device", DEVICES)
def test_map_over_the_leading_dim(device):
    from torch._higher_order_ops.map import map as map_rows

    def fn(xs, w):
        return map_rows(lambda row, w: F.softmax(row @ w, -1), xs, w) + 1

    check(fn, torch.randn(5, 3, 8, device=device), torch.randn(8, 8, device=device), **MATMUL_TOL)
    assert "ember::scan(" in ir_texts()


@pytest.mark.parametrize("device", DEVICES)
def test_nested_compile_region_is_inlined(device):
    @torch.compiler.nested_compile_region
    def block(x, w, b):
        return F.layer_norm(F.gelu(x @ w + b) + x, x.shape[-1:])

    def fn(x, w, b):
        for _ in range(4):
            x = block(x, w, b)
        return x

    x = torch.randn(6, 32, device=device)
    check(fn, x, torch.randn(32, 32, device=device) * 0.2, torch.randn(32, device=device), **MATMUL_TOL)
    text = ir_texts()
    assert "invoke_subgraph" not in text and "ember::" not in text.replace("ember::linear_chain", "")
    assert text.count("aten::gelu") + text.count("aten::erf") + text.count("aten::tanh") >= 4


@CUDA
def test_cond_in_reduce_overhead_runs_between_captured_parts():
    w = torch.randn(24, 24, device="cuda")
    compiled = compile_ember(around, options={"cudagraphs": True})  # what mode="reduce-overhead" turns on
    for sign in (1, -1, 1, 1, -1):
        x = (torch.randn(17, 24, device="cuda").abs() + 0.1) * sign
        check(around, x, w, grad=False, compiled=compiled, min_graphs=0, **MATMUL_TOL)
    report = "\n".join(g.cuda_graph_report() for _, g in EMBER_GRAPHS)
    assert "control flow (cond)" in report and "captured" in report


def test_graph_naming_missing_subgraph_is_a_clear_error():
    text = ("graph(%p: b8[]{}@cpu, %x: f32[3]{1}@cpu):\n"
            "  %y: f32[3]{1}@cpu = ember::cond(%p, \"t\", \"f\", [%x])\n"
            "  return (%y)\n")
    assert ember._C.roundtrip(text) == text
    with pytest.raises(ember.EmberError, match="subgraphs"):
        ember._C.compile(text, {}, [], "", "g")


class Gate(torch.nn.Module):
    """torch.cond between two linear paths, one holding a while_loop of its own: nested subgraphs in a package."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 12), torch.nn.Linear(12, 12)
        self.register_buffer("scale", torch.randn(12))

    def forward(self, x):
        def yes(x):
            return torch.relu(self.a(x)) * self.scale

        def no(x):
            _, y = while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, torch.tanh(self.b(y))), (x.new_zeros((), dtype=torch.int64), x))
            return y

        return torch.cond(x.sum() > 0, yes, no, (x,)) + 1


@pytest.mark.parametrize("device", DEVICES)
def test_export_and_load_run_both_branches(tmp_path, device):
    model = Gate().eval().to(device)
    path = tmp_path / "gate.ember"
    ember.export(model, (torch.randn(5, 12, device=device).abs(),), path, device=device)
    loaded = ember.load(path, device)
    for sign in (1, -1, 1):
        x = (torch.randn(5, 12, device=device).abs() + 0.1) * sign
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(loaded.run([x])[0], expected, **MATMUL_TOL)
