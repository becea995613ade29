"""Greedy decoding with a KV cache: a Hugging Face causal LM (random weights) compiled whole, one token per call.

    python bench/decode.py                                  # GPT-2 on CUDA where available, else the CPU
    python bench/decode.py --model hf_llama --device cpu --steps 32   # any bench/zoo.py causal LM
    python bench/decode.py --backends eager,ember,ember-ro --dtype bf16
    python bench/decode.py --cache static

What users of torch.compile run most: a prompt (prefill), then one call per generated token, each call
reading a cache one position longer than the last. Dynamo sees a new length on the second decode step and
recompiles with symbolic lengths (automatic dynamic shapes); from then on every step is that graph at a new
size. Under reduce-overhead (the -ro backends) each new size is a new CUDA graph. With --cache static the
cache is transformers' StaticCache instead: fixed-size buffers written in place, one shape for every step.

Each compiled backend runs in a process of its own beside eager (a crash costs that backend only: inductor's
reduce-overhead mode died with a segmentation fault under StaticCache on the H100), with bench/harness.py's
backends and cold caches:
    first_s     the first decode, compiles included: prefill plus --steps tokens
    step_ms     the median time of one decode step in a third decode of the same prompt (each step
                synchronized on CUDA), every length then seen twice before, as in serving later requests (a
                reduce-overhead backend captures a length's graph on its second sight, and ember's keeps
                cudagraph_max_graphs of them, 8 by default: lengths beyond run without graphs)
    tokens      whether the generated tokens are eager's
    max_err     max over steps of max |logits - eager's| / max |eager's|
    graphs      graphs Dynamo compiled
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import harness  # noqa: E402

import zoo  # noqa: E402


def build(name, device, dtype):
    """GPT-2 (6 layers of GPT-2 small's width), or a bench/zoo.py causal LM (its small configs)."""
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers

        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=6))
    else:
        model = zoo.MODELS[name][1](device, 1, 8)[0].model  # the Hugging Face module inside zoo's wrapper
        if not type(model).__name__.endswith("ForCausalLM"):
            raise SystemExit(f"{name} is not a causal LM ({type(model).__name__})")
    return model.to(device=device, dtype=dtype).eval()


def decode(fn, prompt, steps, device, backend, static_cache=None):
    """(tokens, logits per step, seconds per decode step, total seconds). static_cache: a function making a
    fresh transformers.StaticCache (fixed-size key and value buffers updated in place) for this decode."""
    start = time.perf_counter()
    harness.before_call(backend)
    out = fn(prompt, use_cache=True, past_key_values=static_cache() if static_cache else None)
    past, tokens, logits, step_s = out.past_key_values, [], [], []
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        harness.before_call(backend)
        seconds, out = harness.timed_call(lambda t, p: fn(t, past_key_values=p, use_cache=True), (token, past), device)
        step_s.append(seconds)
        past = out.past_key_values
        logits.append(out.logits[:, -1].float().clone())
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token.item())
    harness.sync(device)
    return tokens, logits, step_s, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["gpt2"] + [n for n in zoo.MODELS if n.startswith("hf_")], default="gpt2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--steps", type=int, default=24, help="tokens generated per decode")
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                        help="transformers' DynamicCache (grows by concatenation: a new length per step) or "
                             "StaticCache (buffers of prompt + steps positions written in place: one shape)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated, from eager, inductor, ember, inductor-ro, ember-ro (default: all the "
                             "device runs)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/decode_<device>.json)")
    parser.add_argument("--here", action="store_true", help="run every backend in this process")
    args = parser.parse_args(argv)
    if importlib_missing("transformers"):
        print("decode.py needs transformers", file=sys.stderr)
        return 1
    backends = (args.backends.split(",") if args.backends else
                ["eager", "inductor", "ember"] + (["inductor-ro", "ember-ro"] if args.device == "cuda" else []))
    if not args.here and len([b for b in backends if b != "eager"]) > 1:
        return in_children(args, [b for b in backends if b != "eager"])
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    made = harness.disable_inductor_caches()
    results = {"machine": harness.machine_info(args.device), "model": args.model, "dtype": args.dtype, "cache": args.cache,
               "prompt": args.prompt, "steps": args.steps, "backends": {}}
    try:
        model = build(args.model, args.device, dtype)
        prompt = torch.randint(0, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(args.device)
        static_cache = None
        if args.cache == "static":
            from transformers import StaticCache

            static_cache = lambda: StaticCache(config=model.config, max_cache_len=args.prompt + args.steps + 1)  # noqa: E731
        reference = None
        print(HEADER)
        for backend in backends:
            row = results["backends"][backend] = {}
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            try:
                with torch.no_grad():
                    fn = harness.compile_with(model, backend)
                    tokens, logits, _, row["first_s"] = decode(fn, prompt, args.steps, args.device, backend, static_cache)
                    harness.settle()
                    for _ in range(2):
                        _, _, step_s, _ = decode(fn, prompt, args.steps, args.device, backend, static_cache)
            except Exception as e:
                row["error"] = harness.error_text(e)
                print_row(backend, row)
                continue
            row["step_ms"] = 1e3 * statistics.median(step_s)
            if backend != "eager":
                row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            if reference is None:
                reference = (tokens, logits, row["step_ms"])
            row["tokens_match"] = tokens == reference[0]
            # Compared while the tokens agree: after a different token the inputs differ.
            agree = next((i for i, (a, b) in enumerate(zip(tokens, reference[0])) if a != b), len(tokens))
            row["max_err"] = max(((l - r).abs().max() / r.abs().max()).item()
                                 for l, r in zip(logits[:agree + 1], reference[1][:agree + 1]))
            row["speedup"] = reference[2] / row["step_ms"]
            print_row(backend, row)
    finally:
        shutil.rmtree(made, ignore_errors=True)
    write(args, results)
    return 0


HEADER = f"{'backend':<12} {'first s':>8} {'step ms':>8} {'speedup':>8} {'tokens':>7} {'max err':>8} {'graphs':>6}"


def print_row(backend, row):
    if "error" in row:
        print(f"{backend:<12} error: {row['error']}", flush=True)
        return
    print(f"{backend:<12} {row['first_s']:8.2f} {row['step_ms']:8.3f} {row['speedup']:7.2f}x "
          f"{str(row['tokens_match']):>7} {row['max_err']:8.1e} {row.get('graphs', '-'):>6}", flush=True)


def write(args, results):
    out = args.out or os.path.join(harness.RESULTS_DIR, f"decode_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out}")


def in_children(args, compiled):
    """Each compiled backend with eager in a child process (--here); eager's row is the first child's."""
    results, printed = None, False
    for backend in compiled:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "row.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--here", "--model", args.model, "--device", args.device,
                   "--dtype", args.dtype, "--prompt", str(args.prompt), "--steps", str(args.steps), "--cache",
                   args.cache, "--backends", f"eager,{backend}", "--out", out]
            done = subprocess.run(cmd, capture_output=True, text=True)
            child = None
            if os.path.exists(out):
                with open(out) as f:
                    child = json.load(f)
        if child is None:
            tail = [line for line in (done.stderr or "").strip().splitlines() if line.strip()][-1:]
            why = f"signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
            child = {"backends": {backend: {"error": f"the process died ({why}) " + " ".join(tail)[:300]}}}
        if results is None and "eager" in child["backends"]:
            results = child
        elif results is not None:
            results["backends"][backend] = child["backends"][backend]
        if results is not None and not printed:
            print(HEADER)
            print_row("eager", results["backends"]["eager"])
            printed = True
        if printed:
            print_row(backend, child["backends"][backend])
    if results is not None:
        write(args, results)
    return 0


def importlib_missing(name):
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    sys.exit(main())
