"""ember's benchmark harness: runs registered workloads under eager, inductor and ember in one process.

    python bench/harness.py                          # every workload the machine can run, small CPU shapes on the CPU
    python bench/harness.py --device cuda --repeat 50
    python bench/harness.py --only mlp_b64,mlp_b1 --no-inductor
    python bench/harness.py --list
    python bench/harness.py --device cuda --cold --cold-only --only gpt2_b4_s128  # first calls in fresh processes only
    python bench/harness.py --device cpu --cold --cold-only --warm                # and again over the caches they filled

For each workload and backend it records
    first_call_s    the first call, compile included (torch._dynamo.reset() and a garbage collection before it;
                    inductor's and ember's caches off: fresh cache folders per process). Backends share the
                    process: a later one finds Dynamo already imported and warmed, and inductor reuses kernels an
                    earlier workload compiled
    dynamo_s        the part of first_call_s that was Dynamo's own work: its `_compile.compile_inner` time (bytecode
                    tracing, guards) less the backend's compile inside it (`OutputGraph.call_user_compiler`), from
                    torch._dynamo.utils.compilation_time_metrics, summed over graphs. first_call_s - dynamo_s is
                    what the backend spent (ATen tracing, its compile, the first run, a lazily compiled backward)
    cold_first_call_s   with --cold: the same in a fresh process per workload and backend (fresh caches; eager
                    runs once first), Dynamo's own first use in the process included; cold_dynamo_s its Dynamo share.
                    The processes fork from a server that imported torch, Dynamo and the workloads' packages
                    (fresh_processes), which no backend's first call includes either way.
                    With --cold-repeat N, the medians of N such processes per backend, the backends taking turns
                    process by process (Dynamo's share of one model moved 1.69-2.21 s between fresh processes on
                    one H200); cold_first_call_samples and cold_dynamo_samples keep every process's. With
                    --cold-over R, only workloads whose in-process ratio of ember's first call to inductor's is
                    over R (the in-process ratio flatters inductor, whose compile finds what earlier workloads warmed).
                    --cold-only skips the in-process part: a suite's fresh processes split over runs with --only
    warm_first_call_s   with --cold --warm: each backend's cold process shares one folder of caches (inductor's FX
                    graph and autotune caches on, Triton's, ember's kernels and compiles, the CUDA driver's) with a
                    second fresh process run right after it: that one's first call (warm_dynamo_s its Dynamo share)
    latency_ms      the median of --repeat individually timed calls after --warmup calls (on CUDA each call is
                    bracketed by torch.cuda.synchronize()), taken in turns: each backend runs one untimed call and
                    then --block timed ones, and the next backend takes over; a steady loop calling one model
    latency_alternating_ms   the same with the backends alternating call by call: each call then follows
                    another backend's, with the CPU's caches holding that one's code and data (for small graphs
                    this costs the backend that follows inductor's Python launcher several microseconds)
    speedup         eager latency / this backend's latency; speedup_alternating the same for latency_alternating_ms
    compiles_waited_s   ember: how long after the first call its background compiles went on (settle())
    max_rel_error   over all outputs: max |out - eager| / max |eager|, per tensor; for ember the larger of the
                    first call's and a call's after its background compiles ended
    graphs          how many graphs Dynamo compiled (more than 1 means graph breaks)
A backend that fails on a workload gets an `error` string and the harness goes on.

ember always runs with options={"fallback": "raise"}: a graph ember cannot compile is an error here, never an
eager run timed as ember.

Results: a table on stdout and JSON (default bench/results/harness_<device>.json; bench/results/ is ignored by git),
and next to the JSON a PNG chart of the speedups (where matplotlib is installed). --json PATH also writes the
speedups in bench/chart.py's results schema (suite, date, machine, torch, command, rows), as docs/data/ holds them.
"""

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

BACKENDS = ("eager", "inductor", "ember", "inductor-ro", "ember-ro", "inductor-ma", "ember-ma")
# -ro: mode="reduce-overhead" (CUDA graphs); -ma: mode="max-autotune" (tuning, and CUDA graphs)
BACKEND_MODES = {"-ro": "reduce-overhead", "-ma": "max-autotune"}
# --floor adds "dynamo": torch.compile with a backend that runs Dynamo's FX graph as it is. Its latency minus
# eager's is what Dynamo's guards and frame handling add per call, which no backend can win back on a
# workload whose whole eager call is that short (matmul + softmax 100x100 on the CPU).
FLOOR = "dynamo"
EMBER_OPTIONS = {"fallback": "raise"}
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ----------------------------------------------------------------------------------------------------------
# Workload registry
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    build: object  # build(device) -> (model_or_fn, example_inputs); picks the CPU variant when device == "cpu"
    shape: str  # what it runs on a GPU
    cpu_shape: str  # what it runs on the CPU (smaller where the full size takes too long on a few cores)
    small_batch: bool = False  # tiny tensors: per-op overhead, not arithmetic, sets the time
    needs: tuple = ()  # optional packages it needs: "torchvision", "transformers"
    training: bool = False  # runs forward + backward (with grad enabled); others run under torch.no_grad()

    def missing(self):
        return [pkg for pkg in self.needs if importlib.util.find_spec(pkg) is None]

    def describe(self, device):
        return self.cpu_shape if device == "cpu" else self.shape


WORKLOADS = {}


def workload(name, shape, cpu_shape=None, small_batch=False, needs=(), training=False):
    """Decorator that registers a builder under `name`."""

    def register(build):
        WORKLOADS[name] = Workload(name, build, shape, cpu_shape or shape, small_batch, tuple(needs), training)
        return build

    return register


def mlp():
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


@workload("sin_cos_exp", "x.sin().cos().exp(), x 1000x1000")
def build_sin_cos_exp(device):
    def fn(x):
        return x.sin().cos().exp()

    return fn, (torch.randn(1000, 1000, device=device),)


@workload("entropy", "p=softmax(f,-1); -(p*log(p+1e-8)).sum(-1), f 32x196x768",
          cpu_shape="p=softmax(f,-1); -(p*log(p+1e-8)).sum(-1), f 8x196x768")
def build_entropy(device):
    batch = 8 if device == "cpu" else 32

    def fn(f):
        p = torch.softmax(f, -1)
        return -(p * torch.log(p + 1e-8)).sum(-1)

    return fn, (torch.randn(batch, 196, 768, device=device),)


@workload("matmul_softmax", "softmax(a @ b, -1), a, b 100x100", small_batch=True)
def build_matmul_softmax(device):
    def fn(a, b):
        return torch.softmax(a @ b, -1)

    return fn, (torch.randn(100, 100, device=device), torch.randn(100, 100, device=device))


@workload("mlp_b64", "MLP 512-1024-1024-10 (ReLU), batch 64")
def build_mlp_b64(device):
    return mlp().to(device).eval(), (torch.randn(64, 512, device=device),)


@workload("mlp_b1", "MLP 512-1024-1024-10 (ReLU), batch 1", small_batch=True)
def build_mlp_b1(device):
    return mlp().to(device).eval(), (torch.randn(1, 512, device=device),)


@workload("linear20_b32", "20 x Linear(100,100), batch 32", small_batch=True)
def build_linear20(device):
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(20)])
    return model.to(device).eval(), (torch.randn(32, 100, device=device),)


@workload("ln_gelu_linear_ln", "LayerNorm-GELU-Linear(1024,1024)-LayerNorm, x 64x128x1024",
          cpu_shape="LayerNorm-GELU-Linear(1024,1024)-LayerNorm, x 8x128x1024")
def build_ln_gelu_linear_ln(device):
    model = nn.Sequential(nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 1024), nn.LayerNorm(1024))
    batch = 8 if device == "cpu" else 64
    return model.to(device).eval(), (torch.randn(batch, 128, 1024, device=device),)


@workload("resnet18_b8", "torchvision resnet18 (random weights), 8x3x224x224",
          cpu_shape="torchvision resnet18 (random weights), 2x3x224x224", needs=("torchvision",))
def build_resnet18(device):
    import torchvision

    batch = 2 if device == "cpu" else 8
    model = torchvision.models.resnet18(weights=None)
    return model.to(device).eval(), (torch.randn(batch, 3, 224, 224, device=device),)


@workload("bert_b8_s128", "BertModel(BertConfig()) (random weights), input_ids 8x128",
          cpu_shape="BertModel(BertConfig()) (random weights), input_ids 1x64", needs=("transformers",))
def build_bert(device):
    from transformers import BertConfig, BertModel

    config = BertConfig()
    batch, seq = (1, 64) if device == "cpu" else (8, 128)
    model = BertModel(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model.to(device).eval(), (ids,)


@workload("gpt2_b4_s128", "GPT2LMHeadModel(GPT2Config()) (random weights, no KV cache), input_ids 4x128",
          cpu_shape="GPT2LMHeadModel(GPT2Config()) (random weights, no KV cache), input_ids 1x64",
          needs=("transformers",))
def build_gpt2(device):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(use_cache=False)
    batch, seq = (1, 64) if device == "cpu" else (4, 128)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model.to(device).eval(), (ids,)


# The issue's bf16 workloads: inference in bfloat16 at the sizes the issue names; on the CPU one small
# batch in float32 (bf16 there measures the CPU's bf16 support, not ember).
@workload("resnet50_b64_bf16", "torchvision resnet50 (random weights), bf16, channels_last, 64x3x224x224",
          cpu_shape="torchvision resnet50 (random weights), f32, channels_last, 1x3x224x224", needs=("torchvision",))
def build_resnet50_bf16(device):
    import torchvision

    batch, dtype = (1, torch.float32) if device == "cpu" else (64, torch.bfloat16)
    model = torchvision.models.resnet50(weights=None).to(device=device, dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    return model.eval(), (x,)


@workload("bert_b32_s512_bf16", "BertModel(BertConfig()) (random weights), bf16, input_ids 32x512",
          cpu_shape="BertModel(BertConfig()) (random weights), f32, input_ids 1x128", needs=("transformers",))
def build_bert_bf16(device):
    from transformers import BertConfig, BertModel

    config = BertConfig()
    batch, seq, dtype = (1, 128, torch.float32) if device == "cpu" else (32, 512, torch.bfloat16)
    model = BertModel(config).to(device=device, dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model.eval(), (ids,)


@workload("gpt2_b16_s512_bf16", "GPT2LMHeadModel(GPT2Config()) (random weights, no KV cache), bf16, input_ids 16x512",
          cpu_shape="GPT2LMHeadModel(GPT2Config()) (random weights, no KV cache), f32, input_ids 1x128",
          needs=("transformers",))
def build_gpt2_bf16(device):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(use_cache=False)
    batch, seq, dtype = (1, 128, torch.float32) if device == "cpu" else (16, 512, torch.bfloat16)
    model = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model.eval(), (ids,)


@workload("mlp_train_b64", "MLP 512-1024-1024-10 training step: cross-entropy forward + backward, batch 64",
          training=True)
def build_mlp_train(device):
    model = mlp().to(device)
    params = list(model.parameters())

    def train_step(x, target):
        for p in params:
            p.grad = None
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        return [loss.detach()] + [p.grad for p in params]

    return train_step, (torch.randn(64, 512, device=device), torch.randint(0, 10, (64,), device=device))


def training_step(model, loss_fn):
    """A compiled-whole training step: zero the grads, forward, loss, backward; returns the loss and grads."""
    params = [p for p in model.parameters() if p.requires_grad]

    def train_step(*inputs):
        for p in params:
            p.grad = None
        loss = loss_fn(model, *inputs)
        loss.backward()
        return [loss.detach()] + [p.grad for p in params]

    return train_step


@workload("resnet18_train_b8", "torchvision resnet18 training step: cross-entropy forward + backward, 8x3x224x224",
          cpu_shape="torchvision resnet18 training step, 2x3x224x224", needs=("torchvision",), training=True)
def build_resnet18_train(device):
    import torchvision

    batch = 2 if device == "cpu" else 8
    model = torchvision.models.resnet18(weights=None).to(device)
    step = training_step(model, lambda m, x, t: F.cross_entropy(m(x), t))
    return step, (torch.randn(batch, 3, 224, 224, device=device), torch.randint(0, 1000, (batch,), device=device))


@workload("bert_train_b8_s128", "BertModel training step (dropout off): mean(last_hidden_state * w) backward, input_ids 8x128",
          cpu_shape="BertModel training step (dropout off), input_ids 1x64", needs=("transformers",), training=True)
def build_bert_train(device):
    from transformers import BertConfig, BertModel

    # Dropout off: the error against eager must mean something.
    config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    batch, seq = (1, 64) if device == "cpu" else (8, 128)
    model = BertModel(config).to(device)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    # A fixed random weight per feature: the final LayerNorm makes each row's mean of squares (and its plain
    # mean) constant, so those losses have gradients that are rounding noise before it, and the error
    # against eager compared noise (it read 1.3-2.0).
    weight = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    step = training_step(model, lambda m, i: (m(i).last_hidden_state.float() * weight).mean())
    return step, (ids,)


# ----------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_call(fn, inputs, device):
    """(seconds, output) of one call, the device synchronized on both sides."""
    sync(device)
    start = time.perf_counter()
    out = fn(*inputs)
    sync(device)
    return time.perf_counter() - start, out


def tensors_of(out):
    """The tensors in a (nested) output: tensors, lists, tuples, dicts (Hugging Face outputs are dicts)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for item in out for t in tensors_of(item)]
    return []


def snapshot(out):
    return [t.detach().clone() for t in tensors_of(out)]


def max_rel_error(out, ref):
    """max over tensors of max|out - ref| / max|ref|, where a tensor's max|ref| counts as at least 1e-6 of the
    largest over all tensors: a gradient that is zero in exact arithmetic (BERT's attention key biases: softmax
    ignores a constant added to every key's score) holds rounding noise of 1e-11 in eager and in any compiled
    version, and dividing noise by noise read as errors of 1.3-2.3."""
    if len(out) != len(ref):
        raise ValueError(f"{len(out)} output tensors, eager gave {len(ref)}")
    scales = []
    for a, b in zip(out, ref):
        if a.shape != b.shape:
            raise ValueError(f"output shape {tuple(a.shape)}, eager gave {tuple(b.shape)}")
        scales.append(b.double().abs().max().item() if b.numel() else 0.0)
    floor = 1e-6 * max(scales, default=0.0)
    worst = 0.0
    for a, b, scale in zip(out, ref, scales):
        if b.numel() == 0:
            continue
        diff = (a.double() - b.double()).abs().max().item()
        scale = max(scale, floor)
        err = diff / scale if scale > 0 else diff
        if math.isnan(err):
            return float("nan")
        worst = max(worst, err)
    return worst


# CUDA_CACHE_PATH: the CUDA driver's compute cache, which NVRTC (CUDA 13) also keeps its compiled code in: with
# the default folder (~/.nv/ComputeCache) a module compiled by any earlier process on the machine comes back
# from it, whatever EMBER_CACHE_DIR says (H100: ember's entropy module 835 ms the first time, 215 ms the next).
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "EMBER_CACHE_DIR", "CUDA_CACHE_PATH")
# The cache folders the caller chose, before disable_inductor_caches() fills in fresh ones for this process.
_CALLER_CACHE_ENV = {k: os.environ[k] for k in CACHE_ENV if k in os.environ}


def disable_inductor_caches():
    """Cold compiles: no inductor FX graph / autotune caches and, unless TORCHINDUCTOR_CACHE_DIR or
    EMBER_CACHE_DIR is set, fresh cache folders for this process, for inductor (and Triton) and for ember's
    NVRTC kernel cache, so that kernels compiled by earlier runs are not reused by either; the same for the
    CUDA driver's compute cache, unless CUDA_CACHE_PATH is set (it takes effect where nothing in this process
    has compiled through NVRTC yet: the --cold children set it before they start). Within the
    process, a backend's later modes reuse what its earlier ones compiled. Returns the folder it made
    (the caller removes it)."""
    made = tempfile.mkdtemp(prefix="ember-bench-caches-")
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(made, "inductor")
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(made, "inductor", "triton"))
    os.environ.setdefault("EMBER_CACHE_DIR", os.path.join(made, "ember"))
    os.environ.setdefault("CUDA_CACHE_PATH", os.path.join(made, "cuda"))
    try:
        import torch._inductor.config as config
    except Exception:  # inductor missing: it will fail (and be reported) at compile time
        return made
    for name in ("fx_graph_cache", "autotune_local_cache", "fx_graph_remote_cache", "autotune_remote_cache"):
        if hasattr(config, name):
            setattr(config, name, False)
    return made


# Dynamo's timers (dynamo_timed): its whole work on a frame, and the backend's compile within it.
_DYNAMO_WHOLE, _DYNAMO_BACKEND = "_compile.compile_inner", "OutputGraph.call_user_compiler"


def dynamo_seconds():
    """Dynamo's own seconds since its timers were last cleared (torch._dynamo.reset() clears them; see dynamo_s
    above), or None where this torch keeps no such timers."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        return None
    return sum(metrics.get(_DYNAMO_WHOLE, ())) - sum(metrics.get(_DYNAMO_BACKEND, ()))


def timed_first_call(fn, inputs, device):
    """(seconds, output, Dynamo's share of the seconds or None) of one call: timed_call and dynamo_s."""
    before = dynamo_seconds()
    seconds, out = timed_call(fn, inputs, device)
    after = dynamo_seconds()
    return seconds, out, (after - before if after and before is not None else None)  # 0: no timers ran


def compile_with(model, backend):
    """The callable to time for `backend`: the model itself for eager, else torch.compile's wrapper."""
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model, backend="inductor")
    if backend == FLOOR:
        return torch.compile(model, backend=lambda gm, example_inputs: gm.forward)
    if backend == "ember":
        return torch.compile(model, backend="ember", options=EMBER_OPTIONS)
    if backend == "inductor-ro":
        return torch.compile(model, backend="inductor", mode="reduce-overhead")
    if backend == "ember-ro":  # what mode="reduce-overhead" selects, with fallback="raise" (mode and options exclude each other)
        return torch.compile(model, backend="ember", options={**EMBER_OPTIONS, "cudagraphs": True})
    if backend == "inductor-ma":
        return torch.compile(model, backend="inductor", mode="max-autotune")
    if backend == "ember-ma":  # what mode="max-autotune" selects, with fallback="raise"
        return torch.compile(model, backend="ember", options={**EMBER_OPTIONS, "cudagraphs": True, "autotune": True})
    raise ValueError(f"unknown backend {backend!r}")


def settle():
    """Waits for the CUDA kernels ember still compiles in the background (ember.wait_for_compiles): a first call
    may run a group's ATen ops while its kernel compiles, so steady timings start after this, with the kernels
    calls keep running."""
    import ember

    ember.wait_for_compiles()


def before_call(backend):
    """A new iteration for the CUDA graph backends: what training loops under reduce-overhead do."""
    if backend[-3:] in BACKEND_MODES:
        torch.compiler.cudagraph_mark_step_begin()


def mode_of(backend):
    """The torch.compile mode a backend row runs in."""
    return BACKEND_MODES.get(backend[-3:], "default")


def error_text(e):
    """One line: the exception's type and first line, and ember's note on the node it was running, if any."""
    while getattr(e, "inner_exception", None) is not None:  # Dynamo's BackendCompilerFailed wraps the real one
        e = e.inner_exception
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    text += "".join(" " + line for line in lines[1:] if line.startswith("(ember:"))
    return text[:400]


def run_workload(w, device, backends, repeat, warmup, block=10):
    """One result dict: the workload's description and a row per backend.

    Phase 1, per backend from a clean Dynamo state (torch._dynamo.reset()): the first call, compile included,
    and its error against eager's first call. Phase 2: the steady latency. Each reset dropped the code compiled
    before it, so the backends that passed phase 1 are compiled once more (untimed; Dynamo keeps one entry per
    backend) and then timed taking turns, so that noise from other work on the machine falls on all of them
    alike: in turns of `block` consecutive timed calls after an untimed one (latency_ms), then in turns of one
    call (latency_alternating_ms).
    """
    result = {"workload": w.name, "shape": w.describe(device), "small_batch": w.small_batch, "training": w.training,
              "backends": {}}
    missing = w.missing()
    if missing:
        result["skipped"] = f"needs {', '.join(missing)}"
        return result
    torch.manual_seed(0)
    try:
        model, inputs = w.build(device)
    except Exception as e:
        result["skipped"] = "build failed: " + error_text(e)
        return result
    rows = result["backends"]
    grad_mode = torch.enable_grad if w.training else torch.no_grad
    counters = torch._dynamo.utils.counters

    # Phase 1: first call and correctness.
    reference = None
    passed = []
    for backend in backends:
        row = rows[backend] = {}
        if backend != "eager" and reference is None:
            row["error"] = "no eager reference"
            continue
        torch._dynamo.reset()
        counters.clear()
        try:
            with grad_mode():
                fn = compile_with(model, backend)
                before_call(backend)
                # The garbage of the backends before (their graphs, a reset's caches) is collected here, not by
                # a collection that would fall inside this first call's tracing.
                gc.collect()
                row["first_call_s"], out, dynamo = timed_first_call(fn, inputs, device)
                if backend != "eager" and dynamo is not None:
                    row["dynamo_s"] = dynamo
                out = snapshot(out)
                later = None
                if backend.startswith("ember"):
                    # The first call may have run ATen stand-ins for kernels still compiling: the error is also
                    # that of a call after they loaded.
                    start = time.perf_counter()
                    settle()
                    row["compiles_waited_s"] = time.perf_counter() - start
                    before_call(backend)
                    later = snapshot(fn(*inputs))
            if backend == "eager":
                reference = out
            else:
                row["graphs"] = counters["stats"]["unique_graphs"]
                errors = [max_rel_error(o, reference) for o in (out, later) if o is not None]
                row["max_rel_error"] = float("nan") if any(math.isnan(e) for e in errors) else max(errors)
            passed.append(backend)
        except Exception as e:
            row["error"] = error_text(e)

    # Phase 2: steady latency, backends alternating.
    torch._dynamo.reset()
    fns = {}
    samples = {}
    with grad_mode():
        for backend in passed:
            try:
                fn = compile_with(model, backend)
                for _ in range(warmup):
                    before_call(backend)
                    fn(*inputs)
                settle()
                fns[backend], samples[backend] = fn, []
            except Exception as e:
                rows[backend]["error"] = "when compiled again: " + error_text(e)
        alternating = {backend: [] for backend in fns}
        for timed, per_turn in ((samples, block), (alternating, 1)):
            while fns and len(timed[next(iter(fns))]) < repeat:
                for backend, fn in list(fns.items()):
                    try:
                        if per_turn > 1:  # the block's first call brings the backend's code and data back
                            before_call(backend)
                            fn(*inputs)
                        for _ in range(min(per_turn, repeat - len(timed[backend]))):
                            before_call(backend)
                            timed[backend].append(timed_call(fn, inputs, device)[0])
                    except Exception as e:
                        rows[backend]["error"] = "during timing: " + error_text(e)
                        del fns[backend]
    torch._dynamo.reset()
    for backend in fns:
        rows[backend]["latency_ms"] = 1e3 * statistics.median(samples[backend])
        rows[backend]["latency_alternating_ms"] = 1e3 * statistics.median(alternating[backend])
    eager_ms = rows.get("eager", {}).get("latency_ms")
    eager_alternating_ms = rows.get("eager", {}).get("latency_alternating_ms")
    for row in rows.values():
        if eager_ms and row.get("latency_ms"):
            row["speedup"] = eager_ms / row["latency_ms"]
        if eager_alternating_ms and row.get("latency_alternating_ms"):
            row["speedup_alternating"] = eager_alternating_ms / row["latency_alternating_ms"]
    return result


# ----------------------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------------------


def fmt(value, spec, width):
    return format("-" if value is None else format(value, spec), f">{width}")


def print_table(results):
    cold = any("cold_first_call_s" in row for r in results for row in r.get("backends", {}).values())
    warm = any("warm_first_call_s" in row for r in results for row in r.get("backends", {}).values())
    header = (f"{'workload':<20} {'backend':<11} {'first call s':>12} {'Dynamo s':>8} "
              + (f"{'cold first s':>12} {'Dynamo s':>8} " if cold else "")
              + (f"{'warm first s':>12} {'Dynamo s':>8} " if warm else "")
              + f"{'latency ms':>11} {'speedup':>8} {'alt.':>6} {'max rel err':>11} {'graphs':>6}  note")
    print(header)
    print("-" * len(header))
    for r in results:
        if "skipped" in r:
            print(f"{r['workload']:<20} {'':<11} {'':>12} {'':>8} " + (f"{'':>12} {'':>8} " if cold else "")
                  + (f"{'':>12} {'':>8} " if warm else "")
                  + f"{'':>11} {'':>8} {'':>6} {'':>11} {'':>6}  skipped: {r['skipped']}")
            continue
        for backend, row in r["backends"].items():
            speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
            alternating = f"{row['speedup_alternating']:.2f}x" if "speedup_alternating" in row else "-"
            print(f"{r['workload']:<20} {backend:<11} {fmt(row.get('first_call_s'), '.3f', 12)} {fmt(row.get('dynamo_s'), '.3f', 8)} "
                  + (f"{fmt(row.get('cold_first_call_s'), '.3f', 12)} {fmt(row.get('cold_dynamo_s'), '.3f', 8)} " if cold else "")
                  + (f"{fmt(row.get('warm_first_call_s'), '.3f', 12)} {fmt(row.get('warm_dynamo_s'), '.3f', 8)} " if warm else "")
                  + f"{fmt(row.get('latency_ms'), '.3f', 11)} {speedup:>8} {alternating:>6} {fmt(row.get('max_rel_error'), '.1e', 11)} "
                  f"{fmt(row.get('graphs'), 'd', 6)}  {row.get('error', '')}")


def write_chart(results, path):
    """A PNG of each workload's speedup over eager per backend, next to the JSON; skipped cleanly without
    matplotlib. Returns the path written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print("matplotlib not installed: no chart", file=sys.stderr)
        return None
    rows = [r for r in results if "skipped" not in r]
    backends = [b for b in BACKENDS if b != "eager" and any("speedup" in r["backends"].get(b, {}) for r in rows)]
    if not rows or not backends:
        return None
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4.5))
    for i, backend in enumerate(backends):
        xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["backends"].get(backend, {}).get("speedup", 0.0) for r in rows]
        ax.bar(xs, ys, width, label=backend)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["workload"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("speedup over eager (higher is better)")
    ax.set_title(os.path.splitext(os.path.basename(path))[0], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_chart_json(results, args, argv):
    """--json: the run's speedups in bench/chart.py's results schema."""
    import datetime
    import importlib.util

    spec = importlib.util.spec_from_file_location("ember_bench_chart", os.path.join(os.path.dirname(__file__), "chart.py"))
    chart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chart)
    command = "python bench/harness.py " + " ".join(sys.argv[1:] if argv is None else argv)
    modes = args.modes or ("default,reduce-overhead" if args.device == "cuda" else "default")
    data = chart.from_harness(results, machine_info(args.device), command, datetime.date.today().isoformat(),
                              f"bench/harness.py on {args.device}, modes {modes}")
    with open(args.json, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {args.json}")


def machine_info(device):
    info = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device}
    try:
        import ember

        info["ember"] = ember.__version__
    except Exception as e:
        info["ember"] = "not importable: " + error_text(e)
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = cpu_name()
    return info


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cold_first_call(name, backend, device, threads=0, env=None, warm=False):
    """(seconds, Dynamo's share of them or None) of `backend`'s first call on workload `name` in this fresh process
    (a child of the fork server, fresh_processes): the cache variables set to `env` (fresh cache folders for what
    it leaves out), eager runs once (the device, its libraries and the model warmed as any program's first eager
    call would), then the backend's first call is timed, Dynamo's own first use in the process included. `warm`:
    inductor's caches stay on (as by default), so that a second process over the same `env` folders reads what
    the first wrote."""
    for key in CACHE_ENV:
        os.environ.pop(key, None)
    os.environ.update(env or {})
    if threads:
        torch.set_num_threads(threads)
    torch._dynamo.config.suppress_errors = False
    made = tempfile.mkdtemp(prefix="ember-bench-caches-") if warm else disable_inductor_caches()
    try:
        w = WORKLOADS[name]
        torch.manual_seed(0)
        model, inputs = w.build(device)
        with (torch.enable_grad if w.training else torch.no_grad)():
            timed_call(model, inputs, device)
            fn = compile_with(model, backend)
            before_call(backend)
            seconds, _, dynamo = timed_first_call(fn, inputs, device)
        return seconds, dynamo
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _cold_child(connection, *args):
    """The target of a fork server's child: cold_first_call's value, or the error's text, sent back."""
    try:
        connection.send(cold_first_call(*args))
    except BaseException as e:
        connection.send(error_text(e))
    connection.close()


_FRESH = None


def fresh_processes():
    """(multiprocessing context, module) for --cold's fresh processes: a fork server, started once, that imported
    this file (as the module `harness`: torch, Dynamo) and the workloads' packages but never touched the device;
    each child forked from it starts as a fresh process would after those imports. Spawning a new interpreter
    per child spent about 15 s each on an H200 host, mostly on imports that are neither backend's first call."""
    global _FRESH
    if _FRESH is None:
        import multiprocessing

        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["harness", "torchvision", "transformers"])  # the missing ones are skipped
        import harness  # the children's copy of this file, found by name (the caller's may be __main__)

        _FRESH = context, harness
    return _FRESH


def cold_first_call_in_child(name, backend, args, shared=None):
    """(seconds, Dynamo's share of them or None) of `backend`'s first call on workload `name` in a fresh process
    (cold_first_call in a child of the fork server), or None. `shared`: a folder holding every cache the child
    uses, with inductor's caches on (--warm), instead of fresh folders."""
    context, module = fresh_processes()
    # Fresh cache folders for the child, unless the caller chose them (not this process's fresh ones).
    env = dict(_CALLER_CACHE_ENV)
    fresh = tempfile.mkdtemp(prefix="ember-bench-cuda-cache-")
    env.setdefault("CUDA_CACHE_PATH", fresh)
    if shared:
        env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(shared, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(shared, "inductor", "triton"),
               "EMBER_CACHE_DIR": os.path.join(shared, "ember"), "CUDA_CACHE_PATH": os.path.join(shared, "cuda")}
    print(f"[harness] {name} {backend}: first call in a fresh process ...", file=sys.stderr, flush=True)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=module._cold_child,
                            args=(send, name, backend, args.device, args.threads, env, bool(shared)))
    try:
        child.start()
        send.close()
        try:
            got = receive.recv()
        except EOFError:
            got = "the process ended without a result"
        child.join()
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    if isinstance(got, tuple):
        dynamo = "" if got[1] is None else f" (Dynamo {got[1]:.3f} s)"
        print(f"[harness] {name} {backend}: first call {got[0]:.3f} s{dynamo}", file=sys.stderr, flush=True)
        return got
    print(f"[harness] {name} {backend}: the fresh process failed (exit code {child.exitcode}): {got}", file=sys.stderr)
    return None


def cold_wanted(result, over):
    """--cold-over: whether `result`'s workload gets fresh processes. In process, inductor's compile finds what
    earlier workloads warmed (20 x Linear on an H200: 0.354 s there, 2.3-3.1 s in fresh processes), so a ratio
    over the target there is the one to read again in fresh processes; the others already meet it. Without
    both first calls, or `over` 0, every workload does."""
    rows = result.get("backends", {})
    ember, inductor = rows.get("ember", {}).get("first_call_s"), rows.get("inductor", {}).get("first_call_s")
    return over <= 0 or not ember or not inductor or ember / inductor > over


def cold_only_result(w, device, backends):
    """--cold-only: the result dict run_workload would start, with an empty row per compiling backend for
    cold_first_calls to fill."""
    result = {"workload": w.name, "shape": w.describe(device), "small_batch": w.small_batch, "training": w.training,
              "backends": {b: {} for b in backends if b != "eager"}}
    missing = w.missing()
    if missing:
        result["skipped"] = f"needs {', '.join(missing)}"
    return result


def cold_first_calls(result, args):
    """--cold: each backend's first call on `result`'s workload in fresh processes (cold_first_call_in_child),
    args.cold_repeat rounds of one process per backend, and their medians into the backend's row."""
    rows = {b: row for b, row in result.get("backends", {}).items() if b != "eager" and "error" not in row}
    samples = {b: [] for b in rows}
    warm = {b: [] for b in rows}
    for _ in range(max(1, args.cold_repeat)):
        for backend in rows:
            shared = tempfile.mkdtemp(prefix="ember-bench-warm-") if getattr(args, "warm", False) else None
            try:
                cold = cold_first_call_in_child(result["workload"], backend, args, shared)
                if cold is not None:
                    samples[backend].append(cold)
                    if shared:  # a second fresh process over the caches the first one filled
                        again = cold_first_call_in_child(result["workload"], backend, args, shared)
                        if again is not None:
                            warm[backend].append(again)
            finally:
                if shared:
                    shutil.rmtree(shared, ignore_errors=True)
    for backend, row in rows.items():
        if warm[backend]:
            row["warm_first_call_s"] = statistics.median(s for s, _ in warm[backend])
            dynamo = [d for _, d in warm[backend] if d is not None]
            row["warm_dynamo_s"] = statistics.median(dynamo) if dynamo else None
        if not samples[backend]:
            continue
        seconds = [s for s, _ in samples[backend]]
        dynamo = [d for _, d in samples[backend] if d is not None]
        row["cold_first_call_s"] = statistics.median(seconds)
        row["cold_dynamo_s"] = statistics.median(dynamo) if dynamo else None
        if args.cold_repeat > 1:
            row["cold_first_call_samples"], row["cold_dynamo_samples"] = seconds, dynamo


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="", help="comma-separated workload names (default: all)")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per backend (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls after the first, before timing")
    parser.add_argument("--block", type=int, default=10,
                        help="consecutive timed calls per backend per turn for latency_ms (see latency_alternating_ms)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/harness_<device>.json)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the speedups as a results file for bench/chart.py (its docstring has the schema)")
    parser.add_argument("--no-inductor", action="store_true", help="skip torch.compile(backend='inductor')")
    parser.add_argument("--modes", default=None,
                        help="comma-separated: default, reduce-overhead, max-autotune (default: the first two on CUDA, default on the CPU)")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    parser.add_argument("--floor", action="store_true",
                        help="add the 'dynamo' row: Dynamo with the captured graph run eagerly (its per-call floor)")
    parser.add_argument("--cold", action="store_true",
                        help="also time each backend's first call in a process of its own (cold_first_call_s)")
    parser.add_argument("--cold-repeat", type=int, default=1,
                        help="with --cold: fresh processes per workload and backend, in turns (medians reported)")
    parser.add_argument("--cold-over", type=float, default=0.0,
                        help="with --cold: fresh processes only for workloads whose in-process first call under ember "
                             "took more than this share of inductor's (e.g. 0.25, the first-call target)")
    parser.add_argument("--warm", action="store_true",
                        help="with --cold: each fresh process is followed by a second one over the caches it filled "
                             "(inductor's caches on in both): warm_first_call_s")
    parser.add_argument("--cold-only", action="store_true",
                        help="with --cold: fresh processes only, no in-process first calls or latencies (a suite's "
                             "first calls split over several runs)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.list:
        for w in WORKLOADS.values():
            flags = [f for f, on in (("small_batch", w.small_batch), ("training", w.training)) if on]
            flags += [f"needs {pkg}" for pkg in w.needs]
            cpu = "" if w.cpu_shape == w.shape else f"\n{'':<20} on the CPU: {w.cpu_shape}"
            print(f"{w.name:<20} {w.shape}{'  [' + ', '.join(flags) + ']' if flags else ''}{cpu}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    modes = (args.modes or ("default,reduce-overhead" if args.device == "cuda" else "default")).split(",")
    backends = [b for b in BACKENDS
                if not (b.startswith("inductor") and args.no_inductor)
                and (b == "eager" or mode_of(b) in modes)]
    if args.floor:
        backends.insert(1, FLOOR)

    torch._dynamo.config.suppress_errors = False  # a failing backend must raise, never fall back to eager
    made_cache_dir = disable_inductor_caches()
    out = args.out or os.path.join(RESULTS_DIR, f"harness_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write_json():
        with open(out, "w") as f:
            json.dump({"machine": machine_info(args.device), "repeat": args.repeat, "warmup": args.warmup,
                       "results": results}, f, indent=2)

    results = []
    try:
        for name in names:
            print(f"[harness] {name} ...", file=sys.stderr, flush=True)
            if args.cold and args.cold_only:
                results.append(cold_only_result(WORKLOADS[name], args.device, backends))
            else:
                results.append(run_workload(WORKLOADS[name], args.device, backends, args.repeat, args.warmup, args.block))
            write_json()  # after each workload, so a run stopped by a time limit keeps what it measured
    finally:
        if made_cache_dir:
            shutil.rmtree(made_cache_dir, ignore_errors=True)

    if args.cold:
        for r in results:
            if cold_wanted(r, args.cold_over):
                cold_first_calls(r, args)
                write_json()

    print_table(results)
    write_json()
    print(f"wrote {out}")
    if args.json:
        write_chart_json(results, args, argv)
    png = write_chart(results, os.path.splitext(out)[0] + ".png")
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
