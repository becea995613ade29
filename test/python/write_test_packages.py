"""Exports the deployment test models with ember.export and writes, next to each package, inputs and
the eager outputs for them: the C++ test (test/cpp/package_test.cpp, no Python in its process) loads
the packages with ember::load and compares.

    python3 test/python/write_test_packages.py DIR [--device cuda]
    EMBER_PACKAGE_TEST_DIR=DIR ./build/test/cpp/ember_tests --gtest_filter='Package.*'

DIR gets NAME.ember, NAME.cases.pt ([[inputs], [expected outputs]] per case, torch.save'd lists that
C++ reads with torch::pickle_load) and manifest.txt ("NAME DEVICE RTOL ATOL" per package).
"""

import argparse
import os
import sys

import torch

import ember


class SmallCnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def randomize_norm_stats(model):
    """Fresh BatchNorm running statistics, so eval-mode normalization is not the identity."""
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model


def models():
    """(name, model, example inputs, dynamic_shapes, extra cases' inputs, rtol, atol)."""
    yield "mlp", mlp(), (torch.randn(8, 64),), None, [], 1e-4, 1e-5
    batch = torch.export.Dim("batch", min=1, max=256)
    yield ("mlp_dynamic_batch", mlp(), (torch.randn(8, 64),), ({0: batch},),
           [(torch.randn(1, 64),), (torch.randn(37, 64),)], 1e-4, 1e-5)
    yield "small_cnn", randomize_norm_stats(SmallCnn()), (torch.randn(2, 3, 32, 32),), None, [], 1e-4, 1e-4
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
    yield "transformer_encoder_layer", layer, (torch.randn(2, 16, 64),), None, [], 1e-4, 1e-4
    try:
        import torchvision
    except ImportError:
        print("torchvision is not installed: no resnet18 package", file=sys.stderr)
        return
    resnet = randomize_norm_stats(torchvision.models.resnet18())
    yield "resnet18", resnet, (torch.randn(2, 3, 224, 224),), None, [], 1e-3, 1e-3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    torch.manual_seed(0)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = []
    for name, model, example, dynamic, extra, rtol, atol in models():
        model = model.eval().to(device)
        example = tuple(x.to(device) for x in example)
        path = os.path.join(args.dir, name + ".ember")
        info = ember.export(model, example, path, dynamic_shapes=dynamic, device=device)
        cases = []
        with torch.no_grad():
            for inputs in [example] + [tuple(x.to(device) for x in e) for e in extra]:
                inputs = [torch.randn_like(x) for x in inputs]  # fresh values, the case's shapes
                out = model(*inputs)
                out = list(out) if isinstance(out, (tuple, list)) else [out]
                cases.append([[x.cpu() for x in inputs], [o.cpu() for o in out]])
        torch.save(cases, os.path.join(args.dir, name + ".cases.pt"))
        lines.append(f"{name} {device} {rtol} {atol}")
        print(f"{name}: {info['bytes']} bytes, {info['kernel_images']} CUDA images, "
              f"{sum(info['seconds'].values()):.2f} s")
    with open(os.path.join(args.dir, "manifest.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
