"""mode="reduce-overhead": CUDA graph capture and replay (cudagraph/ in C++), against eager.

Every test runs many calls with fresh input values, so a replay that reads stale inputs or hands out
memory a later replay overwrites shows up as a mismatch. GPU only; the plan analysis that decides what
is captured is tested without a GPU in test/cpp/cudagraph_test.cpp.
"""

import copy
import gc
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
import ember.backend
from helpers import EMBER_GRAPHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GRAPH_OPTIONS = {"fallback": "raise", "cudagraphs": True}


def compile_graphs(fn, dynamic=None, **options):
    return torch.compile(fn, backend="ember", dynamic=dynamic, options={**GRAPH_OPTIONS, **options})


def reports():
    return [g.cuda_graph_report() for _, g in EMBER_GRAPHS if g.cuda_graphs]


def replayed_calls():
    return sum(int(m) for r in reports() for m in re.findall(r"(\d+) replayed", r))


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()


@torch.no_grad()
def test_replays_match_eager_with_changing_inputs():
    model = mlp().eval()
    compiled = compile_graphs(model)
    for i in range(12):
        x = torch.randn(8, 32, device="cuda")
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert replayed_calls() >= 9, reports()


def test_reduce_overhead_mode(monkeypatch):
    monkeypatch.setattr(ember.config, "fallback", "raise")
    model = mlp().eval()
    compiled = torch.compile(model, backend="ember", mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 32, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert replayed_calls() >= 2, reports()


@torch.no_grad()
def test_held_outputs_are_never_overwritten():
    def f(x):
        return (x.sin() * 2).cos() + x

    compiled = compile_graphs(f)
    inputs = [torch.randn(1000, device="cuda") for _ in range(6)]
    outs = [compiled(x) for x in inputs]  # every output kept alive across later replays
    for x, y in zip(inputs, outs):
        torch.testing.assert_close(y, f(x))
    # A view of an output, too.
    view = compiled(inputs[0])[10:20]
    compiled(inputs[1])
    torch.testing.assert_close(view, f(inputs[0])[10:20])


@torch.no_grad()
def test_mark_step_begin_lets_replays_reuse_outputs():
    def f(x):
        return x.exp() + 1

    compiled = compile_graphs(f)
    x = torch.randn(256, device="cuda")
    for _ in range(3):
        compiled(x)
    held = compiled(x)
    expected = f(x)
    # Without a mark, a replay protects `held`.
    compiled(torch.randn(256, device="cuda"))
    torch.testing.assert_close(held, expected)
    # After the mark the caller declares `held` dead; results stay correct.
    torch.compiler.cudagraph_mark_step_begin()
    y = torch.randn(256, device="cuda")
    torch.testing.assert_close(compiled(y), f(y))


@torch.no_grad()
def test_shape_changes_record_new_graphs():
    model = mlp().eval()
    compiled = compile_graphs(model, dynamic=True)
    for _ in range(3):
        for batch in (3, 5, 9):
            x = torch.randn(batch, 32, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert any("3 captured" in r for r in reports()), reports()


@torch.no_grad()
def test_signature_limit_warns_once_and_stays_correct():
    model = mlp().eval()
    compiled = compile_graphs(model, dynamic=True, cudagraph_max_graphs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for batch in (2, 3, 4, 5, 6):
                x = torch.randn(batch, 32, device="cuda")
                torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    limit = [w for w in caught if "input signatures" in str(w.message)]
    assert len(limit) == 1, [str(w.message) for w in caught]


@torch.no_grad()
def test_signature_cap_evicts_the_least_recently_used():
    """At cudagraph_max_graphs signatures a new one evicts: a signature still warming up first (a size seen
    once never displaces a captured one), else the captured one used least recently. An output the caller
    still holds from an evicted graph keeps its value; ember.explain lists the sizes that hold graphs."""
    model = mlp().eval()
    compiled = compile_graphs(model, dynamic=True, cudagraph_max_graphs=2)

    def call(batch):
        x = torch.randn(batch, 32, device="cuda")
        out = compiled(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-4)
        return out, model(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in (3, 3, 3, 5, 5):  # both captured; 3 replayed once
            call(batch)
        held, expected = call(5)  # a replay of 5's graph, held across its eviction
        call(3)  # 3 is now the more recently used
        call(7)  # evicts 5 (captured, least recently used); 7 warms up
        call(11)  # evicts 7 (still warming up), not 3
        before = replayed_calls()
        call(3)
        assert replayed_calls() == before + 1, reports()  # 3 kept its graph
        for batch in (11, 11):  # captured, then replayed
            call(batch)
    torch.testing.assert_close(held, expected, atol=1e-5, rtol=1e-4)
    (report,) = reports()
    assert "signatures evicted" in report, report
    sizes = re.search(r"sizes captured: (.*)", report).group(1)
    assert sizes == "[3, 32]; [11, 32]", report


def test_item_in_the_middle_is_captured_piecewise(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)

    def f(x):
        a = (x.exp() + 1).log()
        s = (a > 0.7).sum().item()  # an int: Dynamo keeps it in the graph as an unbacked SymInt
        return (a * s).relu() + a.cos()

    compiled = compile_graphs(f)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(64, 33, device="cuda")
            torch.testing.assert_close(compiled(x), f(x), atol=1e-4, rtol=1e-4)
    text = "\n".join(reports())
    assert re.search(r"eager: step \d+ aten::_local_scalar_dense", text), text
    assert len(re.findall(r": captured", text)) >= 2, text
    assert replayed_calls() >= 4, text


def test_explain_shows_captured_parts():
    report = ember.explain(lambda x: (x.sin() + 1).relu(), options=GRAPH_OPTIONS)(torch.randn(16, device="cuda"))
    assert "cuda graphs on cuda:" in str(report), str(report)
    assert "captured" in str(report)


def _train(model, compiled, steps, batch, optimizer=True, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr) if optimizer else None
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr) if optimizer else None
    losses, ref_losses = [], []
    for step in range(steps):
        x = torch.randn(*batch, device="cuda")
        loss = compiled(x).pow(2).mean()
        loss.backward()
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        if optimizer:
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    return losses, ref_losses, ref


@pytest.mark.parametrize("optimizer", [True, False], ids=["sgd", "accumulate"])
def test_plain_training_loop(optimizer):
    torch.manual_seed(0)
    model = mlp()
    compiled = compile_graphs(model)
    losses, ref_losses, ref = _train(model, compiled, 12, (16, 32), optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)
        if not optimizer:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
    assert {k for k, _ in EMBER_GRAPHS} >= {"forward", "backward"}
    assert replayed_calls() >= 16, reports()


def test_training_with_batch_norm_updates_running_stats():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).cuda()
    compiled = compile_graphs(model)
    losses, ref_losses, ref = _train(model, compiled, 8, (4, 3, 8, 8), True, lr=0.01)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(model[1].running_mean, ref[1].running_mean, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var, atol=1e-4, rtol=1e-4)
    assert replayed_calls() >= 8, reports()


def test_dropout_draws_fresh_masks_and_backward_uses_them():
    p = 0.4

    def f(x):
        return F.dropout(x, p=p, training=True) * 3

    compiled = compile_graphs(f)
    masks = []
    for _ in range(8):
        x = torch.randn(4096, device="cuda", requires_grad=True)
        y = compiled(x)
        y.backward(torch.ones_like(y))
        kept = y != 0
        masks.append(kept)
        # The backward scales by the forward's mask: zero exactly where the output was dropped.
        assert torch.equal(x.grad != 0, kept)
        torch.testing.assert_close(y[kept], (x * 3 / (1 - p))[kept].detach())
        assert abs(kept.float().mean().item() - (1 - p)) < 0.05
    assert all(not torch.equal(masks[0], m) for m in masks[1:])
    assert replayed_calls() >= 10, reports()


@torch.no_grad()
def test_input_mutation_reaches_the_caller():
    def f(x, y):
        x.add_(1)
        return x * y

    compiled = compile_graphs(f)
    for _ in range(6):
        x, y = torch.randn(100, device="cuda"), torch.randn(100, device="cuda")
        x2 = x.clone()
        out = compiled(x, y)
        expected = f(x2, y)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x, x2)


@torch.no_grad()
def test_input_copy_nodes_follow_the_callers_tensors():
    """Contiguous inputs are copied by a memcpy node inside the graph whose source is repointed per call
    (cudagraph/replay.cpp): queued replays from alternating tensors, a tensor refilled in place, and a
    strided input (copied before the launch instead) all match eager."""
    def f(x, y):
        return (x.sin() * 2 + y).cos()

    compiled = compile_graphs(f)
    a, b = torch.randn(33, 7, device="cuda"), torch.randn(33, 7, device="cuda")
    y = torch.randn(33, 7, device="cuda")
    outs, expected = [], []
    for i in range(40):  # no synchronization: replays queue up while sources change
        x = a if i % 2 == 0 else b
        outs.append(compiled(x, y))
        expected.append(f(x, y))
        if i % 5 == 4:
            a.copy_(torch.randn_like(a))  # same address, new values
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e)
    report = "".join(reports())
    assert re.search(r"\((?:[1-9]\d*) by the graphs' own copy nodes\)", report), report
    xt = torch.randn(7, 33, device="cuda").t()  # strided: a new signature, copied before each launch
    for _ in range(4):
        xt = torch.randn(7, 33, device="cuda").t()
        torch.testing.assert_close(compiled(xt, y), f(xt, y))


@torch.no_grad()
def test_parameter_moved_to_new_memory_is_followed():
    model = nn.Linear(16, 16).cuda()
    compiled = compile_graphs(model)
    x = torch.randn(4, 16, device="cuda")
    for _ in range(3):
        compiled(x)
    for _ in range(3):
        model.weight.data = torch.randn(16, 16, device="cuda")  # same Parameter, new storage
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_replays_from_a_thread_new_to_cuda():
    # A replay launches through the driver API, and a thread that has not used CUDA has no current
    # context: the thread's first CUDA work here is the replay itself (its first input is the one the
    # main thread's last call copied, so not even the copy node changes).
    import threading

    model = mlp().eval()
    compiled = compile_graphs(model)
    xs = [torch.randn(8, 32, device="cuda") for _ in range(3)]
    for _ in range(4):
        compiled(xs[0])
    replayed = replayed_calls()
    results = []

    def work():
        try:
            with torch.no_grad():  # grad mode is per thread
                results.extend(compiled(x) for x in xs)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            results.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert len(results) == 3 and not any(isinstance(r, Exception) for r in results), results
    for x, got in zip(xs, results):
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-4)
    assert replayed_calls() >= replayed + 3, reports()


@torch.no_grad()
def test_guarded_call_still_checks_the_inputs_it_copies():
    # Dynamo's guards fix a static graph's input shapes, so ember's call skips re-checking the inputs it
    # reads in place; the ones it copies into the graph's buffers are checked still. Called past the
    # guards with another batch size, the call must not copy out of bounds.
    model = mlp().eval()
    handed = []

    def backend(gm, example_inputs):
        fn = ember.backend.ember_backend(gm, example_inputs, options=GRAPH_OPTIONS)
        handed.append((fn, list(example_inputs)))
        return fn

    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 32, device="cuda")
    for _ in range(4):
        compiled(x)
    (fn, example), = handed
    assert type(fn).__name__ == "DirectCall"
    params = {id(p) for p in model.parameters()}
    position = [i for i, t in enumerate(example) if id(t) not in params]
    assert len(position) == 1, [tuple(t.shape) for t in example]
    for batch in (8, 3, 8, 13):
        y = torch.randn(batch, 32, device="cuda")
        args = list(example)
        args[position[0]] = y
        (out,) = fn(*args)
        torch.testing.assert_close(out, model(y), atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_memory_does_not_grow_over_1000_calls():
    model = mlp().eval()
    compiled = compile_graphs(model)
    x = torch.randn(8, 32, device="cuda")
    for _ in range(20):
        compiled(x)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        out = compiled(x)
    del out
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() <= before, (before, torch.cuda.memory_allocated())


@torch.no_grad()
def test_graph_breaks_share_the_pool_and_stay_correct():
    def f(x):
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return y.cos() + x

    compiled = compile_graphs(f)
    outs, refs = [], []
    for _ in range(6):
        x = torch.randn(512, device="cuda")
        outs.append(compiled(x))
        refs.append(f(x))
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r)
    assert len(reports()) == 2, reports()
