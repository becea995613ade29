"""ember.export -> package file -> ember.load (the C++ loader), against eager on fresh random inputs:
MLP, a small CNN, resnet18 (torchvision), TransformerEncoderLayer, a rotary embedding, a dynamic batch; input
validation; what the package records; the caller's model is left alone."""

import pytest
import torch
import torch.nn as nn

import ember
from helpers import DEVICES, MATMUL_TOL

from write_test_packages import SmallCnn, mlp, randomize_norm_stats


def export_and_load(tmp_path, model, example, device, **kwargs):
    model = model.eval().to(device)
    example = tuple(x.to(device) for x in example)
    path = tmp_path / "model.ember"
    info = ember.export(model, example, path, device=device, **kwargs)
    assert info["bytes"] == path.stat().st_size
    return model, ember.load(path, device)


def check_package(model, loaded, inputs, tol=MATMUL_TOL):
    with torch.no_grad():
        expected = model(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    got = loaded.run(list(inputs))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.device == e.device
        torch.testing.assert_close(g, e, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_mlp(tmp_path, device):
    model, loaded = export_and_load(tmp_path, mlp(), (torch.randn(8, 64),), device)
    check_package(model, loaded, (torch.randn(8, 64, device=device),))


@pytest.mark.parametrize("device", DEVICES)
def test_small_cnn(tmp_path, device):
    model, loaded = export_and_load(tmp_path, randomize_norm_stats(SmallCnn()), (torch.randn(2, 3, 16, 16),), device)
    check_package(model, loaded, (torch.randn(2, 3, 16, 16, device=device),))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_resnet18(tmp_path, device):
    torchvision = pytest.importorskip("torchvision")
    model, loaded = export_and_load(tmp_path, randomize_norm_stats(torchvision.models.resnet18()),
                                    (torch.randn(2, 3, 64, 64),), device)
    check_package(model, loaded, (torch.randn(2, 3, 64, 64, device=device),), tol=dict(atol=1e-3, rtol=1e-3))


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_encoder_layer(tmp_path, device):
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model, loaded = export_and_load(tmp_path, layer, (torch.randn(2, 10, 32),), device)
    check_package(model, loaded, (torch.randn(2, 10, 32, device=device),))


class Rotary(nn.Module):
    """q * cos + rotate_half(q) * sin over a transposed projection, as LLaMA's attention computes it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 128, bias=False)

    def forward(self, h, cos, sin):
        q = self.proj(h).view(h.shape[0], h.shape[1], 4, 32).transpose(1, 2)
        return q * cos + torch.cat((-q[..., 16:], q[..., :16]), dim=-1) * sin


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding(tmp_path, device):
    """The rotate_half pass's views (unflatten, expand, flatten) and mask run in the C++ loader too."""
    example = (torch.randn(2, 12, 64), torch.randn(1, 1, 12, 32), torch.randn(1, 1, 12, 32))
    model, loaded = export_and_load(tmp_path, Rotary(), example, device)
    check_package(model, loaded, tuple(torch.randn_like(x, device=device) for x in example))


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_batch_runs_every_batch_in_range(tmp_path, device):
    batch = torch.export.Dim("batch", min=1, max=64)
    model, loaded = export_and_load(tmp_path, mlp(), (torch.randn(8, 64),), device, dynamic_shapes=({0: batch},))
    for b in (1, 3, 8, 64):
        check_package(model, loaded, (torch.randn(b, 64, device=device),))
    with pytest.raises(ember.EmberError, match=r"65, outside the range \[1, 64\]"):
        loaded.run([torch.randn(65, 64, device=device)])


def test_inputs_are_validated(tmp_path):
    class TwoInputs(nn.Module):
        def forward(self, a, b):
            return a @ b.t() + 1

    batch = torch.export.Dim("batch", min=2, max=32)
    _, loaded = export_and_load(tmp_path, TwoInputs(), (torch.randn(4, 8), torch.randn(4, 8)), "cpu",
                                dynamic_shapes=({0: batch}, {0: batch}))
    assert loaded.run([torch.randn(5, 8), torch.randn(5, 8)])[0].shape == (5, 5)
    cases = [
        ([torch.randn(4, 8)], "takes 2 inputs, got 1"),
        ([torch.randn(4, 8), torch.randn(4, 8).double()], r"input 1 \(b\) must be Float, got Double"),
        ([torch.randn(4, 8), torch.randn(4, 9)], "dimension 1 must be 8, got 9"),
        ([torch.randn(4, 8), torch.randn(5, 8)], r"dimension 0 is 5, but \w+ is 4 in input 0 \(a\)"),
        ([torch.randn(4, 8), torch.randn(4)], "must have 2 dimensions"),
    ]
    for inputs, message in cases:
        with pytest.raises(ember.EmberError, match=message):
            loaded.run(inputs)


def test_non_contiguous_inputs_are_accepted(tmp_path):
    model, loaded = export_and_load(tmp_path, mlp(), (torch.randn(8, 64),), "cpu")
    check_package(model, loaded, (torch.randn(64, 8).t(),))


def test_exported_program_and_metadata(tmp_path):
    model = mlp().eval()
    ep = torch.export.export(model, (torch.randn(8, 64),))
    path = tmp_path / "ep.ember"
    ember.export(ep, (torch.randn(8, 64),), path)
    loaded = ember.load(path)
    meta = dict(loaded.metadata)
    assert meta["torch"] == torch.__version__ and meta["ember"] == ember.__version__
    assert meta["device"] == "cpu" and meta["kernel_images"] == "0"
    assert loaded.inputs == ["input: f32[8, 64]@cpu"]
    check_package(model, loaded, (torch.randn(8, 64),))


def test_export_leaves_the_model_alone_and_is_deterministic(tmp_path):
    model = mlp().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ember.export(model, (torch.randn(8, 64),), tmp_path / "a.ember")
    ember.export(model, (torch.randn(8, 64),), tmp_path / "b.ember")
    assert (tmp_path / "a.ember").read_bytes() == (tmp_path / "b.ember").read_bytes()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.device.type == "cpu"


def test_bad_files_raise_ember_error(tmp_path):
    ember.export(mlp().eval(), (torch.randn(8, 64),), tmp_path / "m.ember")
    data = (tmp_path / "m.ember").read_bytes()
    (tmp_path / "cut.ember").write_bytes(data[: len(data) // 2])
    with pytest.raises(ember.EmberError, match="truncated"):
        ember.load(tmp_path / "cut.ember")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    (tmp_path / "flip.ember").write_bytes(bytes(flipped))
    with pytest.raises(ember.EmberError, match="checksum"):
        ember.load(tmp_path / "flip.ember")
    with pytest.raises(ember.EmberError, match="cannot open"):
        ember.load(tmp_path / "missing.ember")
    with pytest.raises(ember.EmberError, match="exported for cpu"):
        ember.load(tmp_path / "m.ember", "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_package_embeds_the_kernels_for_this_gpu(tmp_path):
    """A fused CUDA graph's kernels travel in the package as cubins for this GPU's architecture (the C++
    test loads such packages in a fresh process, where only the package can supply them)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64)).eval().cuda()
    info = ember.export(model, (torch.randn(8, 64, device="cuda"),), tmp_path / "m.ember")
    assert info["kernel_images"] > 0
    loaded = ember.load(tmp_path / "m.ember", "cuda")
    major, minor = torch.cuda.get_device_capability()
    assert dict(loaded.metadata)["arch"] == f"sm_{major}{minor}"
    check_package(model, loaded, (torch.randn(8, 64, device="cuda"),))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_package_with_cuda_graphs_matches_eager_over_many_calls(tmp_path):
    """LoadOptions::reduce_overhead: the deployed model replays CUDA graphs; fresh inputs every call, and
    outputs kept from earlier calls keep their values."""
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64)).eval().cuda()
    ember.export(model, (torch.randn(8, 64, device="cuda"),), tmp_path / "m.ember")
    loaded = ember.load(tmp_path / "m.ember", "cuda", reduce_overhead=True)
    kept = []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 64, device="cuda")
            kept.append((loaded.run([x])[0], model(x)))
    for out, expected in kept:
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_reduce_overhead_on_a_cpu_package_is_a_clear_error(tmp_path):
    model = nn.Linear(4, 4).eval()
    ember.export(model, (torch.randn(2, 4),), tmp_path / "m.ember")
    with pytest.raises(ember.EmberError, match="needs a CUDA device"):
        ember.load(tmp_path / "m.ember", "cpu", reduce_overhead=True)
