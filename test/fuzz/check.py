"""Runs one program eagerly and through torch.compile(backend="ember") and compares the two.

`check(fn, make_inputs, device, mode, grad)` returns a dict: {"kind": "ok" | "invalid" | "mismatch" |
"error" | "refusal", "detail": text, "refused": [messages]}. "invalid": eager itself raised, so the program
says nothing about ember. Compared, per call: every output, every input after the call (in-place ops on
inputs) and, with grad, the gradients of the inputs that require them after backward of a seeded
random-weighted sum of the floating outputs.

Refusals and errors. ember compiles in its default fallback mode ("warn"): a graph it cannot compile
runs eagerly with a warning. The exception behind that warning decides what it was: an EmberError is
ember's deliberate refusal of something it does not support (lower.py and friends raise it for dtypes,
layouts and call targets outside ember's set), counted as a refusal with its message; any other
exception (a RuntimeError out of the C++ compiler or planner, a Python bug in the lowering) means ember
failed on a graph of ATen ops it claims, since ember resolves every ATen op through the dispatcher
(backend/ir/op_table.cpp) and has no op list of its own, and is counted as an error. Running in warn
mode also lets the compared results include the graphs ember did compile when another one fell back.
"""

import sys
import warnings

import torch

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float64: 1e-7}
LOOSE = 10  # reductions, matmuls and norms add up many rounding errors
ILL_CONDITIONED = 4  # how much farther than eager's float32 result ember's may be from float64's (check_program)


def _flatten(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _flatten(y, out)
    return out


def _compare(name, ref, got, loose, low=None, ratios=None):
    """None where got matches ref, else a one-line description. ratios: a list that gets the largest error of a
    floating comparison as a multiple of what the tolerance allows."""
    if not isinstance(got, torch.Tensor):
        return f"{name}: got {type(got).__name__}, expected a tensor"
    if got.dtype != ref.dtype:
        return f"{name}: dtype {got.dtype}, expected {ref.dtype}"
    if got.shape != ref.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    if got.device != ref.device:
        return f"{name}: device {got.device}, expected {ref.device}"
    if ref.numel() == 0:
        return None
    r, g = ref.detach().cpu(), got.detach().cpu()
    if not r.is_floating_point():
        if torch.equal(r, g):
            return None
        bad = (r != g).sum().item()
        return f"{name}: {bad} of {r.numel()} {r.dtype} elements differ"
    r64, g64 = r.double(), g.double()
    rn, gn = torch.isnan(r64), torch.isnan(g64)
    if not torch.equal(rn, gn):
        return f"{name}: NaN at {(rn != gn).sum().item()} positions where the other side has a number"
    rinf, ginf = torch.isinf(r64), torch.isinf(g64)
    if not torch.equal(r64[rinf], g64[rinf]) or not torch.equal(rinf, ginf):
        # An fp16 value next to the overflow threshold may round to inf on one side only.
        near = r.dtype in (torch.float16, torch.bfloat16) and (
            torch.where(rinf, g64, r64)[rinf != ginf].abs() > torch.finfo(r.dtype).max / 2).all()
        if not near:
            return f"{name}: Inf at {(rinf != ginf).sum().item()} positions differ"
    finite = ~(rn | rinf | ginf)
    if not finite.any():
        return None
    rf, gf = r64[finite], g64[finite]
    scale = max(1.0, rf.abs().max().item())
    # A float32 result computed from float16 / bfloat16 values carries their rounding errors.
    tol = max(TOL.get(r.dtype, 1e-4), TOL.get(low, 0)) * (LOOSE if loose else 1)
    err = (rf - gf).abs()
    allowed = tol * scale + tol * rf.abs()
    if ratios is not None:
        ratios.append((err / allowed).max().item())
    if (err <= allowed).all():
        return None
    i = (err - allowed).argmax().item()
    return (f"{name}: max error {err.max().item():.3g} (allowed {tol:.1g} x magnitude {scale:.3g}); "
            f"expected {rf[i].item():.6g}, got {gf[i].item():.6g}")


def _cotangents(outs, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]


def _run(fn, inputs, grad, seed):
    """(outputs, inputs after the call, grads) of one call."""
    outs = _flatten(fn(*inputs), [])
    grads = []
    if grad:
        leaves = [t for t in inputs if t.requires_grad]
        diff = [o for o in outs if o.requires_grad]
        if leaves and diff:
            cot = _cotangents(diff, seed)
            loss = sum((o.float() * c.float()).sum() for o, c in zip(diff, cot))
            grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
    # Clone now: the next compiled call may overwrite buffers (reduce-overhead replays).
    outs = [o.detach().clone() for o in outs]
    after = [t.detach().clone() for t in inputs]
    return outs, after, grads


def check(fn, make_inputs, device="cpu", mode="default", grad=True, loose=False, calls=None, backend="ember",
          low=None, reference_float64=False):
    """low: the least precise float dtype the program computes in (its tolerance applies to every output).
    reference_float64: eager runs on float64 copies of the floating inputs, with float64 as the default dtype
    (what integer and bool values promote to: atan2 of two bool tensors), and its results are compared in the
    compiled results' dtypes."""
    # cuDNN's float32 convolutions run in TF32 by default, and ember may choose another layout and so another
    # algorithm (layout.py): two TF32 roundings differ by ~1e-3, more than float32's tolerance. Full float32 on
    # both sides makes the comparison about ember.
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return _check(fn, make_inputs, device, mode, grad, loose, calls, backend, low, reference_float64)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _float64(inputs):
    return [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]


def _like(ref, got):
    """ref's tensors in got's dtypes (a float64 reference)."""
    return tuple([r.to(g.dtype) if isinstance(r, torch.Tensor) and isinstance(g, torch.Tensor) else r
                  for r, g in zip(rs, gs)] for rs, gs in zip(ref, got))


def _check(fn, make_inputs, device, mode, grad, loose, calls, backend, low, reference_float64=False):
    import ember  # noqa: F401
    import ember.report as report

    calls = calls or (1 if mode == "default" else 3)  # captures, or tuning at the first call then its choice
    refs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default_dtype = torch.get_default_dtype()
        try:
            for k in range(calls):
                inputs = make_inputs(device, k)
                if reference_float64:
                    torch.set_default_dtype(torch.float64)
                refs.append(_run(fn, _float64(inputs) if reference_float64 else inputs, grad, k))
                torch.set_default_dtype(default_dtype)
        except Exception as e:
            torch.set_default_dtype(default_dtype)
            return {"kind": "invalid", "detail": f"eager: {type(e).__name__}: {e}"[:300], "refused": []}

    failures = []  # (kind, message) of each graph ember did not compile
    original = report.record_fallback

    def recording_fallback(kind, message):
        exc = sys.exc_info()[1]
        is_refusal = type(exc).__name__ == "EmberError"
        failures.append(("refusal" if is_refusal else "error", f"{kind} graph: {type(exc).__name__}: {message}"))
        return original(kind, message)

    torch._dynamo.reset()
    report.record_fallback = recording_fallback
    try:
        compiled = torch.compile(fn, backend=backend, mode=None if mode == "default" or backend != "ember" else mode,
                                 fullgraph=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(calls):
                try:
                    got = _run(compiled, make_inputs(device, k), grad, k)
                except Exception as e:
                    return {"kind": "error", "detail": f"call {k}: {type(e).__name__}: {e}"[:2000],
                            "refused": [m for _, m in failures]}
                ratios = []
                problem = _compare_call(_like(refs[k], got) if reference_float64 else refs[k], got, loose, low, ratios)
                if problem:
                    return {"kind": "mismatch", "detail": f"call {k}: {problem}", "refused": [m for _, m in failures],
                            "ratio": max(ratios, default=float("inf"))}
    finally:
        report.record_fallback = original
        torch._dynamo.reset()
    errors = [m for kind, m in failures if kind == "error"]
    if errors:
        return {"kind": "error", "detail": errors[0][:2000], "refused": []}
    refused = [m for _, m in failures]
    return {"kind": "refusal" if refused else "ok", "detail": refused[0][:500] if refused else "", "refused": refused}


def _compare_call(ref, got, loose, low, ratios=None):
    (ro, ra, rg), (go, ga, gg) = ref, got
    if len(ro) != len(go):
        return f"{len(go)} outputs, expected {len(ro)}"
    for what, rs, gs in (("output", ro, go), ("input after the call", ra, ga), ("grad of input", rg, gg)):
        if len(rs) != len(gs):
            return f"{len(gs)} {what}s, expected {len(rs)}"
        for n, (r, g) in enumerate(zip(rs, gs)):
            if r is None or g is None:
                if (r is None) != (g is None):
                    return f"{what} {n}: {'None' if g is None else 'a tensor'}, expected {'None' if r is None else 'a tensor'}"
                continue
            problem = _compare(f"{what} {n}", r, g, loose, low, ratios)
            if problem:
                return problem
    return None


def check_program(program, device="cpu", mode="default"):
    """check() for a program data structure (program.py). A mismatch or error that torch.compile with
    backend="aot_eager" (AOTAutograd, no ember) shows too is torch's, not ember's: kind "upstream"; so is a
    mismatch over NaN where eager on float64 inputs agrees with ember (eager's float32 kernel is the odd one).
    A program float32 cannot resolve is no ember bug either: where eager's own float32 result is outside the
    tolerance of its float64 one, and ember's is within ILL_CONDITIONED times eager's distance of it (a layer
    or batch norm over a row of nearly equal values divides rounding errors by a standard deviation near 0:
    ember, inductor and eager then give three different answers, all far from the exact one)."""
    from program import REDUCING, load

    fn, make_inputs = load(program)
    loose = any(op["tag"] in REDUCING for op in program["ops"])
    grad = any(spec.get("grad") for spec in program["inputs"])
    dtypes = {spec["dtype"] for spec in program["inputs"]} | {op["tag"] for op in program["ops"]}
    low = (torch.bfloat16 if dtypes & {"bfloat16", "to_bf16"} else
           torch.float16 if dtypes & {"float16", "to_half"} else None)
    result = check(fn, make_inputs, device, mode, grad=grad, loose=loose, low=low)
    if result["kind"] == "mismatch" and any(op["tag"] == "conv2d" for op in program["ops"]):
        # ember runs a graph's convolutions channels_last (layout.py, as inductor does on CUDA), and the NHWC
        # kernels of cuDNN and oneDNN need not give their NCHW kernels' Inf and NaN (cuDNN fp16: -Inf in, 0 out;
        # CPU bfloat16 conv2d over Inf and NaN: Inf at positions where NCHW gives NaN, and float64 a third
        # answer, fuzz seed 800868). Eager does the same for channels_last tensors: no ember bug when the graph
        # matches without the rewrite.
        import ember

        with ember.config.patch(conv_channels_last=False):
            nchw = check(fn, make_inputs, device, mode, grad=grad, loose=loose, low=low)
        if nchw["kind"] in ("ok", "refusal"):
            return dict(result, kind="upstream", detail=f"cuDNN's NHWC convolution: {result['detail']}"[:2000])
    if result["kind"] == "mismatch":
        # Eager against eager (through Dynamo, no AOTAutograd): a program whose eager results change from run to
        # run says nothing about ember. torch 2.13's CPU float16 conv2d (stride 2, padding 1, a 13x1x257x1 input)
        # gives NaN at a different number of positions on each run, uninitialised memory read (fuzz seed 701175);
        # in some runs only (2 of 5 identical calls for seed 635513), so eager is asked three times.
        for _ in range(3):
            again = check(fn, make_inputs, device, mode, grad=grad, loose=loose, backend="eager", low=low)
            if again["kind"] == "mismatch":
                return dict(result, kind="upstream", detail=f"{result['detail']} (eager twice: {again['detail']})"[:2000])
    if result["kind"] in ("mismatch", "error"):
        other = check(fn, make_inputs, device, mode, grad=grad, loose=loose, backend="aot_eager", low=low)
        if other["kind"] in ("mismatch", "error"):
            result = dict(result, kind="upstream", detail=f"{result['detail']} (aot_eager: {other['detail']})"[:2000])
    if result["kind"] == "mismatch" and "NaN" in result["detail"]:
        # Where eager's float32 kernel gives NaN and its float64 one a number (CPU gelu(+inf): NaN in float32,
        # inf in float64, ember inf), ember matching the float64 result is no ember bug.
        exact = check(fn, make_inputs, device, mode, grad=grad, loose=loose, low=low, reference_float64=True)
        if exact["kind"] in ("ok", "refusal"):
            result = dict(result, kind="upstream", detail=f"eager's float32 kernel: {result['detail']}"[:2000])
    if result["kind"] == "mismatch" and "NaN" not in result["detail"] and "Inf" not in result["detail"]:
        eager = check(fn, make_inputs, device, mode, grad=grad, loose=loose, low=low, reference_float64=True,
                      backend="eager")
        if eager["kind"] == "mismatch" and eager.get("ratio", float("inf")) < float("inf"):
            exact = check(fn, make_inputs, device, mode, grad=grad, loose=loose, low=low, reference_float64=True)
            ours = 0.0 if exact["kind"] in ("ok", "refusal") else exact.get("ratio", float("inf"))
            if ours <= ILL_CONDITIONED * eager["ratio"]:
                result = dict(result, kind="upstream",
                              detail=(f"ill-conditioned in float32 (from float64's result: eager {eager['ratio']:.3g}x the "
                                      f"tolerance, ember {ours:.3g}x): {result['detail']}")[:2000])
    return result

