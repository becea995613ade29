"""Is a resnet18 gradient difference between eager and a compiled backend precision (TF32 convolutions)
or a bug? Compares input gradients with TF32 on and off, for ember and inductor, on the GPU."""
import sys

import torch

torchvision = __import__("torchvision")


def grads(model, x, compiled):
    x = x.clone().requires_grad_(True)
    fn = torch.compile(model, backend=compiled, options={"fallback": "raise"} if compiled == "ember" else None) if compiled else model
    fn(x).sum().backward()
    torch._dynamo.reset()
    return x.grad


def main():
    if not torch.cuda.is_available():
        print("no GPU")
        return 0
    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda()
    x = torch.randn(2, 3, 64, 64, device="cuda")
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        ref = grads(model, x, None)
        for backend in ("ember", "inductor"):
            g = grads(model, x, backend)
            print(f"tf32={tf32!s:5} {backend:8s} max abs diff of input grad vs eager: {(g - ref).abs().max().item():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
