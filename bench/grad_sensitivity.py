"""Is a resnet18 training-gradient difference on the GPU an ember bug or the network's sensitivity to
rounding? Compares conv1.weight gradients of eager against aot_eager (AOTAutograd's decompositions
run by eager kernels), ember and inductor, TF32 off, for two batch sizes."""
import sys

import torch
import torchvision


def conv1_grad(model, x, backend):
    model.zero_grad()
    fn = model if backend is None else torch.compile(model, backend=backend)
    fn(x).sum().backward()
    torch._dynamo.reset()
    return model.conv1.weight.grad.clone()


def main():
    if not torch.cuda.is_available():
        print("no GPU")
        return 0
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    for batch in (2, 8):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10).cuda().train()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(batch, 3, 64, 64, device="cuda")
        ref = conv1_grad(model, x, None)
        for backend in (None, "aot_eager", "ember", "inductor"):
            model.load_state_dict(state)
            g = conv1_grad(model, x, backend)
            rel = ((g - ref).abs().max() / ref.abs().max()).item()
            print(f"batch {batch} {str(backend):9s} max|grad| {ref.abs().max().item():.3e} "
                  f"max abs diff vs eager {(g - ref).abs().max().item():.3e} (relative to max {rel:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
