"""ember quickstart: compile a real model with torch.compile(backend="ember") and compare it with eager.

    python examples/quickstart.py                        # ResNet-18
    python examples/quickstart.py --model transformer    # nn.TransformerEncoderLayer

Both models need torch alone. ResNet-18 (the default) is the standard 18-layer residual network for 224x224
images, written out below (random weights, batch 8); --model transformer runs nn.TransformerEncoderLayer(d_model=256,
nhead=4) on a batch of 8 x 64 tokens. It runs on CUDA when available, else on the CPU, under torch.no_grad().
ember runs with options={"fallback": "raise"}, so a graph ember cannot compile is an error here rather than a
silent eager run. The first lines printed name the model that ran.

Prints the first-call (compile) time, eager and ember latency (median of individually timed calls, eager and
ember alternating, CUDA-synchronized on a GPU), the speedup and the max abs error against eager.
Exit status: 0 when ember's output matches eager's, 1 when the error is over tolerance, 2 when compiling fails.
"""

import argparse
import statistics
import sys
import time

import torch

import ember  # torch.compile finds backend="ember" through the package's entry point; this checks the install

WARMUP = 3
CALLS = {"cpu": 30, "cuda": 100}  # timed calls per backend (fewer on the CPU when a call is slow, see main)
TIME_BUDGET_S = 8.0  # per backend, on the CPU
RTOL = 1e-3  # max abs error allowed: RTOL * max(1, max |eager output|)


class BasicBlock(torch.nn.Module):
    """Two 3x3 convolutions with batch norms and a residual connection (a 1x1 convolution where the shape changes)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(num_classes=1000):
    """ResNet-18: a 7x7 stem, four stages of two BasicBlocks (64, 128, 256, 512 channels), pooling, a linear head."""
    nn = torch.nn
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def build(device, which):
    """(model, input, short name, description)."""
    torch.manual_seed(0)
    if which == "resnet18":
        model = resnet18()
        x = torch.randn(8, 3, 224, 224)
        short, name = "resnet18", "ResNet-18 (written in quickstart.py, random weights), input 8x3x224x224"
    else:
        # Eager nn.TransformerEncoderLayer would call one fused kernel (the "fast path") under no_grad, and so
        # would the graph ember gets. Turning the fast path off makes eager and ember run the layer as ops
        # (projections, scaled-dot-product attention, layer norms, feed-forward).
        torch.backends.mha.set_fastpath_enabled(False)
        model = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, batch_first=True)
        x = torch.randn(8, 64, 256)
        short = "TransformerEncoderLayer"
        name = "nn.TransformerEncoderLayer(d_model=256, nhead=4), input 8x64x256 (MHA fast path off)"
    return model.to(device).eval(), x.to(device), short, name


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, x, device):
    sync(device)
    start = time.perf_counter()
    out = fn(x)
    sync(device)
    return time.perf_counter() - start, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("resnet18", "transformer"), default="resnet18")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, x, short, name = build(device, args.model)
    where = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"ember {ember.__version__}, torch {torch.__version__}")
    print(f"device      {where}")
    print(f"model       {name}")

    compiled = torch.compile(model, backend="ember", options={"fallback": "raise"})
    with torch.no_grad():
        eager_time, expected = timed(model, x, device)  # also warms up eager
        try:
            compile_s, out = timed(compiled, x, device)
        except Exception as e:
            print(f"FAILED: ember could not compile the model: {type(e).__name__}: {e}")
            return 2
        for _ in range(WARMUP):
            model(x)
            compiled(x)
        calls = CALLS[device]
        if device == "cpu":
            calls = max(5, min(calls, int(TIME_BUDGET_S / max(eager_time, 1e-6))))
        eager_times, ember_times = [], []
        for _ in range(calls):  # alternate, so machine noise hits both alike
            eager_times.append(timed(model, x, device)[0])
            ember_times.append(timed(compiled, x, device)[0])

    eager_ms = 1e3 * statistics.median(eager_times)
    ember_ms = 1e3 * statistics.median(ember_times)
    error = (out - expected).abs().max().item()
    tolerance = RTOL * max(1.0, expected.abs().max().item())
    print(f"compile     {compile_s:.2f} s (first call)")
    print(f"eager       {eager_ms:.3f} ms (median of {calls})")
    print(f"ember       {ember_ms:.3f} ms (median of {calls})")
    print(f"speedup     {eager_ms / ember_ms:.2f}x")
    print(f"max abs err {error:.2e} (tolerance {tolerance:.1e})")
    ok = error <= tolerance  # False for NaN too
    summary = (f"{short} on {device}: ember {ember_ms:.3f} ms vs eager {eager_ms:.3f} ms "
               f"({eager_ms / ember_ms:.2f}x), compile {compile_s:.2f} s, max abs err {error:.1e}")
    print(("OK: " if ok else "FAILED (error over tolerance): ") + summary)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
