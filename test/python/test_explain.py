"""ember.explain reports graphs, fused kernels, ATen calls, fallbacks and the compile-time split."""

import re

import pytest
import torch
import torch.nn as nn

import ember
from helpers import DEVICES


def test_explain_reports_kernels_aten_calls_and_times():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32))
    x = torch.randn(4, 16)
    with torch.no_grad():
        report = ember.explain(model, options={"fallback": "raise"})(x)
    assert len(report.graphs) == 1 and not report.fallbacks
    g = report.graphs[0]
    assert g.kind == "inference" and g.fx_nodes >= 3
    # the matmul stays a library call: oneDNN with bias and ReLU fused when ember has it, else ATen's addmm
    if g.onednn:
        assert g.onednn == ["matmul f32 +bias relu"] and "aten::addmm" not in g.aten_ops
    else:
        assert g.aten_ops["aten::addmm"] == 1
    assert {"canonicalize", "dce", "cse", "epilogue", "fuse", "codegen", "plan"} <= set(g.timings)
    text = str(report)
    assert "1 graph(s) compiled" in text and "compile time" in text
    assert ("oneDNN  matmul f32 +bias relu" if g.onednn else "aten::addmm") in text


def test_explain_training_graphs_and_fused_kernels():
    def fn(x):
        return (x.sin() * 2 + 1).exp().sum(-1)

    x = torch.randn(8, 64, requires_grad=True)
    report = ember.explain(fn)(x)
    kinds = sorted(g.kind for g in report.graphs)
    assert kinds == ["backward", "forward"]  # the backward compiles with the forward (one C++ autograd function)
    assert all(g.kernels for g in report.graphs), str(report)


def test_explain_lists_fallbacks():
    def fn(x):
        return (x * 2).to(torch.float8_e4m3fnuz).to(torch.float32) + 1

    with pytest.warns(UserWarning, match="ember could not compile"):
        report = ember.explain(fn)(torch.randn(4))
    assert report.fallbacks and "float8_e4m3fnuz" in report.fallbacks[0][1]
    assert "ran eagerly" in str(report)


def test_explain_lists_control_flow_and_its_subgraphs():
    def fn(x):
        return torch.cond(x.sum() > 0, lambda x: (x.sin() * 2).exp(), lambda x: x.cos(), (x,)) * 2

    text = str(ember.explain(fn, options={"fallback": "raise"})(torch.randn(4, 8)))
    assert "1 graph(s) compiled (and 2 control flow subgraph(s))" in text, text
    assert "control cond (true: 1 step, false: 1 step)" in text, text
    assert re.search(r"g\d+_inference_true_graph_0: ", text) and "cpu fused group" in text, text


@pytest.mark.parametrize("device", DEVICES)
def test_profiler_names_ember_kernels(device):
    """torch.profiler shows each fused kernel (and each fast path ember runs instead of an ATen call) as an
    "ember::" event, beside the ATen calls the dispatcher records."""
    from torch.profiler import ProfilerActivity, profile

    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.LayerNorm(32), nn.Linear(32, 8)).to(device)
    x = torch.randn(4, 16, device=device)
    compiled = torch.compile(model, backend="ember", options={"fallback": "raise"})
    compiled(x).sum().backward()  # compiled here, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    names = [e.name for e in prof.events()]
    fused = [n for n in names if n.startswith(f"ember::{device} fused group")]
    assert fused, names  # SiLU and the layer norm: one kernel in the forward
