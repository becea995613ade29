"""Shared helpers for ember's pytest corpus.

The central helper is `check(fn, *inputs, ...)`: it runs `fn` eagerly and compiled with
`torch.compile(fn, backend="ember", options={"fallback": "raise", ...})` on independent copies of the
same inputs and compares

  * the outputs (nested tuples / lists / dicts of tensors, ints, floats, bools and None),
  * the inputs after the call (so in-place mutations of inputs must match eager's),
  * with grad=True: the gradients of every floating-point input (and, for modules, of every
    parameter) after backward of a random-weighted sum of the floating-point outputs,
  * for modules: parameters and buffers after the call (running stats of batch norm, buffers
    mutated in place).

A compiled call that falls back to eager is a test failure, never a silent pass: the helper asks for
fallback="raise", conftest.py turns ember's fallback warning into an error, and `check` asserts that
ember really compiled at least one graph during the compiled call (`EMBER_GRAPHS`, filled by the
autouse fixture in conftest.py that counts calls into ember's graph compiler).
"""

import copy
import math
import re

import pytest
import torch

import ember  # noqa: F401  (the backend must be importable; the entry point registers "ember")

# Filled by conftest.py's autouse fixture: one entry (kind, compiled object) per graph that ember
# compiled during the current test.
EMBER_GRAPHS = []

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# (atol, rtol) per dtype. ember runs the same ATen kernels as eager, but AOTAutograd decomposes
# composite ops, so results are not always bitwise equal.
TOLERANCES = {
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float32: (1e-5, 1e-4),
    torch.float64: (1e-7, 1e-6),
}
MATMUL_TOL = dict(atol=1e-4, rtol=1e-3)  # for fp32 graphs with matmuls / convs / reductions over many terms


def record_returns(monkeypatch, module, name):
    """The list of what `module.name` (a step of the compile) returns, call by call, for the rest of the test. The
    compile cache goes off for the test: a hit would skip the step (EMBER_TEST_COMPILE_CACHE=1)."""
    import ember.config

    monkeypatch.setattr(ember.config, "compile_cache", False)
    made = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(module, name, spy)
    return made


def ember_options(options=None):
    opts = {"fallback": "raise"}
    opts.update(options or {})
    return opts


def compile_ember(fn, *, dynamic=None, options=None, fullgraph=False):
    """torch.compile with ember, falling back to eager is an error."""
    return torch.compile(fn, backend="ember", dynamic=dynamic, fullgraph=fullgraph, options=ember_options(options))


# --------------------------------------------------------------------------------------------------
# copying inputs
# --------------------------------------------------------------------------------------------------


def clone_input(x):
    """A copy with the same sizes, strides and storage offset (so non-contiguous inputs stay so)."""
    if isinstance(x, torch.Tensor):
        with torch.no_grad():
            if x.is_contiguous() or x.numel() == 0:
                y = x.detach().clone(memory_format=torch.preserve_format)
                if y.stride() != x.stride() and x.numel() > 0:
                    y = _strided_copy(x)
            else:
                y = _strided_copy(x)
        assert y.shape == x.shape and y.dtype == x.dtype
        if x.numel() > 1:
            assert y.stride() == x.stride(), (y.stride(), x.stride())
        return y
    if isinstance(x, (list, tuple)):
        return type(x)(clone_input(i) for i in x)
    if isinstance(x, dict):
        return {k: clone_input(v) for k, v in x.items()}
    return copy.deepcopy(x)


def _strided_copy(x):
    storage_elems = x.untyped_storage().nbytes() // x.element_size()
    base = torch.zeros(storage_elems, dtype=x.dtype, device=x.device)
    y = base.as_strided(x.size(), x.stride(), x.storage_offset())
    y.copy_(x.detach())
    return y.detach()  # a leaf with x's layout


def leaves(tree):
    """The tensors of a nested structure, in order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in leaves(item)]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in leaves(tree[k])]
    return []


# --------------------------------------------------------------------------------------------------
# comparing
# --------------------------------------------------------------------------------------------------


def tol_for(dtype, atol=None, rtol=None):
    a, r = TOLERANCES.get(dtype, (0, 0))
    return (a if atol is None else atol), (r if rtol is None else rtol)


def assert_tensor_close(actual, expected, *, atol=None, rtol=None, what="output", exact_layout=False):
    assert isinstance(actual, torch.Tensor), f"{what}: expected a tensor, got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != eager's {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager's {tuple(expected.shape)}"
    assert actual.device == expected.device, f"{what}: device {actual.device} != eager's {expected.device}"
    if exact_layout and expected.numel() > 1:
        assert actual.stride() == expected.stride(), f"{what}: strides {actual.stride()} != eager's {expected.stride()}"
    if expected.dtype.is_floating_point or expected.dtype.is_complex:
        a, r = tol_for(expected.dtype, atol, rtol)
        torch.testing.assert_close(actual.detach(), expected.detach(), atol=a, rtol=r, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual.detach(), expected.detach()), f"{what}: {actual} != eager's {expected}"


def assert_same(actual, expected, *, atol=None, rtol=None, what="output"):
    """Compares nested outputs: structure, types and values."""
    if isinstance(expected, torch.Tensor):
        assert_tensor_close(actual, expected, atol=atol, rtol=rtol, what=what)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{what}: {type(actual).__name__} != eager's {type(expected).__name__}"
        assert type(actual) is type(expected) or (
            isinstance(actual, tuple) and isinstance(expected, tuple)
        ), f"{what}: {type(actual).__name__} != eager's {type(expected).__name__}"
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != eager's {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, atol=atol, rtol=rtol, what=f"{what}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{what}: {type(actual).__name__} != dict"
        assert list(actual) == list(expected), f"{what}: keys {list(actual)} != eager's {list(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], atol=atol, rtol=rtol, what=f"{what}[{k!r}]")
    elif isinstance(expected, float):
        assert isinstance(actual, float), f"{what}: {type(actual).__name__} != float"
        assert (math.isnan(actual) and math.isnan(expected)) or math.isclose(
            actual, expected, rel_tol=rtol or 1e-6, abs_tol=atol or 1e-6), f"{what}: {actual} != {expected}"
    else:
        assert type(actual) is type(expected), f"{what}: {type(actual).__name__} != eager's {type(expected).__name__}"
        assert actual == expected, f"{what}: {actual!r} != eager's {expected!r}"


# --------------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------------


def _grad_inputs(inputs, grad):
    """Indices of the (top-level) tensor inputs that get requires_grad."""
    if grad is False:
        return []
    if grad is True:
        return [i for i, x in enumerate(inputs)
                if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
    return list(grad)


def _loss_weights(outputs, seed):
    g = torch.Generator().manual_seed(seed)
    ws = []
    for o in leaves(outputs):
        if o.requires_grad and o.dtype.is_floating_point:
            ws.append(torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.device, o.dtype))
        else:
            ws.append(None)
    return ws


def _weighted_sum(outputs, weights):
    total = None
    for o, w in zip(leaves(outputs), weights):
        if w is None:
            continue
        term = (o.float() * w.float()).sum()
        total = term if total is None else total + term
    return total


def run_once(fn, inputs, grad_idx, backward, weights=None, seed=0):
    """Runs fn on inputs (already copied); returns outputs, loss weights, input grads, param grads."""
    for i in grad_idx:
        inputs[i].requires_grad_(True)
    mod = getattr(fn, "_orig_mod", fn)
    if backward and isinstance(mod, torch.nn.Module):
        for p in mod.parameters():  # a module checked twice must not compare gradients left by the first check
            p.grad = None
    outputs = fn(*inputs)
    input_grads, param_grads = None, None
    if backward:
        if weights is None:
            weights = _loss_weights(outputs, seed)
        loss = _weighted_sum(outputs, weights)
        assert loss is not None and loss.requires_grad, "grad=True but no output requires grad"
        loss.backward()
        input_grads = [inputs[i].grad for i in grad_idx]
        if isinstance(mod, torch.nn.Module):
            param_grads = {n: p.grad for n, p in mod.named_parameters()}
    return outputs, weights, input_grads, param_grads


def check(fn, *inputs, grad=True, dynamic=None, atol=None, rtol=None, grad_atol=None, grad_rtol=None,
          options=None, compiled=None, check_inputs=True, check_state=True, min_graphs=1, seed=1234):
    """Compares fn eager vs compiled with ember; see the module docstring.

    grad: True (all floating-point tensor inputs), False (no backward), or a list of input indices
          (backward, gradients compared for those inputs and for module parameters).
    compiled: an already compiled callable to use (e.g. the same compiled fn over several shapes);
              for modules it must wrap a deep copy of fn, made by the caller.
    min_graphs: how many graphs ember must compile during the compiled call (0 when the caller reuses
              `compiled` on shapes it has already seen).
    Returns (eager outputs, compiled outputs).
    """
    is_module = isinstance(fn, torch.nn.Module)
    if compiled is None:
        model_c = copy.deepcopy(fn) if is_module else fn
        compiled = compile_ember(model_c, dynamic=dynamic, options=options)
    model_c = getattr(compiled, "_orig_mod", compiled)
    grad_idx = _grad_inputs(inputs, grad)
    # grad=True on a function of integer tensors only: nothing to differentiate.
    backward = grad is not False and (bool(grad_idx) or is_module or grad is not True)

    eager_in = [clone_input(x) for x in inputs]
    comp_in = [clone_input(x) for x in inputs]

    torch.manual_seed(seed)
    e_out, weights, e_igrads, e_pgrads = run_once(fn, eager_in, grad_idx, backward, seed=seed)
    before = len(EMBER_GRAPHS)
    torch.manual_seed(seed)
    c_out, _, c_igrads, c_pgrads = run_once(compiled, comp_in, grad_idx, backward, weights=weights, seed=seed)
    compiled_graphs = len(EMBER_GRAPHS) - before
    assert compiled_graphs >= min_graphs, (
        f"ember compiled {compiled_graphs} graph(s), expected at least {min_graphs}: "
        "the compiled call must go through ember")

    assert_same(c_out, e_out, atol=atol, rtol=rtol)
    if check_inputs:
        for i, (c, e) in enumerate(zip(comp_in, eager_in)):
            if isinstance(e, torch.Tensor):
                assert_tensor_close(c, e, atol=atol, rtol=rtol, what=f"input {i} after the call")
    ga = grad_atol if grad_atol is not None else atol
    gr = grad_rtol if grad_rtol is not None else rtol
    if backward:
        for i, c, e in zip(grad_idx, c_igrads, e_igrads):
            if e is None:
                assert c is None, f"input {i} has a grad, eager's has none"
            else:
                assert c is not None, f"input {i}: no grad, eager has one"
                assert_tensor_close(c, e, atol=ga, rtol=gr, what=f"grad of input {i}")
        for name, e in (e_pgrads or {}).items():
            c = c_pgrads[name]
            if e is None:
                assert c is None, f"param {name} has a grad, eager's has none"
            else:
                assert c is not None, f"param {name}: no grad, eager has one"
                assert_tensor_close(c, e, atol=ga, rtol=gr, what=f"grad of param {name}")
    if is_module and check_state:
        e_state = fn.state_dict()
        c_state = model_c.state_dict()
        assert list(c_state) == list(e_state)
        for name, e in e_state.items():
            assert_tensor_close(c_state[name], e, atol=atol, rtol=rtol, what=f"state {name} after the call")
    return e_out, c_out


class Wrap(torch.nn.Module):
    """A module built from submodules and a function fn(self, *inputs): parameters are compared by check."""

    def __init__(self, fn, **modules):
        super().__init__()
        self.fn = fn
        for name, m in modules.items():
            setattr(self, name, m)

    def forward(self, *inputs):
        return self.fn(self, *inputs)


def canonical_ir(traced):
    """ember's IR text of a traced graph with values and constants renamed in order of appearance."""
    import ember.lower

    text, _ = ember.lower.lower(traced)
    names = {}
    text = re.sub(r"%[A-Za-z_][A-Za-z0-9_]*", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)
    constants = {}
    return re.sub(r'prim::constant\("([^"]*)"\)',
                  lambda m: f'prim::constant("c{constants.setdefault(m.group(1), len(constants))}")', text)
