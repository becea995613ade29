"""The compile cache (ember/cache.py): a graph compiled once comes back from disk, in this process after
torch._dynamo.reset() and in a fresh one, with the results of a fresh compile; a bad entry is a miss."""

import io
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


# Fuzzing the reader, as test/cpp/package_test.cpp fuzzes the package loader: real entries (a small model's and a
# graph with constants, each in inference and training) damaged thousands of ways. Each damaged entry is read as
# the next compile would read it (cache.load, then backend._from_cache: what _compile_graph does before it
# traces) without Dynamo, and a hit is compared with eager; a sample goes through torch.compile as well.

def _capture(fn, x, train):
    """One compile of fn through torch.compile: its entry's bytes and what reading it takes, the Dynamo graph, the
    example inputs and the compile's config as ember.backend._compile_graph got them."""
    import ember.backend

    seen = []
    original = ember.backend._compile_graph

    def spy(gm, example_inputs, config):
        seen.append((gm, list(example_inputs), config))
        return original(gm, example_inputs, config)

    ember.cache.clear()
    ember.backend._compile_graph = spy
    try:
        torch._dynamo.reset()
        with torch.set_grad_enabled(train):
            torch.compile(fn, backend="ember", options={"fallback": "raise"})(x)
    finally:
        ember.backend._compile_graph = original
    ((path, _),) = ember.cache.entries()
    ((gm, example_inputs, config),) = seen
    return dict(fn=fn, x=x, train=train, gm=gm, inputs=example_inputs, config=config, path=path,
                key=os.path.basename(path)[: -len(".entry")], good=open(path, "rb").read())


def _read(source, data):
    """The DirectCall the next compile of source's graph makes of `data` stored under its key, or None (a miss)."""
    import ember.backend

    with open(source["path"], "wb") as f:
        f.write(data)
    with torch.set_grad_enabled(source["train"]):
        entry = ember.cache.load(source["key"])
        if entry is None:
            return None
        return ember.backend._from_cache(source["gm"], source["inputs"], source["config"], entry)


def _mismatch(source, direct):
    """None where a hit gives what eager gives (the Dynamo graph run as it is) in two calls on fresh inputs (the
    parameters kept, as Dynamo passes them): outputs and, in training, every input's gradient. Else why not."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        inputs = [x if isinstance(x, torch.nn.Parameter) else
                  torch.randn(x.shape, dtype=x.dtype, generator=gen).requires_grad_(x.requires_grad)
                  for x in source["inputs"]]
        results = []
        for fn in (direct, source["gm"]):
            with torch.set_grad_enabled(source["train"]):
                outs = list(fn(*inputs))
                grads = []
                if source["train"]:
                    loss = sum((o * o).sum() for o in outs if o.requires_grad)
                    grads = torch.autograd.grad(loss, [x for x in inputs if x.requires_grad], allow_unused=True)
            results.append([o.detach() for o in outs] + list(grads))
        if len(results[0]) != len(results[1]):
            return f"{len(results[0])} results, eager {len(results[1])}"
        try:
            for got, expected in zip(*results):
                torch.testing.assert_close(got, expected, **MATMUL_TOL)
        except AssertionError as e:
            return str(e).strip().split("\n")[0]
    return None


def _byte_damage(good, rng):
    """(label, bytes): one byte changed at offsets spread over the file, a few bytes at once, truncations, more."""
    out = []
    parts = min(500, len(good))
    for part in range(parts):  # one offset in each 1/500 of the file
        at = rng.randrange(part * len(good) // parts, (part + 1) * len(good) // parts)
        out.append((f"byte {at} changed", good[:at] + bytes([good[at] ^ rng.randrange(1, 256)]) + good[at + 1:]))
    for _ in range(50):
        data = bytearray(good)
        for at in rng.sample(range(len(good)), rng.randrange(2, 6)):
            data[at] ^= 1 << rng.randrange(8)
        out.append(("bits flipped at " + ",".join(str(i) for i, (a, b) in enumerate(zip(data, good)) if a != b),
                    bytes(data)))
    lengths = {0, 1, 4, 22, 30, 64, len(good) // 2, len(good) - 22, len(good) - 1}
    lengths |= {rng.randrange(len(good)) for _ in range(50)}
    out += [(f"truncated to {n}", good[:n]) for n in sorted(lengths)]
    at = rng.randrange(len(good) - 64)
    out += [("64 bytes zeroed", good[:at] + bytes(64) + good[at + 64:]), ("garbage after it", good + b"\x00garbage"),
            ("twice over", good + good), ("every byte changed", bytes(b ^ 0x5A for b in good))]
    return out


def _ir_damage(ir, rng):
    """(label, IR text): lines deleted, doubled, swapped; characters deleted, inserted, replaced; dtypes, sizes,
    strides, devices, ops and operands changed; and a few changes of the whole text."""
    import re

    lines = ir.rstrip("\n").split("\n")
    out = []
    for i in range(len(lines)):
        out.append((f"line {i} deleted", "\n".join(lines[:i] + lines[i + 1:]) + "\n"))
        out.append((f"line {i} doubled", "\n".join(lines[:i + 1] + lines[i:]) + "\n"))
    for _ in range(4):
        i, j = sorted(rng.sample(range(len(lines)), 2))
        swapped = list(lines)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        out.append((f"lines {i} and {j} swapped", "\n".join(swapped) + "\n"))
    for _ in range(30):
        at, c = rng.randrange(len(ir)), rng.choice('%:,()[]{}@="\n 0123456789.-_aefisux')
        how = rng.choice(["deleted", "inserted", "replaced"])
        text = {"deleted": ir[:at] + ir[at + 1:], "inserted": ir[:at] + c + ir[at:],
                "replaced": ir[:at] + c + ir[at + 1:]}[how]
        out.append((f"character {at} {how} ({c!r})", text))
    dtypes = list(re.finditer(r"\b(f32|i64)\[", ir))
    for m in rng.sample(dtypes, min(6, len(dtypes))):
        dtype = rng.choice([d for d in ("f64", "f16", "bf16", "i64", "i32", "b8", "u8", "f31") if d != m.group(1)])
        out.append((f"dtype at {m.start()} {dtype}", ir[:m.start()] + dtype + ir[m.end(1):]))
    numbers = list(re.finditer(r"\d+", ir))
    for m in rng.sample(numbers, min(16, len(numbers))):
        n = rng.choice(["0", "1", str(int(m.group()) + 1), "-1", "9" * 20, ""])
        out.append((f"number at {m.start()} {m.group()} -> {n or 'nothing'}", ir[:m.start()] + n + ir[m.end():]))
    devices = list(re.finditer("@cpu", ir))
    for m in rng.sample(devices, min(3, len(devices))):
        device = rng.choice(["@cuda", "@cuda:7", "@meta", "@", "@xpu"])
        out.append((f"device at {m.start()} {device}", ir[:m.start()] + device + ir[m.end():]))
    ops = list(re.finditer(r"aten::[\w.]+", ir))
    for m in rng.sample(ops, min(5, len(ops))):
        op = rng.choice(["aten::relu", "aten::no_such_op", "aten::add.Tensor", "prim::constant", "aten::", "aten::mm"])
        out.append((f"op at {m.start()} {op}", ir[:m.start()] + op + ir[m.end():]))
    names = sorted(set(re.findall(r"%\w+", ir)))
    for _ in range(6):
        a, b = rng.sample(names, 2)
        out.append((f"a use of {a} reads {b}", re.sub(re.escape(a) + r"(?=[,)\]])", b, ir, count=1)))
    out += [("empty", ""), ("the signature alone", lines[0]), ("no return", "\n".join(lines[:-1])),
            ("returns nothing", "\n".join(lines[:-1] + ["  return ()"])), ("half", ir[: len(ir) // 2]),
            ("NULs", ir.replace("\n", "\0", 3)), ("other letters", ir.replace("%", "%é", 2)), ("twice", ir + ir),
            ("CRLF", ir.replace("\n", "\r\n"))]
    return out


_WRONG_VALUES = [None, 0, -1, 1 << 70, 1.5, True, "x", b"x", [], [None], [1.5], {}, {"a": 1}, (), torch.zeros(2),
                 torch.zeros(0, dtype=torch.int64)]

_HOLDS, _DIFFERS = "holds", "differs"

_CONSTANT_DAMAGE = [  # (label, change of the tensor, what its resealed entry must do)
    ("one longer", lambda t: torch.cat([t, t[:1]]), _HOLDS), ("one long", lambda t: t[:1].clone(), _HOLDS),
    ("0-d", lambda t: t[0].clone(), _HOLDS), ("2-d", lambda t: t.reshape(1, -1).clone(), _HOLDS),
    ("empty", lambda t: t[:0].clone(), _HOLDS), ("float", lambda t: t.float(), _HOLDS),
    ("int32", lambda t: t.int(), _HOLDS), ("bool", lambda t: t.bool(), _HOLDS),
    ("meta", lambda t: t.to("meta"), _HOLDS),
    ("strided", lambda t: torch.stack([t, t], 1)[:, 0], _HOLDS),
    ("at offset 1", lambda t: torch.cat([t[:1], t])[1:], _HOLDS),
    ("requiring grad", lambda t: t.float().requires_grad_(), _HOLDS), ("None", lambda t: None, _HOLDS),
    ("a list", lambda t: t.tolist(), _HOLDS), ("a Parameter", lambda t: torch.nn.Parameter(t.float()), _HOLDS),
    ("zeros", torch.zeros_like, _DIFFERS), ("plus 1000", lambda t: t + 1000, _DIFFERS),
    ("minus 100", lambda t: t - 100, _DIFFERS),
    ("reversed", lambda t: t.flip(0).contiguous(), _DIFFERS),
]


def _entry_damage(entry, rng):
    """(label, change, resealed) for damage inside a well-formed entry: change(e) edits a copy in place, or returns
    what replaces it; resealed: what the entry must do resealed (its checksum made to match, as a writer with a
    bug would store it): _HOLDS, a miss or eager's results, as the reader checks each field and how they agree;
    _DIFFERS, it is well-formed and means another graph (a constant's values), so a hit may give other results
    or raise, but not crash; None: not resealed. The IR's text is not: the C++ IR parser and passes take it as
    lowering wrote it (the checksum sees to that), and some malformed IR crashed them (the fuse pass, on a type
    with fewer strides than sizes or an op short of an argument)."""
    out = []

    def fields(where, get):  # each field of get(entry) missing, or of a wrong type
        def drop(e, name):
            del get(e)[name]

        for name in list(get(entry)):
            out.append((f"{where}{name} missing", lambda e, name=name: drop(e, name), _HOLDS))
            for v in _WRONG_VALUES:
                out.append((f"{where}{name} = {v!r:.40}", lambda e, name=name, v=v: get(e).update({name: v}),
                            _HOLDS))

    def update(**values):
        return lambda e: e.update(values)

    n = len(entry["pinned"])
    fields("", lambda e: e)
    for label, change in [
        ("not a dict", lambda e: list(e.items())),
        ("kind swapped", update(kind="training" if entry["kind"] == "inference" else "inference")),
        ("graphs empty", update(graphs=[])), ("graphs reversed", lambda e: e.update(graphs=e["graphs"][::-1])),
        ("graphs doubled", lambda e: e.update(graphs=e["graphs"] * 2)),
        ("graphs a tuple", lambda e: e.update(graphs=tuple(e["graphs"]))),
        ("a field more", update(more=torch.ones(3))),
        ("pinned all True", update(pinned=[True] * n)), ("pinned all False", update(pinned=[False] * n)),
        ("pinned short", update(pinned=[True] * (n - 1))), ("pinned long", update(pinned=[True] * (n + 1))),
        ("pinned ints", update(pinned=[1] * n)),
    ] + [(f"bump {b}", update(bump=b)) for b in ([0], [n - 1], [n], [99], [-1], list(range(n)), ["0"], [0.0])] + [
        (f"dynamic_dims {d}", update(dynamic_dims=d)) for d in (
            [(0, [0])], [(0, [1])], [(1, [0])], [(5, [0])], [(0, [9])], [(-1, [-1])], [0], [(0, 0)], [(0, [0], 1)])
    ]:
        out.append((label, change, _HOLDS))
    if "spec" in entry:
        fields("spec.", lambda e: e["spec"])
        saved, (layout, *_) = entry["spec"]["saved_checked"], entry["spec"]["tangents"]
        inputs = len(entry["spec"]["no_edge"])
        for label, values in [
            ("one saved more", dict(saved_checked=saved + 1)), ("one saved less", dict(saved_checked=saved - 1)),
            ("nothing saved", dict(saved_checked=0)),
            ("one saved unchecked", dict(saved_checked=saved - 1, saved_unchecked=1)),
            ("one unchecked more", dict(saved_unchecked=1)), ("unchecked -1", dict(saved_unchecked=-1)),
            ("no output needs grad", dict(output_requires_grad=[False])),
            ("two outputs need grad", dict(output_requires_grad=[True, True])),
            ("no outputs", dict(output_requires_grad=[])),
            ("no tangents", dict(tangents=[])), ("two tangents", dict(tangents=[layout, layout])),
            ("a tangent of other sizes", dict(tangents=[(-1, [3, 3], [3, 1])])),
            ("a tangent transposed", dict(tangents=[(-1, layout[1], layout[2][::-1])])),
            ("a tangent of stride 0", dict(tangents=[(-1, layout[1], [0] * len(layout[1]))])),
            ("a tangent of size -3", dict(tangents=[(-1, [-3], [1])])),
            ("a tangent of 2**40", dict(tangents=[(-1, [1 << 40], [1])])),
            ("a tangent contiguous", dict(tangents=[(0, [], [])])),
            ("a tangent channels_last", dict(tangents=[(2, [], [])])),
            ("a tangent of format 9", dict(tangents=[(9, [], [])])),
            ("a tangent (-1,)", dict(tangents=[(-1,)])), ("no_edge short", dict(no_edge=[False] * (inputs - 1))),
            ("no_edge long", dict(no_edge=[False] * (inputs + 1))), ("no_edge all True", dict(no_edge=[True] * inputs)),
            ("deterministic 5", dict(deterministic=5)), ("deterministic -1", dict(deterministic=-1)),
            ("a field more", dict(more=1)),
        ]:
            out.append((f"spec: {label}", lambda e, values=values: e["spec"].update(values), _HOLDS))
    for g, graph in enumerate(entry["graphs"]):
        def change_graph(f, g=g):
            return lambda e: e["graphs"].__setitem__(g, f(e["graphs"][g]))

        def change_constants(f, g=g):
            return change_graph(lambda x: dict(x, constants=f(x["constants"])), g)

        fields(f"graph {g} ", lambda e, g=g: e["graphs"][g])
        out += [(f"graph {g} {label}", change_graph(f), _HOLDS) for label, f in [
            ("not a dict", lambda x: list(x.items())), ("on CUDA", lambda x: dict(x, cuda=True)),
            ("fx_nodes -5", lambda x: dict(x, fx_nodes=-5)),
            ("pinned all True", lambda x: dict(x, pinned=[True] * len(x["pinned"]))),
            ("pinned short", lambda x: dict(x, pinned=x["pinned"][:-1])),
            ("pinned long", lambda x: dict(x, pinned=x["pinned"] + [True])),
        ]]
        out += [(f"graph {g} {label}", change_constants(f), _HOLDS) for label, f in [
            ("a constant more", lambda c: dict(c, more=torch.ones(3))),
            ("a constant named 1", lambda c: {1: torch.ones(3)}),
            ("constants a list", lambda c: list(c.values())),
        ]]
        if len(entry["graphs"]) == 2:
            other = entry["graphs"][1 - g]["ir"]
            out.append((f"graph {g} the other graph's IR", change_graph(lambda x: dict(x, ir=other)), None))
        for label, ir in _ir_damage(graph["ir"], rng):
            out.append((f"graph {g} IR: {label}", change_graph(lambda x, ir=ir: dict(x, ir=ir)), None))
        for name in graph["constants"]:
            out.append((f"graph {g} constant {name} missing",
                        change_constants(lambda c, name=name: {k: v for k, v in c.items() if k != name}), _HOLDS))
            for label, f, resealed in _CONSTANT_DAMAGE:
                out.append((f"graph {g} constant {name} {label}",
                            change_constants(lambda c, name=name, f=f: dict(c, **{name: f(c[name])})), resealed))
    return out


@pytest.mark.slow
def test_damaged_entries_are_misses_or_match_eager(cache_dir):
    """Each damage of a real entry (bytes changed or cut; inside the entry, fields missing or of other types, its
    IR text and constants changed, the spec and other fields disagreeing with the graphs; another graph's entry) is
    a miss, or a hit that gives eager's results in two calls; no exception escapes, and the process neither
    crashes nor hangs. Changed inside and then resealed (the checksum made to match, as a writer with a bug would
    store it), the same holds for what the reader checks field by field (see _entry_damage); an entry that is
    well-formed and means another graph (a constant's values, another graph's entry) may give other results, but
    must not crash ember or give the inputs autograd history."""
    import copy
    import faulthandler
    import random
    import time
    import warnings

    start = time.perf_counter()
    faulthandler.dump_traceback_later(600, exit=True)  # a hang: the stacks, then the process ends
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small gain nothing from threads and lose much to a busy machine
    sources = {
        "model inference": _capture(_model(), torch.randn(16, 24), False),
        "model training": _capture(_model(), torch.randn(16, 24, requires_grad=True), True),
        "constants inference": _capture(_indexed, torch.randn(13), False),
        "constants training": _capture(_indexed, torch.randn(13, requires_grad=True), True),
    }
    rng = random.Random(2026)
    failures, end_to_end = [], []
    counts = {"miss": 0, "hit": 0, "resealed hit that differs or raises": 0}

    def save(entry):
        buffer = io.BytesIO()
        torch.save(entry, buffer)
        return buffer.getvalue()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.load on damaged pickles warns of their protocol
            for name, source in sources.items():
                assert _mismatch(source, _read(source, source["good"])) is None, name  # the entry undamaged: a hit
                entry = torch.load(io.BytesIO(source["good"]), weights_only=True)
                # (label, bytes, whether a hit may give other results): every damage as it is on disk a miss or
                # eager's results; resealed, as _entry_damage says; another graph's entry under this key resealed
                # (a writer's bug) means that graph.
                cases = [(label, data, False) for label, data in _byte_damage(source["good"], rng)]
                for other, s in sources.items():
                    if other != name:
                        foreign = dict(torch.load(io.BytesIO(s["good"]), weights_only=True), key=source["key"])
                        cases += [(f"the entry of {other}", s["good"], False),
                                  (f"the entry of {other}, resealed under this key", save(_reseal(foreign)), True)]
                for label, change, resealed in _entry_damage(entry, rng):
                    damaged = copy.deepcopy(entry)
                    damaged = change(damaged) or damaged
                    cases.append((label, save(damaged), False))
                    if resealed is not None and type(damaged) is dict:
                        try:
                            cases.append((label + ", resealed", save(_reseal(damaged)), resealed == _DIFFERS))
                        except ValueError:  # it holds what no entry can (store() would not write it either)
                            pass
                for label, data, may_differ in cases:
                    try:
                        direct = _read(source, data)
                    except Exception as e:
                        failures.append(f"{name}, {label}: the read raised {type(e).__name__}: {e}"[:300])
                        continue
                    why = None
                    if direct is not None:
                        try:
                            why = _mismatch(source, direct)
                        except Exception as e:
                            why = f"the hit raised {type(e).__name__}: {e}"
                    if any(not x.is_leaf for x in source["inputs"]):
                        failures.append(f"{name}, {label}: an input got autograd history")
                        break
                    if why is None:
                        counts["hit" if direct is not None else "miss"] += 1
                        if len(end_to_end) < 8 and rng.random() < 0.002:
                            end_to_end.append((name, label, data))
                    elif may_differ:
                        counts["resealed hit that differs or raises"] += 1
                    else:
                        failures.append(f"{name}, {label}: {why}"[:300])
            # A sample through torch.compile: what was a miss above is a miss there, and eager's results.
            for name, label, data in end_to_end + [(n, "truncated", s["good"][:100]) for n, s in sources.items()]:
                source = sources[name]
                x = source["x"]
                expected_hit = _read(source, data) is not None
                report = _explain(source["fn"], x, train=source["train"])
                assert report.cache_hits == int(expected_hit), (name, label, str(report))
                torch._dynamo.reset()
                check(source["fn"], x.detach(), grad=source["train"], **MATMUL_TOL)
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(threads)
    total = sum(counts.values()) + len(failures)
    assert not failures, f"{len(failures)} of {total} damaged entries:\n" + "\n".join(failures[:40])
    assert counts["miss"] > total / 2 and total > 3000, counts
    print(f"{total} damaged entries ({len(end_to_end) + len(sources)} through torch.compile) in "
          f"{time.perf_counter() - start:.1f} s: {counts}")


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
