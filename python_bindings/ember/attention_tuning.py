"""max-autotune's choice of attention kernel (issue #61): each CUDA attention call route_attention pointed at
fused_attention is timed, before AOTAutograd traces it, in every kernel that takes it, and the fastest is pinned
into the call.

1. Only under autotune (mode="max-autotune", "max-autotune-no-cudagraphs", options={"autotune": True}). The
   default mode keeps attention.py's fixed order: cuDNN (16-bit, Hopper), flash (no mask), memory-efficient.
2. Candidates: each fused kernel that takes the call's operands (attention._kernels_for, the default first)
   and is not turned off by torch.backends.cuda's *_sdp_enabled, and the math form (two matmuls and a softmax,
   which AOTAutograd traces into ops ember fuses) where math_sdp_enabled. A call no fused kernel takes is left
   as it is.
3. Timing: on random operands of the call's sizes, strides and dtypes (a symbolic size at its hint), the L2
   cleared before each run, the median of several runs after a warm-up; forward and backward where the call
   needs gradients. Each run is queued behind a GPU wait long enough for Python to queue all its launches, so
   the time is the GPU's (as the compiled graph's C++ calls or CUDA graphs see it), not this file's Python
   launching the math form's several kernels. The winner must be at least 3% faster than the default kernel, so that the choice does not
   flip between processes on noise.
4. The timing's wall time counts against autotune_budget_s, per Dynamo graph; once it is spent the calls left
   keep the default kernel.
5. Each timed choice goes to <cache_dir>/attention, keyed by torch's and CUDA's versions, the device and the
   call's signature: a later process reads it instead of timing, and a damaged or foreign record is a miss. A
   whole compile from the compile cache holds the choice already and times nothing.
6. ember.explain lists each call's candidates, their times and the winner.
"""

import hashlib
import inspect
import json
import logging
import os
import statistics
import time

import torch

from . import cache, report
from .attention import _kernels_for, fused_attention

_log = logging.getLogger("ember")

MIN_GAIN = 0.03
RUNS = 10
_GIVE_UP_MS = 50.0  # a first timed run slower than this is not repeated
_QUEUE_CYCLES = 2_000_000  # the GPU's wait before each run, about 1 ms: longer than queuing the run takes
_ENABLED = {"cudnn": "cudnn_sdp_enabled", "flash": "flash_sdp_enabled", "efficient": "mem_efficient_sdp_enabled",
            "math": "math_sdp_enabled"}
_SIGNATURE = inspect.signature(fused_attention)

stats = {"timed": 0, "from_disk": 0, "budget_spent": 0}  # calls tuned since the process started (tests read it)


def tune_attention(gm, budget_s):
    """Pins the fastest kernel into each fused_attention call of `gm` it can time; returns how many it pinned."""
    deadline = time.perf_counter() + budget_s
    pinned = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not fused_attention or "kernel" in node.kwargs:
            continue
        call = _example_call(node)
        if call is None:
            continue
        candidates = _candidates(call)
        if len(candidates) < 2:
            continue
        winner = _choose(call, candidates, deadline)
        node.kwargs = dict(node.kwargs, kernel=winner)
        pinned += 1
    if pinned:
        gm.recompile()
    return pinned


def _example_call(node):
    """fused_attention's arguments with the FX nodes replaced by their example values (fake tensors), or None."""
    try:
        bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    call = {}
    for name, value in bound.arguments.items():
        if isinstance(value, torch.fx.Node):
            value = value.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                return None
        call[name] = value
    return call


def _candidates(call):
    fused = _kernels_for(call["query"], call["key"], call["value"], call["attn_mask"], call["dropout_p"],
                         call["is_causal"], call["enable_gqa"])
    if not fused:
        return []
    return fused[:1] + [k for k in fused[1:] + ["math"] if getattr(torch.backends.cuda, _ENABLED[k], lambda: True)()]


def _choose(call, candidates, deadline):
    """The kernel for `call`: from disk, the default where the budget is spent, else the fastest timed."""
    operands = _operands(call)
    if operands is None:
        return candidates[0]
    key = _record_key(call, operands, candidates)
    shape = _describe(operands, call)
    winner = _read_record(key, candidates)
    if winner is not None:
        stats["from_disk"] += 1
        report.record_attention(f"{shape}: {winner} (from disk)")
        return winner
    if time.perf_counter() >= deadline:
        stats["budget_spent"] += 1
        report.record_attention(f"{shape}: {candidates[0]} (default: budget spent)")
        return candidates[0]
    timings = {}
    with cache._outside_tracing(), torch.cuda.device(call["query"].device):  # the events time that device's stream
        tensors = _real_operands(operands, call)
        flush = torch.empty(_flush_bytes(tensors["query"].device), dtype=torch.uint8, device=tensors["query"].device)
        for kernel in candidates:
            timings[kernel] = _time(kernel, tensors, call, flush)
            if time.perf_counter() >= deadline:
                break
        del flush, tensors
    stats["timed"] += 1
    default_ms = timings.get(candidates[0], -1.0)
    ran = {k: ms for k, ms in timings.items() if ms >= 0}
    winner = min(ran, key=ran.get) if ran else candidates[0]
    if default_ms >= 0 and ran[winner] > default_ms * (1 - MIN_GAIN):
        winner = candidates[0]
    complete = len(timings) == len(candidates)
    if complete:
        _write_record(key, winner, timings)
    listed = ", ".join(f"{k} {ms * 1e3:.1f} us" if ms >= 0 else f"{k} could not run" for k, ms in
                       sorted(timings.items(), key=lambda kv: (kv[1] < 0, kv[1])))
    how = "max-autotune" if complete else "budget spent while timing"
    report.record_attention(f"{shape}: {winner} ({how}); default {candidates[0]}; timed: {listed}")
    return winner


def _operands(call):
    """(sizes, strides, dtype, requires_grad) of the call's tensors at their hints, or None where a size has none."""
    out = {}
    for name in ("query", "key", "value", "attn_mask"):
        t = call[name]
        if t is None:
            out[name] = None
            continue
        try:
            sizes = tuple(_hint(s) for s in t.shape)
            strides = tuple(_hint(s) for s in t.stride())
        except ValueError:
            return None
        out[name] = (sizes, strides, t.dtype, bool(t.requires_grad) and torch.is_grad_enabled())
    return out


def _hint(s):
    if isinstance(s, int):
        return s
    hint = getattr(s.node, "hint", None)
    if hint is None:
        raise ValueError("a size without a hint")
    return int(hint)


def _describe(operands, call):
    sizes, _, dtype, needs_grad = operands["query"]
    text = f"attention {tuple(sizes)} {str(dtype).replace('torch.', '')}"
    if operands["attn_mask"] is not None:
        text += f", mask {tuple(operands['attn_mask'][0])} {str(operands['attn_mask'][2]).replace('torch.', '')}"
    if call["is_causal"]:
        text += ", causal"
    if operands["key"][0][2] != sizes[2]:
        text += f", {operands['key'][0][2]} keys"
    return text + (", with backward" if needs_grad else "")


def _real_operands(operands, call):
    device = call["query"].device
    tensors = {}
    for name, spec in operands.items():
        if spec is None:
            tensors[name] = None
            continue
        sizes, strides, dtype, needs_grad = spec
        t = torch.empty_strided(sizes, strides, dtype=dtype, device=device)
        if dtype == torch.bool:
            t.fill_(True)
        elif name == "attn_mask":
            t.zero_()
        else:
            t.normal_()
        tensors[name] = t.requires_grad_(needs_grad and dtype.is_floating_point)
    return tensors


def _flush_bytes(device):
    props = torch.cuda.get_device_properties(device)
    return 2 * int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def _time(kernel, tensors, call, flush):
    """Milliseconds per run of `kernel` on `tensors` (the median after an untimed run: cuDNN builds its plan at the
    first), or -1 where it raises."""
    inputs = [t for t in (tensors["query"], tensors["key"], tensors["value"], tensors["attn_mask"])
              if t is not None and t.requires_grad]

    def run():
        out = fused_attention(tensors["query"], tensors["key"], tensors["value"], tensors["attn_mask"],
                              call["dropout_p"], call["is_causal"], call["scale"], call["enable_gqa"], kernel=kernel)
        if inputs:
            torch.autograd.grad(out, inputs, torch.ones_like(out))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    try:
        run()
        for _ in range(RUNS):
            torch.cuda._sleep(_QUEUE_CYCLES)
            flush.zero_()
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            if times[0] > _GIVE_UP_MS:
                break
    except Exception as e:  # a kernel that does not take these operands after all: not a candidate
        _log.debug("ember: attention kernel %s could not run (%s: %s)", kernel, type(e).__name__, e)
        return -1.0
    return statistics.median(times)


def _record_key(call, operands, candidates):
    device = call["query"].device
    index = device.index if device.index is not None else torch.cuda.current_device()
    return repr(("attention", 1, torch.__version__, torch.version.cuda, torch.cuda.get_device_name(index),
                 torch.cuda.get_device_capability(index),
                 sorted((name, spec[0], spec[1], str(spec[2]), spec[3]) for name, spec in operands.items() if spec),
                 bool(call["is_causal"]), call["scale"], candidates))


def _record_path(key):
    root = cache._root()
    if root is None:
        return None
    return os.path.join(root, "attention", hashlib.sha256(key.encode()).hexdigest()[:40] + ".json")


def _read_record(key, candidates):
    """The winner an earlier process kept for `key`, or None (none, or a record that is damaged or not this key's)."""
    path = _record_path(key)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        winner = record["winner"]
        if record["key"] != key or winner not in candidates:
            raise ValueError("another key's record")
        return winner
    except Exception as e:  # unreadable, truncated, another key's: a miss
        _log.debug("ember: attention record %s is unusable (%s: %s); timing afresh", path, type(e).__name__, e)
        return None


def _write_record(key, winner, timings):
    path = _record_path(key)
    if path is None:
        return
    text = json.dumps({"key": key, "winner": winner, "ms": timings}).encode()
    try:
        cache._write_atomically(path, lambda f: f.write(text))
    except OSError as e:  # a full or read-only disk: the choice is not kept, nothing else lost
        _log.debug("ember: attention record %s not written (%s)", path, e)
