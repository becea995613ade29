"""Model zoo: public architectures with random weights, each compiled with ember and checked against eager.

    python bench/zoo.py                                # every model the installed packages provide
    python bench/zoo.py --device cuda --batch 8 --seq 128
    python bench/zoo.py --device cuda --dtype bf16 --only hf_llama,swin_t
    python bench/zoo.py --train                        # forward + backward: parameter gradients
    python bench/zoo.py --train --mode reduce-overhead --steps 20   # 20 steps under CUDA graphs: crashes, mismatches
    python bench/zoo.py --dynamic                      # one shape, then two others (automatic dynamic shapes)
    python bench/zoo.py --device cuda --against inductor   # inductor in the same mode, timed in the same process
    python bench/zoo.py --device cuda --mode max-autotune --against ember-default
    python bench/zoo.py --list

Where bench/harness.py measures the issue's fixed suite side by side with inductor, this sweeps breadth:
torchvision, timm and transformers models (built from their constructors or configs, nothing downloaded) that
users compile. Each model runs in a process of its own (a crash or a hang costs that model only; Dynamo starts
fresh), with ember's options={"fallback": "raise"}, so a graph ember cannot compile is reported as an error.

Per model it reports
    err       inference: max over outputs of max |ember - eager| / max |eager|; --train: the same over all
              parameter gradients together (a loss of out * fixed random weights, so none is all noise);
              --dynamic: the largest over the three shapes
    first     the first call in seconds, compile included (--dynamic: all three shapes' calls)
    speedup   eager's latency / ember's: medians of --repeat calls, the two alternating in three rounds, the
              best round of each (on CUDA each call is synchronized); --dynamic does not time
    graphs    graphs Dynamo compiled (more than one: graph breaks, or --dynamic's recompile)
    --against adds backends compiled and timed in the same process, alternating with eager and ember: `inductor`
    (torch.compile's default backend in the same --mode) and `ember-default` (ember in the default mode, against
    which --mode max-autotune is compared). Each gets <name>_ms, <name>_first_s and <name>_err. Every child starts
    with empty caches (ember's in a fresh folder, inductor's off), so first calls are cold for all.
Results: a table on stdout and JSON (default bench/results/zoo_<device>.json).
"""

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}

# ----------------------------------------------------------------------------------------------------------
# Models: name -> (package it needs, build(device, batch, seq) -> (module, inputs))
# ----------------------------------------------------------------------------------------------------------

MODELS = {}


def torchvision_model(name, image=224, **kwargs):
    def build(device, batch, seq):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None, **kwargs)
        return model, (torch.randn(batch, 3, image, image, device=device),)

    return "torchvision", build


def timm_model(name, image=224):
    def build(device, batch, seq):
        import timm

        return timm.create_model(name, pretrained=False), (torch.randn(batch, 3, image, image, device=device),)

    return "timm", build


class FirstOutput(torch.nn.Module):
    """A Hugging Face model called with keyword inputs, returning its first (or named) output."""

    def __init__(self, model, names, key=None):
        super().__init__()
        self.model, self.names, self.key = model, names, key

    def forward(self, *inputs):
        out = self.model(**dict(zip(self.names, inputs)))
        return out[self.key] if self.key else out[0]


def transformers_model(config, model, inputs="ids", key=None, **config_kwargs):
    """inputs: "ids" (token ids, [batch, seq]), "pixels" (224x224 images), "audio" (a second at 16 kHz),
    "mel" (Whisper's 80 x 3000 features and 16 decoder ids) or "seq2seq" (ids and 16 decoder ids)."""

    def build(device, batch, seq):
        import transformers

        module = getattr(transformers, model)(getattr(transformers, config)(**config_kwargs))
        ids = lambda n: torch.randint(0, 1000, (batch, n), device=device)  # noqa: E731
        made = {
            "ids": (["input_ids"], lambda: (ids(seq),)),
            "pixels": (["pixel_values"], lambda: (torch.randn(batch, 3, 224, 224, device=device),)),
            "audio": (["input_values"], lambda: (torch.randn(batch, 16000, device=device),)),
            "mel": (["input_features", "decoder_input_ids"],
                    lambda: (torch.randn(batch, 80, 3000, device=device), ids(16))),
            "seq2seq": (["input_ids", "decoder_input_ids"], lambda: (ids(seq), ids(16))),
        }
        names, values = made[inputs]
        return FirstOutput(module, names, key), values()

    return "transformers", build


SMALL_DECODER = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=32000)

MODELS.update({
    "mobilenet_v2": torchvision_model("mobilenet_v2"),
    "mobilenet_v3_small": torchvision_model("mobilenet_v3_small"),
    "efficientnet_b0": torchvision_model("efficientnet_b0"),
    "efficientnet_v2_s": torchvision_model("efficientnet_v2_s"),
    "convnext_tiny": torchvision_model("convnext_tiny"),
    "vit_b_16": torchvision_model("vit_b_16"),
    "swin_t": torchvision_model("swin_t"),
    "maxvit_t": torchvision_model("maxvit_t"),
    "densenet121": torchvision_model("densenet121"),
    "regnet_y_400mf": torchvision_model("regnet_y_400mf"),
    "shufflenet_v2": torchvision_model("shufflenet_v2_x1_0"),
    "squeezenet": torchvision_model("squeezenet1_0"),
    "googlenet": torchvision_model("googlenet", aux_logits=False, init_weights=True),
    "mnasnet": torchvision_model("mnasnet1_0"),
    "resnext50": torchvision_model("resnext50_32x4d"),
    "timm_resnet50d": timm_model("resnet50d"),
    "timm_vit_small": timm_model("vit_small_patch16_224"),
    "timm_deit_tiny": timm_model("deit_tiny_patch16_224"),
    "timm_convnext_nano": timm_model("convnext_nano"),
    "timm_efficientnet_b0": timm_model("efficientnet_b0"),
    "timm_mobilevit_s": timm_model("mobilevit_s", image=256),
    "timm_levit_128": timm_model("levit_128"),
    "timm_regnetx_002": timm_model("regnetx_002"),
    "timm_coatnet_0": timm_model("coatnet_0_rw_224"),
    "hf_distilbert": transformers_model("DistilBertConfig", "DistilBertModel"),
    "hf_roberta": transformers_model("RobertaConfig", "RobertaModel", num_hidden_layers=4),
    "hf_albert": transformers_model("AlbertConfig", "AlbertModel", num_hidden_layers=4),
    "hf_electra": transformers_model("ElectraConfig", "ElectraModel"),
    "hf_mobilebert": transformers_model("MobileBertConfig", "MobileBertModel", num_hidden_layers=4),
    "hf_deberta_v2": transformers_model("DebertaV2Config", "DebertaV2Model", num_hidden_layers=2, hidden_size=256,
                                        num_attention_heads=4, intermediate_size=512),
    "hf_t5": transformers_model("T5Config", "T5ForConditionalGeneration", "seq2seq", "logits", num_layers=2,
                                num_decoder_layers=2, d_model=256, d_ff=512, num_heads=4, d_kv=64),
    "hf_bart": transformers_model("BartConfig", "BartModel", "seq2seq", encoder_layers=2, decoder_layers=2,
                                  d_model=256, encoder_ffn_dim=512, decoder_ffn_dim=512),
    "hf_whisper": transformers_model("WhisperConfig", "WhisperModel", "mel", encoder_layers=2, decoder_layers=2,
                                     d_model=256, encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=512, decoder_ffn_dim=512),
    "hf_llama": transformers_model("LlamaConfig", "LlamaForCausalLM", key="logits", **SMALL_DECODER),
    "hf_mistral": transformers_model("MistralConfig", "MistralForCausalLM", key="logits", **SMALL_DECODER),
    "hf_qwen2": transformers_model("Qwen2Config", "Qwen2ForCausalLM", key="logits", **SMALL_DECODER),
    "hf_gemma": transformers_model("GemmaConfig", "GemmaForCausalLM", key="logits",
                                   **{**SMALL_DECODER, "num_key_value_heads": 1, "head_dim": 64}),
    "hf_phi": transformers_model("PhiConfig", "PhiForCausalLM", key="logits",
                                 **{k: v for k, v in SMALL_DECODER.items() if k != "num_key_value_heads"}),
    "hf_opt": transformers_model("OPTConfig", "OPTForCausalLM", key="logits", num_hidden_layers=2, hidden_size=256,
                                 ffn_dim=512, num_attention_heads=4, word_embed_proj_dim=256),
    "hf_bloom": transformers_model("BloomConfig", "BloomForCausalLM", key="logits", n_layer=2, hidden_size=256,
                                   n_head=4),
    "hf_gpt_neo": transformers_model("GPTNeoConfig", "GPTNeoForCausalLM", key="logits", num_layers=2,
                                     hidden_size=256, num_heads=4, attention_types=[[["global", "local"], 1]]),
    "hf_falcon": transformers_model("FalconConfig", "FalconForCausalLM", key="logits", num_hidden_layers=2,
                                    hidden_size=256, num_attention_heads=4),
    "hf_vit": transformers_model("ViTConfig", "ViTModel", "pixels", num_hidden_layers=4),
    "hf_clip_vision": transformers_model("CLIPVisionConfig", "CLIPVisionModel", "pixels", num_hidden_layers=4),
    "hf_wav2vec2": transformers_model("Wav2Vec2Config", "Wav2Vec2Model", "audio", num_hidden_layers=2),
})

# ----------------------------------------------------------------------------------------------------------
# One model, in a child process
# ----------------------------------------------------------------------------------------------------------


def tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    elif hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (list, tuple)):
        return [t for x in out for t in tensors(x)]
    return []


def relative_error(outs, refs):
    """max over pairs of max |out - ref| / max |ref| (non-float tensors must be equal: else inf)."""
    err = 0.0
    for a, b in zip(outs, refs):
        if not a.is_floating_point():
            err = max(err, 0.0 if torch.equal(a, b) else float("inf"))
            continue
        if b.numel():
            scale = max(b.double().abs().max().item(), 1e-6)
            err = max(err, (a.double() - b.double()).abs().max().item() / scale)
    return err


def default_batch(device):
    return 8 if device == "cuda" else 1


def default_seq(device):
    return 128 if device == "cuda" else 64


def build(name, device, args, batch=None, seq=None):
    model, inputs = MODELS[name][1](device, batch or args.batch, seq or args.seq)
    model = model.to(device).eval()  # eval: dropout off, so ember and eager compute the same function
    dtype = DTYPES[args.dtype]
    if dtype is not None:
        model = model.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    return model, inputs


def latency(fn, device, repeat):
    """Median seconds of `repeat` calls of fn()."""
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def compare_speed(fns, device, repeat):
    """Seconds per fn: the best of three rounds, each a median of `repeat` calls of each, alternating."""
    for _ in range(2):
        for fn in fns:
            fn()
    import ember as ember_package

    ember_package.wait_for_compiles()  # (harness.settle; zoo.py runs without harness on the path too)
    rounds = [[latency(fn, device, repeat) for fn in fns] for _ in range(3)]
    return [min(r[i] for r in rounds) for i in range(len(fns))]


def timed_first(fn, device):
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


AGAINST = ("inductor", "ember-default")


def compile_model(model, args, backend="ember"):
    """`backend` (ember, or one of AGAINST) in --mode. torch.compile takes mode or options, not both: ember's
    modes are its options here, so that a graph ember cannot compile raises."""
    if backend == "inductor":
        return torch.compile(model, mode=None if args.mode == "default" else args.mode)
    mode = "default" if backend == "ember-default" else args.mode
    options = {"fallback": "raise", "cudagraphs": mode in ("reduce-overhead", "max-autotune"),
               "autotune": mode == "max-autotune"}
    return torch.compile(model, backend="ember", options=options)


def against(args):
    return [b.strip() for b in args.against.split(",") if b.strip()]


def run_compared(args, device, step, compare):
    """The row of one model: ember's (and each --against backend's) first call of step(fn) and its error
    (compare(out)), then every latency, alternating with eager's (step(None))."""
    row = {}
    fns = {}
    for backend in ["ember", *against(args)]:
        compiled = fns[backend] = compile_model(args.model, args, backend)
        out, first = timed_first(lambda: step(compiled), device)
        prefix = "" if backend == "ember" else backend + "_"
        row[prefix + "first_s"], row[prefix + "err"] = first, compare(out)
        if backend == "ember":  # the counter goes on counting the other backends' graphs
            row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    seconds = compare_speed([lambda: step(None)] + [lambda fn=fn: step(fn) for fn in fns.values()], device, args.repeat)
    row["eager_ms"] = seconds[0] * 1e3
    for backend, s in zip(fns, seconds[1:]):
        row[backend + "_ms"] = s * 1e3
    return row


def run_inference(name, device, args):
    model, inputs = build(name, device, args)
    args.model = model
    with torch.no_grad():
        ref = tensors(model(*inputs))
        return run_compared(args, device, lambda fn: (model if fn is None else fn)(*inputs), lambda out: relative_error(tensors(out), ref))


class EagerFailed(Exception):
    pass


def run_training(name, device, args):
    """Forward + backward of sum(out * w), w fixed random: the parameters' gradients against eager's."""
    model, inputs = build(name, device, args)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = {}

    def step(fn):
        for p in params:
            p.grad = None
        out = tensors(fn(*inputs))[0]
        if out.shape not in weights:
            weights[out.shape] = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
        (out.float() * weights[out.shape]).sum().backward()
        return [p.grad for p in params]

    try:  # twice: a model that cannot take a second step (LeViT's eval-mode bias cache keeps a freed graph)
        step(model)
        ref = [g.clone() if g is not None else None for g in step(model)]
    except RuntimeError as e:
        raise EagerFailed(f"eager's second step fails too: {str(e).splitlines()[0][:150]}") from e
    if args.steps > 1:  # the same parameters every step, so every step's gradients are eager's
        compiled = compile_model(model, args)
        got, first = timed_first(lambda: step(compiled), device)
        err = gradient_error(got, ref)
        for _ in range(args.steps - 1):
            got = step(compiled)
        if device == "cuda":
            torch.cuda.synchronize()
        return {"err": max(err, gradient_error(got, ref)), "first_s": first, "steps": args.steps}
    args.model = model
    return run_compared(args, device, lambda fn: step(model if fn is None else fn), lambda got: gradient_error(got, ref))


def gradient_error(got, ref):
    if any((a is None) != (b is None) for a, b in zip(got, ref)):
        return float("inf")
    pairs = [(a, b) for a, b in zip(got, ref) if a is not None]
    scale = max((b.double().abs().max().item() for _, b in pairs), default=0.0)
    return max(((a.double() - b.double()).abs().max().item() for a, b in pairs), default=0.0) / max(scale, 1e-12)


def run_dynamic(name, device, args):
    """Three shapes in turn (batch, and sequence length for transformers): Dynamo recompiles the second with
    symbolic sizes, which the third reuses."""
    model, inputs = build(name, device, args)
    compiled = compile_model(model, args)
    sequences = name.startswith("hf_")
    shapes = [(args.batch + 1, args.seq - 16 if sequences else args.seq), (args.batch + 2, args.seq + 8 if sequences else args.seq)]
    err, start = 0.0, time.perf_counter()
    with torch.no_grad():
        for k in range(3):
            if k > 0:
                inputs = build(name, device, args, *shapes[k - 1])[1]
            err = max(err, relative_error(tensors(compiled(*inputs)), tensors(model(*inputs))))
    return {"err": err, "first_s": time.perf_counter() - start}


def child(name, args):
    import ember  # noqa: F401  (registers the backend)

    torch.manual_seed(0)
    run = run_training if args.train else run_dynamic if args.dynamic else run_inference
    try:
        row = run(name, args.device, args)
    except EagerFailed as e:
        print("RESULT " + json.dumps({"skipped": str(e)}), flush=True)
        return 0
    row.setdefault("graphs", torch._dynamo.utils.counters["stats"]["unique_graphs"])
    print("RESULT " + json.dumps(row), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------------------


def run_in_child(name, args, argv):
    command = [sys.executable, os.path.abspath(__file__), *argv, "--child", name]
    caches = tempfile.mkdtemp(prefix="ember-zoo-")
    env = {**os.environ, "EMBER_CACHE_DIR": caches, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    if done.returncode < 0:
        return {"error": f"crashed: signal {-done.returncode}"}
    lines = [x.strip() for x in done.stderr.strip().splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or x.startswith("(ember:")]
    return {"error": " ".join(errors[-2:] or lines[-1:])[:400] or f"exit code {done.returncode}"}


def describe(row, tolerance):
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    if "error" in row:
        return f"FAILED: {row['error']}"
    text = f"err {row['err']:.1e}  first {row['first_s']:6.2f} s"
    if "ember_ms" in row:
        row["speedup"] = row["eager_ms"] / row["ember_ms"]
        text += f"  eager {row['eager_ms']:9.3f} ms  ember {row['ember_ms']:9.3f} ms  {row['speedup']:5.2f}x"
    behind = row["err"] > tolerance or row.get("speedup", 1.0) < 1.0
    for backend in AGAINST:
        if backend + "_ms" in row:
            row[backend + "_speedup"] = row["eager_ms"] / row[backend + "_ms"]
            ratio = row[backend + "_ms"] / row["ember_ms"]  # above 1: ember is faster
            text += f"  {backend} {row[backend + '_speedup']:5.2f}x (ember {ratio:4.2f}x it; first {row[backend + '_first_s']:6.2f} s)"
            behind = behind or ratio < (0.98 if backend == "inductor" else 1.0)
    text += f"  graphs {row['graphs']}"
    if behind:
        text += "  <--"
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: 8 on CUDA, 1 on the CPU)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 128 on CUDA, 64 on the CPU)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    parser.add_argument("--train", action="store_true", help="forward + backward, gradients compared")
    parser.add_argument("--dynamic", action="store_true", help="three input shapes in turn, values compared")
    parser.add_argument("--mode", choices=("default", "reduce-overhead", "max-autotune"), default="default")
    parser.add_argument("--against", default="", help=f"comma-separated backends timed beside ember: {', '.join(AGAINST)}")
    parser.add_argument("--steps", type=int, default=1, help="--train: steps to run (more than 1: untimed)")
    parser.add_argument("--no-tf32", action="store_true",
                        help="convolutions and matmuls in full f32 (cuDNN's TF32 convolutions differ by ~1e-3 between algorithms)")
    parser.add_argument("--repeat", type=int, default=10, help="calls per timed round")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="err above it is marked (default 1e-3 for f32, 3e-2 for 16-bit)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per model")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/zoo_<device>.json)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if any(b not in AGAINST for b in against(args)):
        parser.error(f"--against takes {', '.join(AGAINST)}")
    args.batch = args.batch or default_batch(args.device)
    args.seq = args.seq or default_seq(args.device)
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.child:
        return child(args.child, args)
    if args.list:
        for name, (package, _) in MODELS.items():
            print(f"{name:<22} {package}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; --list shows them")
    tolerance = args.tolerance or (1e-3 if args.dtype == "f32" else 3e-2)
    child_argv = [a for a in argv if a != "--list"]
    results = {}
    for name in names:
        package = MODELS[name][0]
        if importlib.util.find_spec(package) is None:
            results[name] = {"skipped": f"needs {package}"}
            print(f"{name:<22} skipped: needs {package}", flush=True)
            continue
        results[name] = run_in_child(name, args, child_argv)
        print(f"{name:<22} {describe(results[name], tolerance)}", flush=True)
    ran = [r for r in results.values() if "speedup" in r]
    if ran:
        geomean = torch.tensor([r["speedup"] for r in ran]).log().mean().exp().item()
        print(f"{len(ran)} timed, geomean speedup {geomean:.2f}x, slower than eager: "
              f"{sum(r['speedup'] < 1.0 for r in ran)}; failed: {sum('error' in r for r in results.values())}")
    out = args.out or os.path.join(RESULTS_DIR, f"zoo_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": args.device, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
                   "train": args.train, "mode": args.mode, "steps": args.steps, "dynamic": args.dynamic, "torch": torch.__version__, "results": results},
                  f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
