"""Convolutions in channels_last (python_bindings/ember/layout.py): the Dynamo-graph rewrite keeps every value
and eager's output strides; through ember on a GPU, resnet-like blocks in f32 and bf16 match eager; on the
CPU, inference graphs read channels-last activations with NCHW weights packed once, training graphs read them
too, their eval-mode batch norms fused forward and backward."""

import pytest
import torch
import torch.nn as nn

import helpers
from ember.layout import channels_last_convolutions
from helpers import assert_same, check, compile_ember


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def net(c=8):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), Block(c), Block(c))
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
    return m.eval()


def rewritten_backend(counts):
    def backend(gm, example_inputs):
        counts.append(channels_last_convolutions(gm, force=True))
        return gm.forward

    return backend


def test_rewrite_keeps_values_and_output_strides_cpu():
    m = net()
    counts = []
    compiled = torch.compile(m, backend=rewritten_backend(counts))
    x = torch.randn(2, 3, 11, 9)
    with torch.no_grad():
        expected, actual = m(x), compiled(x)
    assert counts == [5]  # five convolutions now read channels_last tensors
    assert_same(actual, expected, atol=1e-5, rtol=1e-4)
    assert actual.stride() == expected.stride()  # the NCHW output comes back NCHW


def test_rewrite_leaves_graphs_with_one_convolution_cpu():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    counts = []
    compiled = torch.compile(m, backend=rewritten_backend(counts))
    with torch.no_grad():
        compiled(torch.randn(1, 3, 8, 8))
    assert counts == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_resnet_blocks_through_ember_cuda(dtype):
    m = net(16).to("cuda", dtype)
    x = torch.randn(4, 3, 14, 14, device="cuda", dtype=dtype)
    compiled = compile_ember(m)
    with torch.no_grad():
        expected, actual = m(x), compiled(x)
    atol, rtol = (1e-3, 1e-3) if dtype == torch.float32 else (5e-2, 5e-2)
    assert_same(actual, expected, atol=atol, rtol=rtol)
    assert actual.stride() == expected.stride()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resnet_blocks_training_step_cuda():
    m = net(16).train().to("cuda")
    ref = net(16).train().to("cuda")
    ref.load_state_dict(m.state_dict())
    compiled = compile_ember(m)
    x = torch.randn(4, 3, 14, 14, device="cuda")
    compiled(x).square().mean().backward()
    ref(x).square().mean().backward()
    for (name, a), b in zip(m.named_parameters(), ref.parameters()):
        assert_same(a.grad, b.grad, atol=1e-3, rtol=1e-2), name


def _steps():
    return [what for _, g in helpers.EMBER_GRAPHS for _, what in g.steps()]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without mkldnn")
def test_cpu_inference_convolutions_read_channels_last_on_packed_weights():
    # The CPU rewrite changes the activations' layout only; the weights stay NCHW parameters, packed by the
    # convolution kernel from its second call on. A weight changed in place must be repacked.
    m = net(8)
    compiled = compile_ember(m)
    with torch.no_grad():
        for step in range(5):
            x = torch.randn(2, 3, 11, 9)
            expected, actual = m(x), compiled(x)
            assert_same(actual, expected, atol=1e-4, rtol=1e-3)
            assert actual.stride() == expected.stride()
            if step == 2:
                m[1].conv2.weight.mul_(-0.5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(x)
    steps = _steps()
    assert steps.count("aten::clone") == 2, steps  # the input to channels-last, the result back to NCHW
    assert not any(s == "aten::convolution" for s in steps) and sum("via torch" in s for s in steps) == 5, steps
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("mkldnn::_convolution_pointwise", 0) + calls.get("mkldnn::_convolution_pointwise_", 0) + \
        calls.get("mkldnn::_convolution_pointwise.binary", 0) == 5, calls  # torch's call, not ATen's fallback
    assert "aten::convolution" not in calls, calls


def test_cpu_training_graphs_run_convolutions_channels_last():
    # Batch norms in training mode: forward and gradients against eager on random inputs, the input converted to
    # channels-last and the result back to NCHW (the two copies), and no other.
    helpers.check(net(8).train(), torch.randn(2, 3, 11, 9), atol=1e-4, rtol=1e-3, grad_atol=1e-3, grad_rtol=1e-2)
    assert _steps().count("aten::clone") == 2, _steps()


def _graph_steps(kind):
    return [what for k, g in helpers.EMBER_GRAPHS if k == kind for _, what in g.steps()]


@pytest.mark.parametrize("c, size", [(8, 11), (24, 9), (200, 40)])
def test_cpu_training_of_eval_batch_norms_fuses_them_with_their_relus(c, size):
    # The zoo's training step: batch norms in eval mode, their parameters trained. Channels-last, each norm and
    # its ReLU are one multiply-add kernel forward, and the ReLU's and the norm's backwards one column-reduction
    # kernel (decompositions.py): no ATen batch norm either way. Gradients of the input and every parameter
    # against eager.
    m = net(c)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-0.5, 0.5)
    helpers.check(m, torch.randn(2, 3, size, size - 2), atol=1e-4, rtol=1e-3, grad_atol=1e-3, grad_rtol=1e-2)
    forward, backward = _graph_steps("forward"), _graph_steps("backward")
    assert not any("batch_norm" in s for s in forward + backward), (forward, backward)
    assert sum("column reductions" in s for s in backward) >= 4, backward


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("size", [1, (1, 1)])
def test_global_average_pools_train_without_restriding(device, size):
    # adaptive_avg_pool2d(x, 1) of a channels-last x: ATen's mean is restrided by as_strided_, whose backward is an
    # as_strided_scatter into zeros. Rewritten as the mean itself (layout.py), the backward is an expand and a
    # divide. Gradients against eager; a pooled result the graph returns is left alone, with eager's strides.
    torch.manual_seed(0)

    class Pooled(nn.Module):
        def __init__(self, returns_pool):
            super().__init__()
            self.conv1, self.conv2, self.fc = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 1)
            self.returns_pool = returns_pool

        def forward(self, x):
            y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
            pooled = nn.functional.adaptive_avg_pool2d(y, size)
            out = y * torch.sigmoid(self.fc(pooled))
            return (out, pooled) if self.returns_pool else out

    x = torch.randn(2, 4, 9, 10, device=device)
    helpers.check(Pooled(False).to(device).eval(), x, atol=1e-4, rtol=1e-3, grad_atol=1e-3, grad_rtol=1e-2)
    backward = _graph_steps("backward")
    assert backward and not any("as_strided" in s for s in backward), backward
    model = Pooled(True).to(device).eval()
    helpers.check(model, x, atol=1e-4, rtol=1e-3, grad_atol=1e-3, grad_rtol=1e-2)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert compile_ember(model)(x)[1].stride() == model(x)[1].stride()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_views_of_rewritten_convolutions_see_the_traced_layout(device):
    # `view(-1)` of a convolution's NCHW result fails on a channels_last tensor, and as_strided would read other
    # elements: the rewrite gives both their traced layout back (found by the graph fuzzer, seed 60872).
    w1 = torch.randn(4, 3, 3, 3, device=device) * 0.2
    w2 = torch.randn(4, 4, 3, 3, device=device) * 0.2

    def fn(x):
        y = torch.conv2d(torch.conv2d(x, w1), w2)
        return y.view(-1) * 2, y.as_strided((3, 5), (7, 1), 2) + 1

    x = torch.randn(2, 3, 11, 9, device=device)
    with torch.no_grad():
        expected, actual = fn(x), compile_ember(fn)(x)
    for a, e in zip(actual, expected):
        assert_same(a, e, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_writes_through_memory_the_rewrite_would_unshare_keep_eager_layouts(device):
    # `y.contiguous()` of an NCHW y is y itself, so mul_ doubles y too; after a channels_last rewrite it would be a
    # copy (fuzz seed 65959). Such a graph keeps its layouts, and one whose in-place writes touch nothing shared
    # (relu_ on a convolution's result) is still rewritten.
    w1 = torch.randn(4, 3, 1, 1, device=device) * 0.2
    w2 = torch.randn(2, 4, 2, 2, device=device) * 0.2

    def shared(x):
        y = torch.conv2d(x, w1, stride=2)
        z = torch.conv2d(y, w2, stride=2)
        y.contiguous().mul_(2)
        return z, torch.cat((y, y.flatten(1).unsqueeze(-1).unsqueeze(-1).reshape(y.shape)), dim=0)

    def unshared(x):
        y = torch.conv2d(x, w1).relu_()
        return torch.conv2d(y, w2).flatten(1) * 2

    x = torch.randn(2, 3, 7, 9, device=device)
    for fn, convs in ((shared, 0), (unshared, 2)):
        counts = []
        with torch.no_grad():
            torch._dynamo.reset()
            expected, rewritten = fn(x), torch.compile(fn, backend=rewritten_backend(counts))(x)
            actual = compile_ember(fn)(x)
        assert counts == [convs]
        for got in (rewritten, actual):
            for a, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
                assert_same(a, e, atol=1e-4, rtol=1e-3)


class DenseBlock(nn.Module):
    """densenet's pattern: every convolution reads the concatenation of all earlier features."""

    def __init__(self, c, layers):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c * (i + 1), c, 3, padding=1) for i in range(layers))

    def forward(self, x):
        features = [x]
        for conv in self.convs:
            features.append(conv(torch.cat(features, 1)))
        return torch.cat(features, 1)


def strided_1x1(c):
    """A 3x3 convolution, then a 1x1 one with a stride reading its c channels (a resnet downsample)."""
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 8, 1, stride=2))


def test_cpu_training_of_a_strided_1x1_convolution_over_few_channels_matches_eager():
    """torch's CPU convolution_backward over a channels_last input corrupted the heap for a 1x1 convolution with a
    stride over 5 channels (wrong gradients in about one draw of parameters in ten with two threads, an abort with
    one): such a graph stays NCHW (layout.pays_in_cpu_training). Several draws, each checked against eager."""
    for seed in range(12):
        torch.manual_seed(seed)
        torch._dynamo.reset()
        check(strided_1x1(5), torch.randn(2, 3, 8, 8), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("model, channels, size, pays", [
    (lambda: net(8), 3, 16, True),
    (lambda: net(64), 3, 4, False),  # 64 x 64 x 9 weights against 2 x 64 x 16 activations per convolution
    (lambda: DenseBlock(8, 4), 8, 16, False),
    (lambda: strided_1x1(16), 3, 16, True),
    (lambda: strided_1x1(5), 3, 16, False),  # torch's channels_last backward corrupts the heap there (layout.py)
], ids=["resnet_blocks", "weights_outweigh_activations", "concatenations", "strided_1x1", "strided_1x1_few_channels"])
def test_which_cpu_training_graphs_run_channels_last(model, channels, size, pays):
    from ember.layout import pays_in_cpu_training

    decisions = []

    def backend(gm, example_inputs):
        decisions.append(pays_in_cpu_training(gm))
        return gm.forward

    torch.compile(model(), backend=backend)(torch.randn(2, channels, size, size))
    assert decisions == [pays]
