"""The compile cache (ember/cache.py): a graph compiled once comes back from disk, in this process after
torch._dynamo.reset() and in a fresh one, with the results of a fresh compile; a bad entry is a miss."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ember
import ember.cache
from helpers import DEVICES, MATMUL_TOL, check


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(ember.config, "compile_cache", True)
    monkeypatch.setattr(ember.config, "cache_dir", str(tmp_path))
    return tmp_path


def _model():
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.LayerNorm(48), torch.nn.Linear(48, 6))


def _explain(model, *inputs, train=False, **options):
    torch._dynamo.reset()
    with torch.set_grad_enabled(train):
        return ember.explain(model, options=options or None)(*inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_cached_compile_matches_eager_as_a_fresh_one_does(cache_dir, device, train):
    model = _model().to(device)
    x = torch.randn(16, 24, device=device, requires_grad=train)
    first = _explain(model, x, train=train)
    assert first.cache_hits == 0 and len(ember.cache.entries()) == 1
    again = _explain(model, x, train=train)
    assert again.cache_hits == 1, str(again)
    assert "from the compile cache" in str(again)
    # The entry's graphs compiled again, each compared with eager on fresh inputs (and gradients in training).
    torch._dynamo.reset()
    if train:
        check(model, torch.randn(16, 24, device=device), **MATMUL_TOL)
    else:
        with torch.no_grad():
            check(model, torch.randn(16, 24, device=device), grad=False, **MATMUL_TOL)
    assert len(ember.cache.entries()) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_with_tensor_constants_reads_their_values_from_the_entry(cache_dir, device):
    """A tensor made in the graph (an index list) is a constant of the lowered graph, stored with the entry. Read
    inside Dynamo's compile, torch.load gave it as a meta tensor, without values: garbage out (fuzz seed 700016)."""
    def fn(x):
        return torch.tanh(x[torch.tensor([5, 7, 7, 1], device=x.device)]) * x[torch.tensor([0, 2], device=x.device)].sum()

    for n in range(3):  # a miss, then hits
        torch._dynamo.reset()
        x = torch.randn(13, device=device)
        torch.testing.assert_close(torch.compile(fn, backend="ember", options={"fallback": "raise"})(x), fn(x))
    assert len(ember.cache.entries()) == 1
    assert _explain(fn, x, train=True).cache_hits == 1  # grad mode on, as for the compiles above


def test_what_changes_a_compile_changes_the_key(cache_dir):
    model = _model()
    x = torch.randn(16, 24)
    _explain(model, x)
    for run in (lambda: _explain(model, torch.randn(8, 24)),                  # another size
                lambda: _explain(model, torch.randn(24, 16).t()),             # other strides
                lambda: _explain(model.double(), x.double())):                # another dtype
        assert run().cache_hits == 0
    with ember.config.patch(cpu_matmul="aten"):                               # a setting
        assert _explain(model.float(), x).cache_hits == 0
    assert _explain(model.float(), x, disable_passes="cse").cache_hits == 0  # an option
    assert _explain(model.float(), x).cache_hits == 1
    assert len(ember.cache.entries()) == 6


def test_a_debug_directory_or_the_setting_off_keeps_nothing(cache_dir, tmp_path_factory, monkeypatch):
    with ember.config.patch(debug_dir=str(tmp_path_factory.mktemp("dump"))):
        _explain(_model(), torch.randn(4, 24))
    _explain(_model(), torch.randn(4, 24), debug_dir=str(tmp_path_factory.mktemp("dump")))
    monkeypatch.setattr(ember.config, "compile_cache", False)
    _explain(_model(), torch.randn(4, 24))
    assert ember.cache.entries() == []


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other key"])
def test_a_bad_entry_is_a_miss(cache_dir, damage):
    model = _model()
    x = torch.randn(16, 24)
    _explain(model, x)
    ((path, size),) = ember.cache.entries()
    data = open(path, "rb").read()
    if damage == "garbage":
        data = bytes(b ^ 0x5A for b in data)
    elif damage == "truncated":
        data = data[: size // 2]
    elif damage == "empty":
        data = b""
    else:
        torch.save(dict(torch.load(path, weights_only=True), key="0" * 64), path)
        data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data)
    report = _explain(model, x)
    assert report.cache_hits == 0 and len(report.graphs) == 1
    torch._dynamo.reset()
    with torch.no_grad():
        check(model, x, grad=False, **MATMUL_TOL)
    # The fresh compile wrote a good entry over the bad one.
    assert _explain(model, x).cache_hits == 1


def _indexed(x):
    """A graph with tensor constants (index lists), stored with its entry."""
    return torch.tanh(x[torch.tensor([5, 7, 7, 1], device=x.device)]) * x[torch.tensor([0, 2], device=x.device)].sum()


@pytest.mark.parametrize("damage", ["a constant's value", "a constant's byte on disk", "an op in the IR"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_an_entry_changed_inside_is_a_miss(cache_dir, damage, train):
    """torch.load checks no checksum: an entry whose IR or constants changed (a flipped byte) loads as another,
    well-formed entry. Those compiled and gave other results (another index, or one out of bounds); the checksum
    stored with each entry makes them misses."""
    x = torch.randn(13, requires_grad=train)
    _explain(_indexed, x, train=train)
    ((path, _),) = ember.cache.entries()
    if damage == "a constant's byte on disk":
        data = bytearray(open(path, "rb").read())
        at = bytes(data).find(torch.tensor([5, 7, 7, 1]).numpy().tobytes())
        assert at > 0
        data[at] = 2  # index 5 -> 2: still in bounds
        open(path, "wb").write(bytes(data))
    else:
        entry = torch.load(path, weights_only=True)
        forward = entry["graphs"][0]
        if damage == "a constant's value":
            name = next(iter(forward["constants"]))
            forward["constants"][name] = forward["constants"][name].flip(0).contiguous()
        else:  # as well-formed as before
            forward["ir"] = forward["ir"].replace("aten::tanh(", "aten::sigmoid(")
        torch.save(entry, path)
    report = _explain(_indexed, x, train=train)
    assert report.cache_hits == 0 and len(report.graphs) == (2 if train else 1)
    torch._dynamo.reset()
    check(_indexed, torch.randn(13), grad=train)
    assert _explain(_indexed, x, train=train).cache_hits == 1  # the fresh compile wrote a good entry over it


def _reseal(entry):
    """entry with its checksum made to match (as a writer with a bug would store it)."""
    entry = {name: v for name, v in entry.items() if name != "digest"}
    return dict(entry, digest=ember.cache._digest(entry))


def _return_first_input(ir):
    """The IR with its first result replaced by its first input."""
    lines = ir.rstrip("\n").split("\n")
    first = lines[0][len("graph("):].split(":")[0]
    head, rest = lines[-1].split("(", 1)
    lines[-1] = head + "(" + first + rest[rest.index(","):] if "," in rest else head + "(" + first + ")"
    return "\n".join(lines) + "\n"


_WRITTEN_WRONG = {  # what to compile, in training or not, and what the writer got wrong
    # The C++ training call read one tangent per output that requires grad, past the end of this list: a crash.
    "no tangents": (_model, True, lambda e: e["spec"].update(tangents=[])),
    "a forward result counted as saved": (_model, True, lambda e: e["spec"].update(
        saved_checked=e["spec"]["saved_checked"] + 1)),
    "a constant of another length": (lambda: _indexed, False, lambda e: e["graphs"][0]["constants"].update(
        {name: t[:1].clone() for name, t in e["graphs"][0]["constants"].items()})),
    "a dynamic dim of no output": (_model, False, lambda e: e.update(dynamic_dims=[(3, [0])])),
    # The C++ training call gave the parameter returned autograd history: no longer a leaf, for the whole process.
    "a parameter returned": (_model, True, lambda e: e["graphs"][0].update(
        ir=_return_first_input(e["graphs"][0]["ir"]))),
}


@pytest.mark.parametrize("wrong", sorted(_WRITTEN_WRONG))
def test_an_entry_written_wrong_is_a_miss(cache_dir, wrong):
    """An entry whose checksum matches but whose fields disagree with each other or with its IR (as a writer's bug
    would leave it) is a miss: it crashed, raised at its first call or gave other results."""
    make, train, change = _WRITTEN_WRONG[wrong]
    fn = make()
    x = torch.randn(13 if fn is _indexed else (16, 24), requires_grad=train)
    _explain(fn, x, train=train)
    ((path, _),) = ember.cache.entries()
    entry = torch.load(path, weights_only=True)
    change(entry)
    torch.save(_reseal(entry), path)
    report = _explain(fn, x, train=train)
    assert report.cache_hits == 0, str(report)
    torch._dynamo.reset()
    check(fn, x.detach(), grad=train, **MATMUL_TOL)


def test_clear_and_the_size_cap(cache_dir, monkeypatch):
    for n in (4, 5, 6):
        _explain(_model(), torch.randn(n, 24))
    held = ember.cache.entries()
    assert len(held) == 3
    monkeypatch.setattr(ember.config, "compile_cache_mb", 1)
    filler = os.path.join(ember.cache.folder(), "f" * 64 + ".entry")
    with open(filler, "wb") as f:
        f.write(b"\0" * (2**20 - sum(size for _, size in held) + 1))
    _explain(_model(), torch.randn(7, 24))  # its store evicts the least recently used until under 1 MiB
    left = [path for path, _ in ember.cache.entries()]
    assert held[0][0] not in left and len(left) < 5
    assert ember.cache.clear() == len(left) and ember.cache.entries() == []


def test_a_fresh_process_reads_what_another_wrote(tmp_path):
    script = textwrap.dedent("""
        import torch, ember
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 6))
        x = torch.randn(16, 24, requires_grad=True)
        report = ember.explain(model)(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ember", options={"fallback": "raise"})
        y = torch.randn(16, 24, requires_grad=True)
        out = compiled(y)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()] + [y.grad.clone()]
        for p in model.parameters():
            p.grad = None
        y2 = y.detach().clone().requires_grad_(True)
        model(y2).square().sum().backward()
        expected = [p.grad for p in model.parameters()] + [y2.grad]
        error = max((a - b).abs().max().item() for a, b in zip(grads, expected))
        print("HITS", report.cache_hits, "ERROR", error)
    """)
    env = dict(os.environ, EMBER_CACHE_DIR=str(tmp_path), EMBER_COMPILE_CACHE="1")
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (hits0, error0), (hits1, error1) = [run.stdout.split("HITS ")[1].split(" ERROR ") for run in runs]
    assert (hits0, hits1) == ("0", "1")
    assert float(error0) < 1e-4 and float(error1) < 1e-4


def test_artifacts_carry_the_cache_to_another_folder(tmp_path, monkeypatch):
    """save_cache_artifacts from one cache folder, load_cache_artifacts into an empty one (another machine with
    the same ember, torch and GPU): a compile there is a hit with eager's results; bytes that are not artifacts
    are an EmberError that writes nothing."""
    monkeypatch.setattr(ember.config, "compile_cache", True)
    first, second = tmp_path / "first", tmp_path / "second"
    model, x = _model(), torch.randn(16, 24)
    monkeypatch.setattr(ember.config, "cache_dir", str(first))
    assert _explain(model, x).cache_hits == 0
    blob = ember.save_cache_artifacts()
    assert len(ember.cache.entries()) == 1 and blob

    monkeypatch.setattr(ember.config, "cache_dir", str(second))
    for bad in (b"", b"not a zip", blob[: len(blob) // 2]):
        with pytest.raises(ember.EmberError, match="not ember cache artifacts"):
            ember.load_cache_artifacts(bad)
    assert ember.cache.entries() == []
    assert ember.load_cache_artifacts(blob) >= 1
    assert len(ember.cache.entries()) == 1
    assert _explain(model, x).cache_hits == 1
    torch._dynamo.reset()
    y = torch.randn(16, 24)
    torch.testing.assert_close(torch.compile(model, backend="ember")(y), model(y), rtol=1e-5, atol=1e-5)


def _bn_model():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_graphs_through_aot_autograd_are_cached(cache_dir, device, train):
    """Graphs that AOTAutograd traces (here: buffers written in place, a batch norm's running statistics in
    training mode, and an input mutated by an inference graph) are stored too; a hit gives what a fresh compile
    gives, the in-place writes included, and gradients in training."""
    def mutate(x, acc):
        acc.mul_(0.5).add_(x.sum(0))
        return torch.tanh(x) * acc

    results = []
    for attempt in range(2):  # a miss, then a hit
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _bn_model().to(device).train()
        x = torch.randn(16, 12, device=device)
        acc = torch.randn(12, device=device)
        with torch.set_grad_enabled(train):
            report = ember.explain(model)(x)
            compiled_out = torch.compile(mutate, backend="ember", options={"fallback": "raise"})(x, acc)
            out = torch.compile(model, backend="ember", options={"fallback": "raise"})(x)
            if train:
                out.square().sum().backward()
        results.append((report.cache_hits, out.detach(), compiled_out, acc.clone(), model[1].running_mean.clone(),
                        model[1].running_var.clone(), model[0].weight.grad))
    assert results[0][0] == 0 and results[1][0] == 1, str(report)
    assert len(ember.cache.entries()) == 2  # the model's graph and mutate's
    assert _explain(mutate, x, acc, train=train).cache_hits == 1
    for fresh, hit in zip(results[0][1:], results[1][1:]):
        if fresh is not None:
            torch.testing.assert_close(hit, fresh, atol=1e-5, rtol=1e-5)
    # ... and the hit is right, against eager from the same start (model and inputs seeded alike).
    torch.manual_seed(0)
    model = _bn_model().to(device).train()
    x = torch.randn(16, 12, device=device)
    acc = torch.randn(12, device=device)
    with torch.set_grad_enabled(train):
        model(x)  # explain's call above moved the running statistics once
        expected_mutated = mutate(x, acc)
        out = model(x)
        if train:
            out.square().sum().backward()
    torch.testing.assert_close(results[1][2], expected_mutated, **MATMUL_TOL)
    torch.testing.assert_close(results[1][3], acc)
    torch.testing.assert_close(results[1][1], out.detach(), **MATMUL_TOL)
    torch.testing.assert_close(results[1][4], model[1].running_mean, **MATMUL_TOL)
    if train:
        torch.testing.assert_close(results[1][6], model[0].weight.grad, **MATMUL_TOL)



@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_with_symbolic_sizes_is_cached_and_serves_every_size(cache_dir, device):
    """A graph Dynamo traced with a symbolic batch is stored once; after a restart of Dynamo the hit serves
    sizes it never saw, with eager's results, and its outputs carry the dynamic-dim mark AOTAutograd's wrapper
    puts on them (so that a graph fed by them after a graph break stays dynamic)."""
    torch.manual_seed(0)
    model = _model().to(device)
    hits, outs = [], []
    for sizes in ((3, 5), (11, 7)):  # a miss at first sight of the symbolic graph, then a hit
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ember", dynamic=True, options={"fallback": "raise"})
        with torch.no_grad():
            report = ember.explain(model, dynamic=True)(torch.randn(sizes[0], 24, device=device))
            hits.append(report.cache_hits)
            for n in sizes:
                x = torch.randn(n, 24, device=device)
                out = compiled(x)
                torch.testing.assert_close(out, model(x), **MATMUL_TOL)
                outs.append(out)
    assert hits == [0, 1], hits
    assert len(ember.cache.entries()) == 1
    from torch._functorch._aot_autograd import runtime_wrappers

    mark = "_dynamo_propagated_dynamic_indices" if hasattr(
        runtime_wrappers, "mark_dynamo_propagated_dynamic_indices") else "_dynamo_weak_dynamic_indices"
    assert all(getattr(o, mark, None) == {0} for o in outs)


def test_without_torchs_marking_function_outputs_get_the_older_mark(cache_dir, monkeypatch):
    """Where AOTAutograd has no mark_dynamo_propagated_dynamic_indices, its wrapper marks
    `_dynamo_weak_dynamic_indices` instead; ember's direct call does the same (and still stores the graph)."""
    import ember.backend

    monkeypatch.setattr(ember.backend, "_dynamic_dims_marker", lambda: ember.backend._mark_weak_dynamic_indices)
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="ember", dynamic=True, options={"fallback": "raise"})
    with torch.no_grad():
        for n in (3, 6):
            x = torch.randn(n, 24)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), **MATMUL_TOL)
            assert out._dynamo_weak_dynamic_indices == {0}
    assert len(ember.cache.entries()) == 1


def test_a_symbolic_compile_that_adds_a_guard_is_not_stored(cache_dir, monkeypatch):
    """Where the compile itself guards on a symbolic size, a hit would skip that guard: nothing is stored."""
    import ember.backend

    compile_fx_graph = ember.backend.compile_fx_graph

    def guarding(gm, *args, **kwargs):
        sizes = [d for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
                 for d in n.meta["val"].shape if isinstance(d, torch.SymInt)]
        assert sizes
        bool(sizes[0] > 2)  # a guard on the ShapeEnv, as a size-dependent lowering would add
        return compile_fx_graph(gm, *args, **kwargs)

    monkeypatch.setattr(ember.backend, "compile_fx_graph", guarding)
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="ember", dynamic=True)
    with torch.no_grad():
        x = torch.randn(5, 24)
        torch.testing.assert_close(compiled(x), model(x), **MATMUL_TOL)
    assert ember.cache.entries() == []
