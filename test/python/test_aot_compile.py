"""torch.compile(..., backend="ember", fullgraph=True).aot_compile(...) (ember/aot.py): the compiled function is
saved, and loads in this process and in a fresh one with neither Dynamo's tracing nor ember's ATen tracing and
lowering, gives eager's results (and gradients) with the live module's parameters, and bytes that are not its
artifact raise EmberError."""

import copy
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import ember
from helpers import EMBER_GRAPHS, MATMUL_TOL, assert_tensor_close, record_returns

if not hasattr(torch.compiler, "load_compiled_function"):
    pytest.skip("this torch has no aot_compile (torch.compiler.load_compiled_function, torch 2.11+)",
                allow_module_level=True)
pytest.importorskip("torch._dynamo.aot_compile_types", reason="this torch has no aot_compile's SerializableCallable")

import ember.aot  # noqa: E402

if ember.aot._torch_version() < ember.aot.MIN_TORCH:
    pytest.skip(f"ember's aot_compile needs torch {ember.aot.MIN_TORCH} or later", allow_module_level=True)

# The models, as a module of their own: Dynamo's saved guards name a module's class by its import path, and
# the fresh process imports the same classes. A module's forward is compiled as `forward(self, x)`, and the
# loaded function takes the module as its first argument.
MODELS = textwrap.dedent("""
    import torch

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 6))

        def forward(self, x):
            return self.net(x)

    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(24, 6)
            self.register_buffer("scale", torch.rand(6) + 0.5)

        def forward(self, x):
            return torch.tanh(self.linear(x)) * self.scale

    class WithBatchNorm(torch.nn.Module):  # training: running statistics written in place (through AOTAutograd)
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(24, 16)
            self.norm = torch.nn.BatchNorm1d(16)

        def forward(self, x):
            return torch.relu(self.norm(self.linear(x)))
""")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """MODELS imported as the module aot_models, from a folder of its own (`models.folder`)."""
    folder = tmp_path_factory.mktemp("aot_models")
    (folder / "aot_models.py").write_text(MODELS)
    sys.path.insert(0, str(folder))
    sys.modules.pop("aot_models", None)
    try:
        import aot_models

        aot_models.folder = folder
        yield aot_models
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("aot_models", None)


def _aot_compile(model, x, **kwargs):
    return torch.compile(model, backend="ember", fullgraph=True, options={"fallback": "raise"},
                         **kwargs).forward.aot_compile(((x,), {}))


def _load(path):
    with open(path, "rb") as f:
        return torch.compiler.load_compiled_function(f)


def _forbid_tracing(monkeypatch):
    """From here on, Dynamo's bytecode tracing, AOTAutograd and ember's ATen tracing and lowering raise (and are
    listed in the list returned) where anything calls them: a load must rebuild the plan from the stored IR."""
    import torch._dynamo.convert_frame
    import torch._dynamo.symbolic_convert
    import torch._functorch.aot_autograd

    import ember.joint
    import ember.lower
    import ember.trace

    called = []

    def forbidden(name):
        def call(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"{name} ran while loading an aot_compile artifact")

        return call

    for owner, name in ((torch._dynamo.symbolic_convert.InstructionTranslatorBase, "run"),
                        (torch._dynamo.convert_frame, "fullgraph_capture"),
                        (torch._functorch.aot_autograd, "aot_module_simplified"),
                        (ember.trace, "trace_inference"), (ember.joint, "trace_training"),
                        (ember.lower, "lower_graph")):
        monkeypatch.setattr(owner, name, forbidden(f"{getattr(owner, '__name__', owner)}.{name}"))
    return called


@pytest.mark.parametrize("name", ["MLP", "WithBuffer"])
def test_inference_loads_without_tracing_and_reads_the_live_module(tmp_path, monkeypatch, models, name):
    make = getattr(models, name)
    model = make().eval()
    with torch.no_grad():
        compiled = _aot_compile(model, torch.randn(16, 24))
        y = torch.randn(16, 24)
        assert_tensor_close(compiled(model, y), model(y), **MATMUL_TOL)
    compiled.save_compiled_function(str(tmp_path / "model.aot"))
    torch._dynamo.reset()

    traced = _forbid_tracing(monkeypatch)
    before = len(EMBER_GRAPHS)
    loaded = _load(tmp_path / "model.aot")
    with torch.no_grad():
        y = torch.randn(16, 24)
        assert_tensor_close(loaded(model, y), model(y), **MATMUL_TOL)
        assert [kind for kind, _ in EMBER_GRAPHS[before:]] == ["inference"]  # built from the stored IR
        # Parameters and buffers are the graph's inputs, read from the module passed: changed in place, or
        # another instance of the class, the loaded function follows.
        for t in (*model.parameters(), *model.buffers()):
            t.mul_(0.5)
        assert_tensor_close(loaded(model, y), model(y), **MATMUL_TOL)
        other = make().eval()
        assert_tensor_close(loaded(other, y), other(y), **MATMUL_TOL)
    assert traced == []


@pytest.mark.parametrize("name", ["MLP", "WithBatchNorm"])
def test_training_loads_with_gradients(tmp_path, monkeypatch, models, name):
    """Grad mode on, parameters requiring grad: the saved function is a forward and backward (one C++ autograd
    function); loaded, it gives eager's outputs, parameter gradients and running statistics."""
    model = getattr(models, name)().train()
    compiled = _aot_compile(model, torch.randn(16, 24))
    compiled.save_compiled_function(str(tmp_path / "model.aot"))
    torch._dynamo.reset()

    traced = _forbid_tracing(monkeypatch)
    loaded = _load(tmp_path / "model.aot")
    expected_model = copy.deepcopy(model)
    for _ in range(2):
        y = torch.randn(16, 24)
        out, expected = loaded(model, y), expected_model(y)
        assert_tensor_close(out, expected, **MATMUL_TOL)
        out.square().sum().backward()
        expected.square().sum().backward()
    for (name, p), e in zip(model.named_parameters(), expected_model.parameters()):
        assert_tensor_close(p.grad, e.grad, what=f"grad of {name}", **MATMUL_TOL)
    for (name, b), e in zip(model.named_buffers(), expected_model.buffers()):
        assert_tensor_close(b, e, what=f"buffer {name}", **MATMUL_TOL)
    assert traced == []


def test_symbolic_sizes_load_for_other_sizes(tmp_path, monkeypatch, models):
    model = models.MLP().eval()
    with torch.no_grad():
        _aot_compile(model, torch.randn(16, 24), dynamic=True).save_compiled_function(str(tmp_path / "model.aot"))
        torch._dynamo.reset()
        traced = _forbid_tracing(monkeypatch)
        loaded = _load(tmp_path / "model.aot")
        for n in (3, 40):
            y = torch.randn(n, 24)
            assert_tensor_close(loaded(model, y), model(y), **MATMUL_TOL)
    assert traced == []


_LOAD_SCRIPT = textwrap.dedent("""
    import sys

    import torch
    import torch._dynamo.convert_frame
    import torch._dynamo.symbolic_convert
    import torch._functorch.aot_autograd

    import aot_models
    import ember.joint
    import ember.lower
    import ember.trace

    def forbidden(*args, **kwargs):
        raise AssertionError("traced while loading")

    torch._dynamo.symbolic_convert.InstructionTranslatorBase.run = forbidden
    torch._dynamo.convert_frame.fullgraph_capture = forbidden
    torch._functorch.aot_autograd.aot_module_simplified = forbidden
    ember.trace.trace_inference = ember.joint.trace_training = ember.lower.lower_graph = forbidden

    folder = sys.argv[1]
    errors = []
    for name in ("MLP", "WithBuffer"):
        model = getattr(aot_models, name)().eval()
        model.load_state_dict(torch.load(f"{folder}/{name}.pt"))
        with open(f"{folder}/{name}.aot", "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        torch.manual_seed(1)
        with torch.no_grad():
            y = torch.randn(16, 24)
            errors.append((loaded(model, y) - model(y)).abs().max().item())
    print("ERRORS", *errors)
""")


def test_a_fresh_process_loads_what_this_one_saved(tmp_path, models):
    (tmp_path / "load.py").write_text(_LOAD_SCRIPT)
    for name in ("MLP", "WithBuffer"):
        model = getattr(models, name)().eval()
        with torch.no_grad():
            _aot_compile(model, torch.randn(16, 24)).save_compiled_function(str(tmp_path / f"{name}.aot"))
        torch.save(model.state_dict(), tmp_path / f"{name}.pt")
        torch._dynamo.reset()
    env = dict(os.environ, PYTHONPATH=str(models.folder), EMBER_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, str(tmp_path / "load.py"), str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [float(e) for e in run.stdout.split("ERRORS")[1].split()]
    assert len(errors) == 2 and max(errors) < MATMUL_TOL["atol"], run.stdout


def test_bytes_that_are_not_an_artifact_raise_ember_error(tmp_path, monkeypatch, models):
    written = record_returns(monkeypatch, ember.aot, "serialize")
    with torch.no_grad():
        _aot_compile(models.MLP().eval(), torch.randn(16, 24)).save_compiled_function(str(tmp_path / "model.aot"))
    (good,) = written
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    other = ember.aot.serialize({"format": ember.aot.FORMAT, "kind": "something else"})  # a valid checksum
    for bad, why in ((b"", "header"), (b"not an artifact", "header"), (good[: len(good) // 2], "checksum"),
                     (bytes(flipped), "checksum"), (other, "not an ember aot_compile artifact")):
        with pytest.raises(ember.EmberError, match=why):
            ember.aot.AOTCompiledGraph.deserialize_compile_artifacts(bad)
    artifact = ember.aot._read(good)
    with pytest.raises(ember.EmberError, match="another ember build"):
        ember.aot.AOTCompiledGraph.deserialize_compile_artifacts(ember.aot.serialize(dict(artifact, versions="x")))

    # Through torch's loader: a file whose ember part is damaged.
    monkeypatch.setattr(ember.aot, "serialize", lambda artifact: bytes(flipped))
    with torch.no_grad():
        _aot_compile(models.MLP().eval(), torch.randn(16, 24)).save_compiled_function(str(tmp_path / "damaged.aot"))
    with pytest.raises(ember.EmberError, match="checksum"):
        _load(tmp_path / "damaged.aot")


def test_other_cpp_settings_at_load_warn(tmp_path, models):
    """The saved IR keeps what settings did to the trace; the C++ pipeline runs again at load, under the loading
    process's settings: where those differ from the compile's, a warning names them."""
    model = models.MLP().eval()
    here = ember.config.cpu_matmul
    other = "aten" if here != "aten" else "onednn"
    with torch.no_grad(), ember.config.patch(cpu_matmul=other):
        _aot_compile(model, torch.randn(16, 24)).save_compiled_function(str(tmp_path / "model.aot"))
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=re.escape(f"cpu_matmul='{other}' (here '{here}')")):
        loaded = _load(tmp_path / "model.aot")
    with torch.no_grad():
        y = torch.randn(16, 24)
        assert_tensor_close(loaded(model, y), model(y), **MATMUL_TOL)


def test_what_ember_cannot_save_says_so(tmp_path):
    def aliasing(x):  # an output that aliases the input keeps AOTAutograd's Python wrapper
        return x.view(-1), torch.relu(x) * 2

    with pytest.raises(ember.EmberError, match="cannot save this graph for aot_compile"):
        torch.compile(aliasing, backend="ember", fullgraph=True).aot_compile(((torch.randn(4, 6),), {}))

    def views(x):  # nothing to compile: Dynamo's graph runs as it is, saved as torch's FX graph
        return x.t().detach()

    compiled = torch.compile(views, backend="ember", fullgraph=True).aot_compile(((torch.randn(4, 6),), {}))
    compiled.save_compiled_function(str(tmp_path / "views.aot"))
    x = torch.randn(4, 6)
    torch.testing.assert_close(_load(tmp_path / "views.aot")(x), x.t())
