"""mode="max-autotune" and "max-autotune-no-cudagraphs": CUDA GEMMs time every candidate at their first calls, within
autotune_budget_s per graph (kernels/cuda/gemm.cpp, point 8), and every timed GEMM choice, in any mode, is kept in
<cache_dir>/gemm (kernels/cuda/gemm_record.h) so that a restarted process times nothing it timed before.

torch.compile takes a mode or options, not both: options={"autotune": True, "autotune_budget_s": ...} asks for the
tuning without a mode, and ember.config holds the settings a test needs beside a mode.

Without a GPU: the mode or option and the budget reach the C++ compile, the options are checked, CPU graphs tune
no GEMM and no launch. With
one: tuned graphs give eager's results on fresh inputs (every epilogue, every dtype, symbolic sizes); a second
process over the same cache folder times nothing and says so in ember.explain, damaged records are timed again, and
EMBER_CACHE_DIR=off keeps nothing; a spent budget leaves the default's choice; explain lists each problem's
candidates and winner. Each CUDA test uses GEMM sizes of its own: choices are made once per process.

Fused CUDA kernels' launches (kernels/cuda/launch_tuning.h) are tuned under autotune only: per kernel and call shape,
kept in <cache_dir>/launch. Tuned graphs of each kernel family (flat, softmax, layer norm, column sums; f32 and bf16)
give eager's results on fresh inputs, a shape is timed once, a warm start times none, a spent budget keeps plan_call's
launch, and the default mode times nothing.

Fused CPU kernels' threads (kernels/cpu/thread_tuning.h) are tuned under autotune only, per kernel and call shape, in
the process: every loop (flat, broadcast, long and short rows, columns) gives eager's results at its first call,
where it is timed, and later ones; symbolic sizes are timed per size up to 8; a spent budget and the default mode
time nothing.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
import ember._C
import ember.backend
from ember import EmberError
from helpers import EMBER_GRAPHS, MATMUL_TOL, assert_same

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
TOL = {torch.float32: MATMUL_TOL, torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=5e-2, rtol=3e-2)}
AUTOTUNE_MODES = ["max-autotune", "max-autotune-no-cudagraphs"]


@pytest.fixture
def settings(tmp_path, monkeypatch):
    """A cache folder of the test's own, and what a compile with a mode cannot take as options: fallback="raise",
    and linear_chain off (it would run these small MLPs as one kernel of its own, with no GEMM step to tune)."""
    monkeypatch.setattr(ember.config, "cache_dir", str(tmp_path))
    monkeypatch.setattr(ember.config, "fallback", "raise")
    monkeypatch.setattr(ember.config, "disable_passes", "linear_chain")
    return tmp_path


def _stats():
    return dict(ember._C.gemm_tuning_stats())


def _since(before):
    now = _stats()
    return {name: now[name] - before[name] for name in now}


def _mlp(width, dtype=torch.float32, device="cuda"):
    """Every GEMM epilogue: bias + ReLU and bias + tanh-GELU (cuBLASLt's epilogue), a plain bias, none."""
    return nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 3 * width),
                         nn.GELU(approximate="tanh"), nn.Linear(3 * width, width), nn.Linear(width, width, bias=False),
                         ).to(device, dtype)


def _tuned_lines(report):
    return [line for g in report.graphs for line in g.tuned]


# ---- the mode's way into C++ (no GPU needed)


def _compiles(monkeypatch):
    """The (autotune, autotune_budget_s) of each C++ compile from here on (backend._compile_ir's arguments)."""
    seen = []
    original = ember._C.compile

    def spy(*args, **kwargs):
        seen.append(args[7:9])
        return original(*args, **kwargs)

    monkeypatch.setattr(ember._C, "compile", spy)
    return seen


@pytest.mark.parametrize("mode, options, autotune", [
    (None, None, False), ("default", None, False), ("reduce-overhead", None, False), ("max-autotune", None, True),
    ("max-autotune-no-cudagraphs", None, True), (None, {"autotune": True}, True),
    (None, {"autotune": False}, False), (None, {"autotune": None}, False)])
def test_the_mode_or_option_reaches_the_compile(mode, options, autotune, monkeypatch):
    monkeypatch.setattr(ember.config, "fallback", "raise")
    seen = _compiles(monkeypatch)
    model = _mlp(12, device="cpu")
    compiled = torch.compile(model, backend="ember", mode=mode, options=options)
    with torch.no_grad():
        x = torch.randn(9, 12)
        assert_same(compiled(x), model(x), **MATMUL_TOL)
    assert seen and all(s == (autotune, 30) for s in seen), seen


def test_the_options_are_checked_before_tracing(monkeypatch):
    config = ember.backend.CompileConfig
    assert config(None, {"autotune": True, "autotune_budget_s": 5}).autotune_budget_s == 5
    assert config("max-autotune").autotune_budget_s == 30
    assert config("max-autotune", {"autotune": False}).autotune is False
    monkeypatch.setattr(ember.config, "autotune_budget_s", 7)
    assert config("max-autotune-no-cudagraphs").autotune_budget_s == 7
    for bad in (-1, "30", 1.5, True):
        with pytest.raises(EmberError, match="autotune_budget_s must be an integer >= 0"):
            config(None, {"autotune_budget_s": bad})
    with pytest.raises(EmberError, match="autotune must be a boolean"):
        config(None, {"autotune": "sometimes"})
    seen = _compiles(monkeypatch)
    x = torch.randn(4, 6)
    compiled = torch.compile(lambda x: (x @ x.t()).relu(), backend="ember",
                             options={"fallback": "raise", "autotune": True, "autotune_budget_s": 0})
    assert_same(compiled(x), (x @ x.t()).relu(), **MATMUL_TOL)
    assert seen == [(True, 0)]


def test_cpu_graphs_tune_no_cuda_gemm(settings):
    before = _stats()
    assert set(before) == {"timed", "autotuned", "from_disk", "refused", "over_budget"}
    model = _mlp(10, device="cpu")
    x = torch.randn(5, 10)
    with torch.no_grad():
        report = ember.explain(model, mode="max-autotune")(x)
    assert _tuned_lines(report) == [] and "tuned  " not in str(report)
    assert _since(before) == dict.fromkeys(before, 0)


@pytest.mark.parametrize("autotune", [False, True], ids=["default", "autotune"])
def test_cpu_matmuls_of_every_size_are_timed_under_autotune(autotune, settings):
    """On the CPU, max-autotune times oneDNN against ATen (and torch's oneDNN) for every matmul, where the default
    times only problems of 2**22 multiply-adds and more; results equal eager either way."""
    torch.manual_seed(0)
    width = 72 if autotune else 80  # problems of their own: each is timed once per process
    model = nn.Sequential(nn.Linear(width, 3 * width), nn.GELU(), nn.Linear(3 * width, width)).eval()
    compiled = torch.compile(model, backend="ember", options={"fallback": "raise", "autotune": autotune})
    before = len(ember._C.cpu_matmul_timings())
    with torch.no_grad():
        for _ in range(3):  # the weights are packed at their second sight, timed at the first oneDNN call
            x = torch.randn(24, width)
            assert_same(compiled(x), model(x), **MATMUL_TOL)
    timed = [line for line in ember._C.cpu_matmul_timings()[before:] if line.startswith("24x")]
    assert len(timed) == (2 if autotune else 0), timed


# ---- CUDA: tuning, the budget, explain


@cuda
@pytest.mark.parametrize("mode", AUTOTUNE_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tuned_graphs_match_eager(mode, dtype, settings):
    width = 40 + 8 * DTYPES.index(dtype) + (24 if mode == "max-autotune" else 0)
    model = _mlp(width, dtype)
    compiled = torch.compile(model, backend="ember", mode=mode)
    before = _stats()
    with torch.no_grad():
        for _ in range(4):  # the first call tunes (the warm-up before capture in max-autotune), later ones replay
            x = torch.randn(37, width, device="cuda", dtype=dtype)
            assert_same(compiled(x), model(x), **TOL[dtype])
    assert _since(before)["autotuned"] >= 4  # the four GEMMs' problems differ
    assert len(list((settings / "gemm").glob("*.bin"))) >= 4


@cuda
def test_symbolic_sizes_are_tuned_per_size(settings):
    model = _mlp(56)
    compiled = torch.compile(model, backend="ember", mode="max-autotune-no-cudagraphs", dynamic=True)
    before = _stats()
    with torch.no_grad():
        for rows in (19, 19, 43, 43, 43, 19):  # a size's plan is made at its second call
            x = torch.randn(rows, 56, device="cuda")
            assert_same(compiled(x), model(x), **MATMUL_TOL)
    assert _since(before)["autotuned"] >= 8


@cuda
def test_a_spent_budget_leaves_the_default_choice(settings, monkeypatch):
    """A budget of 0 seconds: nothing tuned beyond the default mode, as the setting beside a mode and as an option."""
    model = _mlp(88)
    x = torch.randn(21, 88, device="cuda")
    before = _stats()
    with torch.no_grad():
        with ember.config.patch(autotune_budget_s=0):
            report = ember.explain(model, mode="max-autotune-no-cudagraphs")(x)
        compiled = torch.compile(model, backend="ember", options={"autotune": True, "autotune_budget_s": 0})
        for _ in range(3):
            x = torch.randn(21, 88, device="cuda")
            assert_same(compiled(x), model(x), **MATMUL_TOL)
    spent = _since(before)
    assert spent["autotuned"] == 0 and spent["over_budget"] >= 4 and spent["timed"] >= 1, spent
    lines = _tuned_lines(report)
    assert lines and all("(default" in line for line in lines), lines


@cuda
def test_explain_lists_the_candidates_and_the_winner(settings):
    model = _mlp(104)
    with torch.no_grad():
        report = ember.explain(model, mode="max-autotune-no-cudagraphs")(
            torch.randn(29, 104, device="cuda"))
    lines = _tuned_lines(report)
    assert len(lines) >= 4, str(report)
    for line in lines:
        # "29x208x104 f32 +bias relu: lt#3 12.5 us (max-autotune); 40 timed: lt#3 12.5 us, lt#0 13.1 us, ...,
        # 30 more up to 80.2 us" (the fastest ten by GPU time)
        problem, rest = line.split(": ", 1)
        winner, candidates = rest.split("; ", 1)
        assert problem.startswith("29x") and " f32" in problem, line
        assert winner.endswith(" us (max-autotune)"), line
        timed, listed = candidates.split(" timed: ", 1)
        assert int(timed) >= 2, line
        names = [c.rsplit(" ", 2)[0] for c in listed.split(", ") if c.endswith(" us") and " more up to " not in c]
        assert 1 <= len(names) <= 10 and int(timed) >= len(names), line
        assert len(names) < 10 or any(n.startswith(("lt#", "lt_bias#")) for n in names), line  # 7 kernels at most
        assert winner.rsplit(" ", 3)[0] in names or int(timed) > 10, line
    assert "    tuned   29x" in str(report)


@cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_convolutions_run_with_cudnn_benchmark_and_match_eager(training, settings):
    """max-autotune runs a graph's CUDA convolutions (and their backward) with cuDNN's benchmark search, leaves the
    caller's torch.backends.cudnn.benchmark as it was, gives eager's results, and explain says so."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3, stride=2),
                          nn.Flatten(), nn.Linear(8 * 15 * 15, 10)).cuda()
    model.train(training)
    x = torch.randn(4, 3, 32, 32, device="cuda")
    assert not torch.backends.cudnn.benchmark
    if training:
        reference = [p.detach().clone() for p in model.parameters()]
        expected = model(x)
        expected.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference):
                p.copy_(r)
    compiled = torch.compile(model, backend="ember", mode="max-autotune-no-cudagraphs")
    with torch.set_grad_enabled(training):
        got = compiled(x)
        if not training:
            expected = model(x)
    assert_same(got, expected, atol=1e-3, rtol=1e-3)  # cuDNN's algorithms differ in rounding (TF32 off)
    if training:
        got.sum().backward()
        for p, g in zip(model.parameters(), grads):
            assert_same(p.grad, g, atol=1e-3, rtol=1e-3)
    assert not torch.backends.cudnn.benchmark
    torch._dynamo.reset()
    with torch.set_grad_enabled(training):
        report = ember.explain(model, mode="max-autotune-no-cudagraphs")(x)
    assert any("cuDNN's benchmark search" in line for line in _tuned_lines(report)), str(report)


# ---- CUDA: the disk, across processes

_SCRIPT = textwrap.dedent("""
    import json, sys, torch, ember
    mode = None if sys.argv[1] == "default" else sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(200, 136), torch.nn.ReLU(), torch.nn.Linear(136, 72)).cuda()
    ember.config.fallback = "raise"
    ember.config.disable_passes = "linear_chain"  # it would run the model as one kernel, no GEMM step to tune
    with torch.no_grad():
        report = ember.explain(model, mode=mode)(torch.randn(24, 200, device="cuda"))
        compiled = torch.compile(model, backend="ember", mode=mode)
        error = 0.0
        for _ in range(3):
            x = torch.randn(24, 200, device="cuda")
            error = max(error, (compiled(x) - model(x)).abs().max().item())
    lines = [line for g in report.graphs for line in g.tuned]
    print("RESULT", json.dumps({"stats": ember._C.gemm_tuning_stats(), "error": error, "lines": lines}))
""")


def _run_script(script, cache, max_error, *args, timeout=300):
    """`script` run in a fresh process over the cache folder `cache` (whole compiles off): its RESULT line, whose
    error against eager must be below `max_error`."""
    env = dict(os.environ, EMBER_CACHE_DIR=str(cache), EMBER_COMPILE_CACHE="0")
    run = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert result["error"] < max_error, result
    return result


def _run(mode, cache):
    return _run_script(_SCRIPT, cache, 1e-3, mode)


@cuda
@pytest.mark.parametrize("mode, counter", [("max-autotune", "autotuned"), ("max-autotune-no-cudagraphs", "autotuned"),
                                           ("default", "timed")])
def test_a_warm_start_times_nothing(mode, counter, tmp_path):
    cold = _run(mode, tmp_path)
    assert cold["stats"][counter] >= 2 and cold["stats"]["from_disk"] == 0, cold
    records = sorted((tmp_path / "gemm").glob("*.bin"))
    assert len(records) >= 2
    warm = _run(mode, tmp_path)
    assert warm["stats"]["timed"] == 0 and warm["stats"]["autotuned"] == 0, warm
    assert warm["stats"]["from_disk"] >= 2 and warm["stats"]["refused"] == 0, warm
    assert warm["lines"] and all("from disk" in line for line in warm["lines"]), warm["lines"]
    # Records cut short or overwritten with other bytes are misses: timed again, with eager's results.
    for i, record in enumerate(records):
        data = record.read_bytes()
        record.write_bytes(data[: len(data) // 2] if i % 2 else bytes(len(data)))
    damaged = _run(mode, tmp_path)
    assert damaged["stats"][counter] >= 2 and damaged["stats"]["from_disk"] == 0, damaged


@cuda
def test_the_cache_off_keeps_no_choice(tmp_path):
    for _ in range(2):
        result = _run("max-autotune-no-cudagraphs", "off")
        assert result["stats"]["autotuned"] >= 2 and result["stats"]["from_disk"] == 0, result


# ---- fused CUDA kernels' launches (kernels/cuda/launch_tuning.h)


def _launch_stats():
    return dict(ember._C.launch_tuning_stats())


def _launch_since(before):
    now = _launch_stats()
    return {name: now[name] - before[name] for name in now}


def _launch_lines(report):
    return [line for line in _tuned_lines(report) if line.startswith("fused group ")]


LAUNCH_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def _fused_case(name, dtype):
    """(function, inputs maker) of one kernel family: a flat group, a softmax and a layer norm (row groups), a column
    sum (a column group)."""
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    cases = {
        "flat": (lambda x, y: torch.sigmoid(x) * x + y, lambda: (randn(4096, 1000), randn(4096, 1000))),
        "softmax": (lambda x: torch.softmax(x * 0.125, -1), lambda: (randn(2048, 1024),)),
        "layernorm": (lambda x, b, w, c: F.layer_norm(x + b, (768,), w, c),
                      lambda: (randn(1024, 768), randn(768), randn(768), randn(768))),
        "columns": (lambda x: (x * 2.0).sum(0), lambda: (randn(1024, 768),)),
    }
    return cases[name]


FUSED_CASES = ["flat", "softmax", "layernorm", "columns"]
LAUNCH_DTYPES = [torch.float32, torch.bfloat16]


def test_cpu_graphs_tune_no_launch(settings):
    before = _launch_stats()
    assert set(before) == {"timed", "from_disk", "refused", "over_budget"}
    x = torch.randn(64, 100)
    report = ember.explain(lambda x: torch.softmax(x * 2, -1) + 1, mode="max-autotune")(x)
    assert _launch_lines(report) == []
    assert _launch_since(before) == dict.fromkeys(before, 0)


@cuda
@pytest.mark.parametrize("mode", AUTOTUNE_MODES)
@pytest.mark.parametrize("dtype", LAUNCH_DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_tuned_fused_kernels_match_eager(case, dtype, mode, settings):
    """Each call shape's launch is timed at its first call (max-autotune's warm-up before capture) and looked up
    after: later calls of the same shape time nothing, and every call gives eager's results on fresh inputs."""
    torch.manual_seed(0)
    fn, inputs = _fused_case(case, dtype)
    compiled = torch.compile(fn, backend="ember", mode=mode)
    before = _launch_stats()
    with torch.no_grad():
        args = inputs()
        assert_same(compiled(*args), fn(*args), **LAUNCH_TOL[dtype])
        first = _launch_since(before)
        assert first["timed"] >= 1 and first["from_disk"] == 0, first
        for _ in range(3):
            args = inputs()
            assert_same(compiled(*args), fn(*args), **LAUNCH_TOL[dtype])
    assert _launch_since(before) == first
    assert len(list((settings / "launch").glob("*.bin"))) >= 1


@cuda
@pytest.mark.parametrize("case", FUSED_CASES)
def test_explain_lists_each_launch_timed(case, settings):
    fn, inputs = _fused_case(case, torch.float32)
    with torch.no_grad():
        report = ember.explain(fn, mode="max-autotune-no-cudagraphs")(*inputs())
    lines = _launch_lines(report)
    assert lines, str(report)
    for line in lines:
        # "fused group 0 2048x1024 rows: w4 512t 264b 10.2 us (max-autotune); plan_call's w4 256t 528b 11.0 us;
        # 16 timed: w4 512t 264b 10.2 us, ..."
        shape, rest = line[len("fused group "):].split(": ", 1)
        winner, plan_call, timed = rest.split("; ", 2)
        assert winner.endswith(" us (max-autotune)"), line
        assert plan_call.startswith("plan_call's ") and plan_call.endswith(" us"), line
        count, listed = timed.split(" timed: ", 1)
        assert int(count) >= 2, line
        names = [c.rsplit(" ", 2)[0] for c in listed.split(", ") if c.endswith(" us") and " more up to " not in c]
        assert winner.rsplit(" ", 3)[0] in names or int(count) > 10, line
    assert "    tuned   fused group " in str(report)


@cuda
def test_symbolic_sizes_get_launches_tuned_per_size(settings):
    torch.manual_seed(0)
    fn = lambda x: torch.softmax(x * 0.125, -1)  # noqa: E731
    compiled = torch.compile(fn, backend="ember", options={"autotune": True}, dynamic=True)
    before = _launch_stats()
    seen = []
    with torch.no_grad():
        for rows in (512, 768, 512, 768):
            x = torch.randn(rows, 1024, device="cuda")
            assert_same(compiled(x), fn(x), **LAUNCH_TOL[torch.float32])
            seen.append(_launch_since(before)["timed"])
    assert seen[1] >= 2 and seen[1] > seen[0] and seen[3] == seen[1], seen


@cuda
def test_a_spent_budget_keeps_plan_calls_launch(settings):
    torch.manual_seed(0)
    fn, inputs = _fused_case("layernorm", torch.float32)
    before = _launch_stats()
    with torch.no_grad():
        with ember.config.patch(autotune_budget_s=0):
            report = ember.explain(fn, mode="max-autotune-no-cudagraphs")(*inputs())
        compiled = torch.compile(fn, backend="ember", options={"autotune": True, "autotune_budget_s": 0})
        for _ in range(3):
            args = inputs()
            assert_same(compiled(*args), fn(*args), **LAUNCH_TOL[torch.float32])
    spent = _launch_since(before)
    assert spent["timed"] == 0 and spent["over_budget"] >= 2, spent
    lines = _launch_lines(report)
    assert lines and all("(default: budget spent)" in line for line in lines), lines


@cuda
def test_the_default_mode_tunes_no_launch(settings):
    fn, inputs = _fused_case("softmax", torch.float32)
    before = _launch_stats()
    with torch.no_grad():
        report = ember.explain(fn)(*inputs())
        compiled = torch.compile(fn, backend="ember")
        args = inputs()
        assert_same(compiled(*args), fn(*args), **LAUNCH_TOL[torch.float32])
    assert report.graphs and report.graphs[0].kernels, str(report)
    assert _launch_lines(report) == []
    assert _launch_since(before) == dict.fromkeys(before, 0)
    assert not (settings / "launch").exists()


_LAUNCH_SCRIPT = textwrap.dedent("""
    import json, torch, ember
    import torch.nn.functional as F
    torch.manual_seed(0)
    ember.config.fallback = "raise"
    cases = [
        (lambda x, y: torch.sigmoid(x) * x + y, [(4096, 1000), (4096, 1000)]),
        (lambda x: torch.softmax(x * 0.125, -1), [(2048, 1024)]),
        (lambda x, b, w, c: F.layer_norm(x + b, (768,), w, c), [(1024, 768), (768,), (768,), (768,)]),
        (lambda x: (x * 2.0).sum(0), [(1024, 768)]),
    ]
    lines, error = [], 0.0
    with torch.no_grad():
        for fn, shapes in cases:
            for dtype in (torch.float32, torch.bfloat16):
                args = [torch.randn(*s, device="cuda", dtype=dtype) for s in shapes]
                report = ember.explain(fn, mode="max-autotune-no-cudagraphs")(*args)
                lines += [line for g in report.graphs for line in g.tuned if line.startswith("fused group ")]
                compiled = torch.compile(fn, backend="ember", mode="max-autotune-no-cudagraphs")
                for _ in range(2):
                    args = [torch.randn(*s, device="cuda", dtype=dtype) for s in shapes]
                    got, expected = compiled(*args).float(), fn(*args).float()
                    error = max(error, ((got - expected).abs().max() / (1 + expected.abs().max())).item())
    print("RESULT", json.dumps({"stats": ember._C.launch_tuning_stats(), "error": error, "lines": lines}))
""")


def _run_launches(cache):
    return _run_script(_LAUNCH_SCRIPT, cache, 1e-2, timeout=600)


@cuda
def test_a_warm_start_tunes_no_launch(tmp_path):
    cold = _run_launches(tmp_path)
    assert cold["stats"]["timed"] >= 8, cold["stats"]  # (a second compile of a case may read the first one's records)
    records = sorted((tmp_path / "launch").glob("*.bin"))
    assert len(records) >= 8
    warm = _run_launches(tmp_path)
    assert warm["stats"]["timed"] == 0 and warm["stats"]["refused"] == 0, warm["stats"]
    assert warm["stats"]["from_disk"] >= 8, warm["stats"]
    assert warm["lines"] and all("from disk" in line for line in warm["lines"]), warm["lines"]
    # Records cut short or overwritten with zeros are misses: timed again, with eager's results.
    for i, record in enumerate(records):
        data = record.read_bytes()
        record.write_bytes(data[: len(data) // 2] if i % 2 else bytes(len(data)))
    damaged = _run_launches(tmp_path)
    assert damaged["stats"]["timed"] >= 8, damaged["stats"]


# ---- fused CPU kernels' threads (kernels/cpu/thread_tuning.h)

CPU_AUTOTUNE = {"autotune": True, "fallback": "raise"}


@pytest.fixture(autouse=True)
def _cache_of_its_own(tmp_path, monkeypatch):
    """Every test here keeps its timed choices in a folder of its own: CPU choices, like GEMM ones, are read back
    from <cache_dir> by any later kernel of the same program and shape, in this process or another."""
    monkeypatch.setattr(ember.config, "cache_dir", str(tmp_path / "cache"))


def _thread_lines(lines):
    return [line for line in lines if line.startswith("cpu fused group ")]


def _compiled_thread_lines():
    """The thread lines of every graph compiled in this test (conftest.py's EMBER_GRAPHS), read now."""
    return _thread_lines(line for _, graph in EMBER_GRAPHS for line in graph.tuning())


def _cpu_case(name):
    """(function, inputs maker, the line's shape, tolerance) of each loop a fused CPU kernel runs: a flat group read
    in place and one with a broadcast input (whose dims the flat loop merges: [8, 32000]), a softmax over long rows
    and over short rows (blocks of rows), a column sum. Each is large enough for two threads' work."""
    cases = {
        "flat": (lambda x, y: torch.sigmoid(x) * x + y, [(512, 1000), (512, 1000)], "512000 elements", {}),
        "broadcast": (lambda x, y: torch.sigmoid(x * y) + y, [(8, 64, 500), (64, 500)], "256000 elements", {}),
        "softmax": (lambda x: torch.softmax(x * 0.125, -1), [(512, 1024)], "512x1024 rows", dict(atol=1e-5, rtol=1e-4)),
        "short_rows": (lambda x: torch.softmax(x * 2.0, -1), [(20000, 10)], "20000x10 rows in blocks",
                       dict(atol=1e-5, rtol=1e-4)),
        "columns": (lambda x: (x * 2.0).sum(0), [(4096, 256)], "4096x256 columns", MATMUL_TOL),
    }
    fn, shapes, what, tol = cases[name]
    return fn, lambda: [torch.randn(*s) for s in shapes], what, tol


CPU_CASES = ["flat", "broadcast", "softmax", "short_rows", "columns"]


def _assert_timed(line, what):
    """A line of a shape large enough for several threads: timed where ATen has several, else not."""
    assert f" {what} on {torch.get_num_threads()} thread" in line, line
    if torch.get_num_threads() > 1:
        assert "(max-autotune); timed: default " in line and ", at most 1 thread " in line, line
    else:
        assert line.endswith("default (one thread's work: not timed)"), line


@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_kernels_tuned_for_threads_match_eager(case):
    """The first call times the kernel's run with 1, 2, 4, ... threads on the call's own buffers, and its results are
    the run's with the winner; later calls run with the winner and time nothing."""
    fn, inputs, what, tol = _cpu_case(case)
    compiled = torch.compile(fn, backend="ember", options=CPU_AUTOTUNE)
    for call in range(3):
        args = inputs()
        torch.testing.assert_close(compiled(*args), fn(*args), **tol)
        lines = _compiled_thread_lines()
        assert len(lines) == 1, lines  # one kernel, one shape: timed once
        if call == 0:
            first = lines
    _assert_timed(lines[0], what)
    assert lines == first


def test_cpu_symbolic_sizes_tune_threads_per_size():
    fn = lambda x: torch.softmax(x * 0.5, -1) + 1.0  # noqa: E731
    compiled = torch.compile(fn, backend="ember", options=CPU_AUTOTUNE, dynamic=True)
    sizes = (300, 300, 700, 1100, 700, 300, 1100)
    for rows in sizes:
        x = torch.randn(rows, 512)
        torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-4)
    assert len(EMBER_GRAPHS) == 1  # one symbolic graph for every size
    lines = _compiled_thread_lines()
    assert len(lines) == 3, lines  # each size timed once, in the order met
    for line, rows in zip(lines, (300, 700, 1100)):
        assert line.startswith(f"cpu fused group 0 {rows}x512 rows on "), line
        _assert_timed(line, f"{rows}x512 rows")


def test_cpu_symbolic_sizes_past_eight_run_with_the_default():
    fn = lambda x: torch.sigmoid(x) * 3.0 - x  # noqa: E731
    compiled = torch.compile(fn, backend="ember", options=CPU_AUTOTUNE, dynamic=True)
    sizes = [64 + 8 * i for i in range(12)]
    for rows in sizes + sizes[::-1]:
        x = torch.randn(rows, 700)
        torch.testing.assert_close(compiled(x), fn(x))
    lines = _compiled_thread_lines()
    assert [line.split(" on ")[0] for line in lines] == [f"cpu fused group 0 {n * 700} elements" for n in sizes[:8]]


def test_explain_lists_a_thread_line_per_cpu_kernel_shape():
    fn = lambda x: (torch.softmax(x * 2.0, -1), (x * 3.0).sum(0))  # noqa: E731
    x = torch.randn(2048, 256)
    report = ember.explain(fn, options=CPU_AUTOTUNE)(x)
    kernels = [k for g in report.graphs for k in g.kernels]
    lines = _thread_lines(_tuned_lines(report))
    assert len(kernels) == 2 and len(lines) == 2, (kernels, lines)
    _assert_timed(lines[0], "2048x256 rows")
    _assert_timed(lines[1], "2048x256 columns")
    assert all(f"    tuned   {line}" in str(report) for line in lines)


def _two_calls_then_explain(case, **how):
    """Two calls of `case` compiled as `how` says (mode= or options=), each against eager, then explain's report of
    the same compile afresh."""
    fn, inputs, _, tol = _cpu_case(case)
    compiled = torch.compile(fn, backend="ember", **how)
    for _ in range(2):
        args = inputs()
        torch.testing.assert_close(compiled(*args), fn(*args), **tol)
    return ember.explain(fn, **how)(*inputs())


def test_a_spent_budget_times_no_cpu_threads():
    options = dict(CPU_AUTOTUNE, autotune_budget_s=0)
    for case in CPU_CASES:
        what = _cpu_case(case)[2]
        lines = _thread_lines(_tuned_lines(_two_calls_then_explain(case, options=options)))
        assert len(lines) == 1 and f" {what} on " in lines[0], lines
        assert lines[0].endswith(": default (default: budget spent)"), lines  # no "timed:"
    lines = _compiled_thread_lines()
    assert len(lines) == 2 * len(CPU_CASES) and all(line.endswith("(default: budget spent)") for line in lines), lines


@pytest.mark.parametrize("mode", [None, "default", "reduce-overhead"])
def test_the_default_mode_times_no_cpu_threads(mode, monkeypatch):
    monkeypatch.setattr(ember.config, "fallback", "raise")
    for case in CPU_CASES:
        report = _two_calls_then_explain(case, mode=mode)
        assert report.graphs and _tuned_lines(report) == [] and "tuned   " not in str(report)
    assert len(EMBER_GRAPHS) == 2 * len(CPU_CASES) and _compiled_thread_lines() == []


# ---- CPU choices on disk, across processes (kernels/cpu/choice_record.h)

_CPU_SCRIPT = textwrap.dedent("""
    import json, sys, torch, ember
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512)
    fn = lambda x: torch.softmax(linear(x), -1) * 3.0 + 1.0
    options = {"autotune": True, "fallback": "raise"}
    with torch.no_grad():
        report = ember.explain(fn, options=options)(torch.randn(2048, 256))
        compiled = torch.compile(fn, backend="ember", options=options)
        error = 0.0
        for _ in range(3):
            x = torch.randn(2048, 256)
            error = max(error, (compiled(x) - fn(x)).abs().max().item())
    lines = [line for g in report.graphs for line in g.tuned]
    print("RESULT", json.dumps({"stats": ember._C.cpu_tuning_stats(), "error": error, "lines": lines,
                                "matmuls": ember._C.cpu_matmul_timings()}))
""")


def _run_cpu(cache):
    return _run_script(_CPU_SCRIPT, cache, 1e-5)


def test_a_warm_start_times_no_cpu_choice(tmp_path):
    """A CPU matmul's library and, under max-autotune, a fused kernel's threads are timed once per host: a later
    process reads them from <cache_dir>/cpu. A damaged record is a miss, timed again."""
    several = torch.get_num_threads() > 1  # with one thread, a fused kernel has no count to choose
    cold = _run_cpu(tmp_path)
    # explain's compile times (and writes); the compile after it, in the same process, reads the kernel's record
    assert cold["stats"]["timed"] == 1 + several and cold["stats"]["from_disk"] == several, cold
    assert not any("from disk" in line for line in cold["matmuls"] + cold["lines"]), cold
    records = sorted((tmp_path / "cpu").glob("*.bin"))
    assert len(records) == 1 + several
    warm = _run_cpu(tmp_path)
    assert warm["stats"]["timed"] == 0 and warm["stats"]["refused"] == 0, warm
    assert warm["stats"]["from_disk"] == 1 + 2 * several, warm
    assert len(warm["matmuls"]) == 1 and warm["matmuls"][0].endswith("(from disk)"), warm["matmuls"]
    if several:
        assert sum("(max-autotune, from disk)" in line for line in warm["lines"]) == 1, warm["lines"]
    for i, record in enumerate(records):
        data = record.read_bytes()
        record.write_bytes(data[: len(data) // 2] if i % 2 else bytes(len(data)))
    damaged = _run_cpu(tmp_path)
    assert damaged["stats"]["timed"] == 1 + several and damaged["stats"]["from_disk"] == several, damaged


def test_the_cache_off_keeps_no_cpu_choice():
    for _ in range(2):
        result = _run_cpu("off")
        assert result["stats"]["from_disk"] == 0 and result["stats"]["timed"] >= 1, result


# ---- attention kernels (attention_tuning.py)

def _attention_stats():
    from ember import attention_tuning

    return dict(attention_tuning.stats)


ATTENTION_CASES = {  # (q / k / v sizes, mask sizes or None, is_causal)
    "plain": ((2, 8, 256, 64), None, False),
    "bool mask": ((2, 8, 256, 64), (2, 1, 256, 256), False),
    "causal": ((2, 4, 384, 128), None, True),
}


def _attention_args(case, dtype, training):
    sizes, mask, _ = ATTENTION_CASES[case]
    qkv = [torch.randn(*sizes, device="cuda", dtype=dtype, requires_grad=training) for _ in range(3)]
    masks = [torch.rand(*mask, device="cuda") > 0.2] if mask else []
    return qkv + masks


def _attention_fn(case):
    causal = ATTENTION_CASES[case][2]

    def fn(q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, is_causal=causal) * 2.0

    return fn


@cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_kernels_are_timed_and_match_eager(case, dtype, training, settings):
    """Each kernel that takes the call is timed once; the compiled graph, whichever won, gives eager's results."""
    fn = _attention_fn(case)
    before = _attention_stats()
    compiled = torch.compile(fn, backend="ember", mode="max-autotune-no-cudagraphs")
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    for _ in range(2):
        args = _attention_args(case, dtype, training)
        with torch.set_grad_enabled(training):
            got = compiled(*args)
            expected = fn(*args)
        assert_same(got, expected, **tol)
        if training:
            grad = torch.randn_like(got)
            got_grads = torch.autograd.grad(got, args[:3], grad)
            expected_grads = torch.autograd.grad(expected, args[:3], grad)
            assert_same(got_grads, expected_grads, what="gradient", **tol)
    timed = _attention_stats()["timed"] - before["timed"]
    assert timed == 1, _attention_stats()


@cuda
def test_explain_lists_the_attention_candidates_and_the_winner(settings):
    args = _attention_args("bool mask", torch.bfloat16, False)
    with torch.no_grad():
        report = ember.explain(_attention_fn("bool mask"), mode="max-autotune-no-cudagraphs")(*args)
    assert len(report.attention) == 1, str(report)
    line = report.attention[0]
    assert line.startswith("attention (2, 8, 256, 64) bfloat16, mask (2, 1, 256, 256) bool: "), line
    assert "(max-autotune)" in line and "efficient" in line and "math" in line, line
    assert f"- tuned {line}" in str(report)


@cuda
def test_a_spent_budget_keeps_the_default_attention_kernel(settings):
    args = _attention_args("plain", torch.bfloat16, False)
    before = _attention_stats()
    with torch.no_grad():
        report = ember.explain(_attention_fn("plain"), options={"autotune": True, "autotune_budget_s": 0})(*args)
    assert _attention_stats()["timed"] == before["timed"], _attention_stats()
    assert len(report.attention) == 1 and report.attention[0].endswith("(default: budget spent)"), report.attention


def test_cpu_graphs_tune_no_attention(settings):
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    before = _attention_stats()
    compiled = torch.compile(F.scaled_dot_product_attention, backend="ember", mode="max-autotune-no-cudagraphs")
    with torch.no_grad():
        assert_same(compiled(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert _attention_stats() == before


def test_attention_records_round_trip_and_damage_is_a_miss(settings):
    from ember import attention_tuning

    key, candidates = repr(("attention", "a signature")), ["cudnn", "efficient", "math"]
    assert attention_tuning._read_record(key, candidates) is None
    attention_tuning._write_record(key, "efficient", {"cudnn": 0.02, "efficient": 0.01, "math": -1.0})
    assert attention_tuning._read_record(key, candidates) == "efficient"
    assert attention_tuning._read_record(key, ["cudnn", "math"]) is None  # a winner that is no candidate now
    assert attention_tuning._read_record(repr(("attention", "another")), candidates) is None
    path = attention_tuning._record_path(key)
    assert path.startswith(str(settings / "attention"))
    data = open(path, "rb").read()
    for damaged in (data[: len(data) // 2], bytes(len(data)), data.replace(key.encode(), b"x")):
        with open(path, "wb") as f:
            f.write(damaged)
        assert attention_tuning._read_record(key, candidates) is None


_ATTENTION_SCRIPT = textwrap.dedent("""
    import json, torch, ember, torch.nn.functional as F
    from ember import attention_tuning
    ember.config.fallback = "raise"
    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    error, lines = 0.0, []
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype) for _ in range(3))
            mask = torch.rand(2, 1, 256, 256, device="cuda") > 0.2
            lines += ember.explain(fn, mode="max-autotune-no-cudagraphs")(q, k, v, mask).attention
            compiled = torch.compile(fn, backend="ember", mode="max-autotune-no-cudagraphs")
            for got, expected in zip(compiled(q, k, v, mask), fn(q, k, v, mask)):
                error = max(error, (got.float() - expected.float()).abs().max().item())
    print("RESULT", json.dumps({"stats": attention_tuning.stats, "error": error, "lines": lines}))
""")


@cuda
def test_a_warm_start_times_no_attention(tmp_path):
    cold = _run_script(_ATTENTION_SCRIPT, tmp_path, 5e-2)
    # explain's compile times each of the 4 calls; the compile after it reads their records
    assert cold["stats"]["timed"] == 4 and cold["stats"]["from_disk"] >= 4, cold
    records = sorted((tmp_path / "attention").glob("*.json"))
    assert len(records) == 4
    warm = _run_script(_ATTENTION_SCRIPT, tmp_path, 5e-2)
    assert warm["stats"]["timed"] == 0 and warm["stats"]["from_disk"] >= 8, warm
    assert all(line.endswith("(from disk)") for line in warm["lines"]), warm["lines"]
    for i, record in enumerate(records):
        data = record.read_bytes()
        record.write_bytes(data[: len(data) // 2] if i % 2 else bytes(len(data)))
    damaged = _run_script(_ATTENTION_SCRIPT, tmp_path, 5e-2)
    assert damaged["stats"]["timed"] == 4, damaged
