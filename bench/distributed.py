"""Data-parallel training under each backend: tokens per second and compile time, DDP and FSDP2.

    python bench/distributed.py --device cuda --nproc 2                       # GPT-2 small, NCCL, every backend
    python bench/distributed.py --device cpu --nproc 2 --model tiny --backends eager,ember --steps 6   # gloo

For each strategy (DDP; FSDP2: fully_shard per transformer block and at the root) and backend (eager, inductor,
ember), a fresh world of --nproc processes (one GPU each on CUDA) trains the model --steps AdamW steps on random
tokens, each rank its own. Rank 0 reports:
- first_step_s: the first step, compiles included (the slowest rank's);
- tokens_per_s: the world's tokens per second over the steps after --warmup, every rank synchronized;
- final_loss: the last step's loss (the backends start from the same weights and data, so these agree closely).
Nothing here asserts a speed.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class TinyLM(nn.Module):
    """A small causal transformer for runs without transformers (or on the CPU)."""

    def __init__(self, vocab=512, dim=128, layers=2, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.vocab = vocab

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x)


def make_model(name):
    """(model, its repeated blocks, vocabulary size)."""
    if name == "tiny":
        model = TinyLM()
        return model, list(model.blocks), model.vocab
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=12 if name == "gpt2" else 2, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    return model, list(model.transformer.h), config.vocab_size


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def rank_main(rank, args, backend, strategy, rendezvous, out_path):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:  # the host's cores shared among the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=args.nproc)
    try:
        torch.manual_seed(0)
        model, blocks, vocab = make_model(args.model)
        model = model.to(device)
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model, device_ids=[rank] if cuda else None)
        else:
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                from torch.distributed._composable.fsdp import fully_shard
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(args.device, (args.nproc,))
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        fn = model if backend == "eager" else torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1000 + rank)
        batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(args.steps)]

        def step(ids):
            logits = logits_of(fn(ids[:, :-1]))
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.detach()

        def sync():
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()

        sync()
        start = time.perf_counter()
        loss = step(batches[0])
        sync()
        first = time.perf_counter() - start
        for ids in batches[1:args.warmup + 1]:
            loss = step(ids)
        sync()
        start = time.perf_counter()
        timed = batches[args.warmup + 1:]
        for ids in timed:
            loss = step(ids)
        sync()
        seconds = time.perf_counter() - start
        result = torch.tensor([first, seconds, float(loss)], dtype=torch.float64, device=device)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        if rank == 0:
            tokens = len(timed) * args.batch * args.seq * args.nproc
            with open(out_path, "w") as f:
                json.dump({"backend": backend, "strategy": strategy, "first_step_s": result[0].item(),
                           "tokens_per_s": tokens / result[1].item() if timed else None,
                           "final_loss": float(loss)}, f)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()
    _exit_now()


def _exit_now():
    """Ends a rank that finished without Python's finalization: there, gloo's worker threads may still hold
    work objects whose tensors reach into the interpreter being torn down, and about one world in five on the
    2-core host died with SIGABRT ("terminate called without an active exception") after its last step, under
    eager as under ember."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(args, backend, strategy):
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "result.json")
        try:
            mp.start_processes(rank_main, args=(args, backend, strategy, os.path.join(folder, "rendezvous"), out_path),
                               nprocs=args.nproc, start_method="spawn")
        except Exception as e:  # a rank failed: reported, the other runs go on
            return {"backend": backend, "strategy": strategy, "failed": str(e).strip().splitlines()[-1][-300:]}
        with open(out_path) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", choices=("gpt2", "gpt2-2layer", "tiny"), default="gpt2")
    ap.add_argument("--backends", default="eager,inductor,ember")
    ap.add_argument("--strategies", default="ddp,fsdp2")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps after the first before timing starts")
    ap.add_argument("--out", default=None, help="JSON path for the results")
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"needs {args.nproc} GPUs, this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    results = []
    print(f"{'strategy':8} {'backend':9} {'first step, s':>13} {'tokens/s':>10} {'final loss':>10}")
    for strategy in args.strategies.split(","):
        for backend in args.backends.split(","):
            r = run(args, backend, strategy)
            results.append(r)
            if "failed" in r:
                print(f"{strategy:8} {backend:9} FAILED: {r['failed']}")
            else:
                tps = f"{r['tokens_per_s']:10.0f}" if r["tokens_per_s"] else f"{'-':>10}"
                print(f"{strategy:8} {backend:9} {r['first_step_s']:13.2f} {tps} {r['final_loss']:10.4f}")
            sys.stdout.flush()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
