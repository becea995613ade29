"""A long training loop under one backend and mode, checked against eager at its first and last step.

    python bench/train_soak.py --steps 200 --mode reduce-overhead          # BertModel(BertConfig()), batch 8, length 128

The loop is the one a user writes: `(model(ids).last_hidden_state.float() * w).sum().backward()`, gradients
accumulating (no optimizer), or with `--adamw` an AdamW step after each backward. `w` is a fixed random vector over
the hidden size: a plain `.sum()` of a LayerNorm's output is its bias's sum whatever the input, so every gradient
before it is rounding noise, fine for finding a crash but not for comparing with eager. At the first and the last
step a copy of the model with the same parameters (and gradients so far) runs the same step eagerly, and the largest
gradient difference is printed, as a share of that gradient's norm (or of a thousandth of the largest gradient's
norm, where that is more: some gradients are zero in exact arithmetic, a key's bias among them, since softmax
ignores a constant added to a row, and rounding noise on both sides). A crash ends the process (run it in a process
of its own); NaN or Inf in a loss or a difference over --tolerance exits 1. Not a speed measurement: the steps are
not timed.
"""

import argparse
import copy
import sys

import torch


def gradient_difference(model, reference):
    """(largest difference as a share of the norm, the parameter's name) between two models' gradients."""
    pairs = [(n, p.grad if p.grad is not None else torch.zeros_like(q), q.grad)
             for (n, p), q in zip(model.named_parameters(), reference.parameters()) if q.grad is not None]
    floor = 1e-3 * max(expected.norm().item() for _, _, expected in pairs)
    worst, name = 0.0, None
    for n, got, expected in pairs:
        error = (got - expected).norm().item() / max(expected.norm().item(), floor)
        if error > worst:
            worst, name = error, n
    return worst, name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mode", default="reduce-overhead", choices=["default", "reduce-overhead"])
    parser.add_argument("--backend", default="ember")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12, help="BertConfig's num_hidden_layers")
    parser.add_argument("--adamw", action="store_true", help="an AdamW step after each backward")
    parser.add_argument("--tolerance", type=float, default=1e-2,
                        help="largest gradient difference allowed, as a share of the gradient's norm")
    args = parser.parse_args(argv)

    import transformers

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).to(device)
    model.eval()  # dropout off, so that eager's step is the same computation
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=args.backend, mode=None if args.mode == "default" else args.mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if args.adamw else None
    w = torch.randn(model.config.hidden_size, device=device)

    def step(m, ids):
        loss = (m(ids).last_hidden_state.float() * w).sum()
        loss.backward()
        return loss

    worst, worst_name = 0.0, None
    for i in range(args.steps):
        ids = torch.randint(0, 30000, (args.batch, args.length), device=device)
        checked = i in (0, args.steps - 1)
        if checked:
            before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        loss = step(compiled, ids)
        if not torch.isfinite(loss):
            print(f"step {i}: loss {loss.item()}")
            return 1
        if checked:
            reference.load_state_dict(model.state_dict())
            for q, g in zip(reference.parameters(), before):
                q.grad = g
            step(reference, ids)
            error, name = gradient_difference(model, reference)
            if error > worst:
                worst, worst_name = error, name
            print(f"step {i}: loss {loss.item():.6g}, largest gradient difference from eager so far {worst:.3g} "
                  f"({worst_name})", flush=True)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    ok = worst <= args.tolerance
    print(f"{'OK' if ok else 'MISMATCH'}: {args.steps} steps, {args.backend} {args.mode}, largest gradient difference "
          f"{worst:.3g} of the gradient's norm ({worst_name}; tolerance {args.tolerance})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
