"""Training graphs as one C++ autograd function (python_bindings/training_graph.h): the forward's DirectCall
wires its outputs to an EmberBackward node in place of AOTAutograd's Python autograd.Function. Each test
compares values and gradients with eager on fresh random inputs, and checks that autograd's contracts hold
(saved tensors changed in place, backward twice, retain_graph, create_graph, missing gradients, gradients
in another layout)."""

import pytest
import torch
import torch.nn.functional as F

import ember
import ember._C
import ember.backend
from helpers import record_returns

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def training_calls(monkeypatch):
    """What ember.backend._training_call returned for each training graph compiled in the test."""
    return record_returns(monkeypatch, ember.backend, "_training_call")


def compiled(fn):
    return torch.compile(fn, backend="ember", options={"fallback": "raise"})


def leaf(*shape, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()


def grads_of(fn, inputs, loss=lambda outs: outs[0].sum()):
    """(outputs detached, gradients of `loss` for each input that requires grad) of one call."""
    for x in inputs:
        x.grad = None
    outs = fn(*inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    loss(outs).backward()
    return [o.detach().clone() for o in outs], [x.grad.clone() if x.grad is not None else None for x in inputs]


def assert_grads_match(fn, inputs, loss=lambda outs: outs[0].sum(), rtol=1e-5, atol=1e-5):
    step = compiled(fn)
    outs = step(*inputs)
    assert (outs[0] if isinstance(outs, (tuple, list)) else outs).grad_fn.name() == "EmberBackward"
    got = grads_of(step, inputs, loss)
    want = grads_of(fn, inputs, loss)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trace", ["call_by_call", "aot_autograd"])
def test_training_step_runs_as_one_cpp_function(monkeypatch, device, trace, training_calls):
    """Traced call by call (joint.py, the default) or by AOTAutograd (EMBER_TRACE_BY_NODE=0), the training
    graph becomes one C++ autograd function."""
    if trace == "aot_autograd":
        monkeypatch.setattr(ember.config, "trace_by_node", False)
    else:
        training_calls = record_returns(monkeypatch, ember.backend, "_joint_traced_call")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5)).to(device)
    step = compiled(lambda x, t: F.cross_entropy(model(x), t))
    for _ in range(3):
        x, t = torch.randn(9, 17, device=device), torch.randint(0, 5, (9,), device=device)
        model.zero_grad()
        loss = step(x, t)
        assert loss.grad_fn.name() == "EmberBackward"
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        expected = F.cross_entropy(model(x), t)
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(got, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert len(training_calls) == 1 and isinstance(training_calls[0], ember._C.DirectCall)


def test_switched_off_keeps_aot_autograd_function(monkeypatch, training_calls):
    monkeypatch.setattr(ember.config, "direct_call", False)
    x = leaf(5, 3)
    out = compiled(lambda a: (a.sin() * 2).sum())(x)
    assert out.grad_fn.name() != "EmberBackward"
    out.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    assert training_calls == [None]


def test_outputs_with_and_without_gradients():
    """An integer output, an output of inputs that need no grad, and an output the loss does not use (its
    gradient comes in as none and is zeros to the backward)."""

    def fn(x, w, c):
        y = (x @ w).tanh()
        return y, y.argmax(-1), c * 3, (x * 2).exp()

    x, w, c = leaf(6, 7), leaf(7, 4), torch.randn(4)
    outs = compiled(fn)(x, w, c)
    assert [o.requires_grad for o in outs] == [True, False, False, True]
    assert_grads_match(fn, [x, w, c])
    assert_grads_match(fn, [x, w, c], loss=lambda o: (o[0] * o[2]).sum() + o[3].mean())


def test_gradient_in_another_layout():
    """The backward was traced with contiguous gradients; a transposed (or expanded) one is laid out first."""

    def fn(x, w):
        return (x @ w).sigmoid() * x[:, :5]

    x, w = leaf(8, 6), leaf(6, 5)
    weights = torch.randn(5, 8)
    assert_grads_match(fn, [x, w], loss=lambda o: (o[0].t() * weights).sum())
    assert_grads_match(fn, [x, w], loss=lambda o: o[0].sum(0).sum())


def test_saved_tensor_changed_in_place_is_an_error():
    def fn(a, w):
        return (a * w).sum()

    x, w = leaf(4, 3), leaf(4, 3)
    a = x * 1  # a non-leaf input the backward saves
    loss = compiled(fn)(a, w)
    with torch.no_grad():
        a.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_backward_twice_needs_retain_graph():
    def fn(x):
        return (x.exp() * x).sum()

    x = leaf(3, 4)
    loss = compiled(fn)(x)
    loss.backward(retain_graph=True)
    once = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * once)
    torch.testing.assert_close(once, (x.exp() * (x + 1)).detach())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_create_graph_allows_first_order_only():
    """Gradients made with create_graph=True are right; differentiating them again is an error, as with
    AOTAutograd's graphs."""
    x = leaf(5)
    (g,) = torch.autograd.grad(compiled(lambda a: (a.sin() ** 2).sum())(x), x, create_graph=True)
    torch.testing.assert_close(g, (2 * x.sin() * x.cos()).detach())
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_input_without_gradient_gets_no_edge():
    """A non-leaf input whose gradient is none by construction is not connected to the graph."""

    def fn(a, b):
        return b.sin() * a.detach().sum()

    x, b = leaf(3), leaf(3)
    a = x * 2
    out = compiled(fn)(a, b)
    assert [f is None for f, _ in out.grad_fn.next_functions].count(True) == 1  # `a`'s (Dynamo orders the inputs)
    out.sum().backward()
    assert x.grad is None
    torch.testing.assert_close(b.grad, b.detach().cos() * a.detach().sum())


def test_saved_tensor_hooks_apply():
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    def fn(x, w):
        return (x @ w).relu().sum()

    x, w = leaf(4, 6), leaf(6, 2)
    step = compiled(fn)
    step(x, w)  # compiled outside the hooks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step(x, w)
    assert packed
    loss.backward()
    torch.testing.assert_close(w.grad, (x.t() @ ((x @ w) > 0).float()).detach())


def test_output_the_backward_saves():
    """exp's result is both an output and saved for the backward (held without a reference cycle)."""

    def fn(x):
        y = x.exp()
        return y, y * x

    x = leaf(3, 4)
    assert_grads_match(fn, [x], loss=lambda o: (o[0] ** 2).sum() + o[1].sum())


def test_batch_norm_statistics_written_in_place(training_calls):
    """A training batch norm writes its running statistics into its buffers inside the graph: the C++
    function runs it, the buffers match eager's after each step and their version counters move."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    reference = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    reference.load_state_dict(model.state_dict())
    step = compiled(lambda x: model(x).square().mean())
    for _ in range(3):
        x = torch.randn(2, 3, 11, 13)
        version = model[1].running_mean._version
        loss = step(x)
        assert loss.grad_fn.name() == "EmberBackward"
        assert model[1].running_mean._version > version
        loss.backward()
        expected = reference(x).square().mean()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for a, b in zip(list(model.parameters()) + list(model.buffers()), list(reference.parameters()) + list(reference.buffers())):
            torch.testing.assert_close(a.grad if a.grad is not None else a, b.grad if b.grad is not None else b,
                                       rtol=1e-4, atol=1e-5)
        model.zero_grad()
        reference.zero_grad()
    assert len(training_calls) == 1 and isinstance(training_calls[0], ember._C.DirectCall)


def test_outputs_that_are_views_keep_aot_wrapper(training_calls):
    """A view of an intermediate as output needs AOTAutograd's view replay: its wrapper stays."""

    def fn(x):
        y = x.exp()
        return y, (y * 2).view(-1)[1:7]

    x = leaf(3, 4)
    got = grads_of(compiled(fn), [x], loss=lambda o: (o[0] ** 2).sum() + o[1].sum())
    want = grads_of(fn, [x], loss=lambda o: (o[0] ** 2).sum() + o[1].sum())
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b)
    assert training_calls == [None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_saved_tensors_are_freed_with_the_graph():
    """Neither a dropped output nor a finished backward leaves the saved tensors alive (the node holds
    an output it saves without a reference cycle)."""
    torch.cuda.synchronize()
    x = leaf(1024, 1024, device="cuda")
    step = compiled(lambda a: a.exp() * 3)
    step(x).sum().backward()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(5):
        out = step(x)
        del out
    for _ in range(5):
        step(x).sum().backward()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_training_step(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                                torch.nn.Linear(96, 8)).to("cuda", dtype)
    x = torch.randn(31, 64, device="cuda", dtype=dtype)
    params = list(model.parameters())
    loss = compiled(lambda a: model(a).float().square().mean())(x)
    assert loss.grad_fn.name() == "EmberBackward"
    got = torch.autograd.grad(loss, params)
    expected = torch.autograd.grad(model(x).float().square().mean(), params)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def test_step_with_backward_inside_the_compiled_function():
    """A whole training step compiled (Dynamo breaks the graph at `loss.backward()`): the forward runs as
    the C++ function, and the rest of the step (`loss.detach()`, nothing to compile) runs as traced."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))

    def train_step(x, target):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    report = ember.explain(train_step)(torch.randn(5, 12), torch.randint(0, 3, (5,)))
    assert "nothing to compile (detach)" in str(report)
    assert sorted(g.kind for g in report.graphs) == ["backward", "forward"]
    step = compiled(train_step)
    for _ in range(3):
        x, t = torch.randn(5, 12), torch.randint(0, 3, (5,))
        got = [v.clone() for v in step(x, t)]
        expected = train_step(x, t)
        assert not got[0].requires_grad
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_training_graph_short_of_tangent_layouts_is_refused():
    """The backward reads one tangent layout per output that requires grad: a spec short of one (a damaged
    compile cache entry reached this) is an error when the training graph is made, not a read past the list."""
    import ember
    from ember import _C

    graph = _C.compile("graph(%x: f32[4]{1}@cpu):\n  %y: f32[4]{1}@cpu = aten::sin(%x)\n  return (%y)\n", {}, [], "",
                       "t")
    with pytest.raises(ember.EmberError, match="0 tangent layouts for 1 outputs"):
        _C.training_graph(graph, graph, [True], 0, 0, [], [False], -1)
    _C.training_graph(graph, graph, [True], 0, 0, [(-1, [4], [1])], [False], -1)
