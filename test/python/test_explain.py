"""ember.explain reports graphs, fused kernels, ATen calls, fallbacks and the compile-time split."""

import pytest
import torch
import torch.nn as nn

import ember


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
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,)) * 2

    with pytest.warns(UserWarning, match="ember could not compile"):
        report = ember.explain(fn)(torch.ones(4))
    assert report.fallbacks and "true_graph_0" in report.fallbacks[0][1]
    assert "ran eagerly" in str(report)
