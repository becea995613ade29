"""Random torch programs for the differential fuzzer: the data structure, its renderer and its generator.

A program is plain data (JSON-able, so it travels to worker processes and into reproducer files):

    {"inputs": [{"shape": [3, 5], "dtype": "float32", "grad": False, "layout": "transposed",
                 "special": True}, ...],
     "ops": [{"tag": "add", "expr": "torch.add({0}, {1})", "args": ["i0", "v1"]}, ...]}

Each op is one line of Python: `v<k> = expr.format(*args)`; args name inputs (i<n>) or earlier values
(v<k>). The program returns every value that no later op reads. `render` writes the whole program as
standalone source with `program(...)` and `make_inputs(device, seed=0)`, which is what both the fuzzer
and the reproducer files run, so there is one code path.

The generator builds a program op by op on live CPU tensors: a candidate op that eager rejects is
dropped and another is drawn, so programs are eager-valid by construction (the checker still runs eager
first and discards any program that raises). Ops whose result jumps at a threshold (comparisons, floor,
round, casts to integers, argmax, floor_divide, atan2) only read "exact" values, ones both sides compute bit for bit (inputs,
views and copies of them, integer math), so a last-ulp difference in a fused float kernel cannot flip them.
"""

import random
import warnings

import torch

FLOATS = ("float32", "float16", "bfloat16")
DTYPES = FLOATS + ("int64", "int32", "bool")
# Loose-tolerance tags: their results add many rounding errors.
REDUCING = {"sum", "mean", "prod", "amax", "var", "norm", "matmul", "bmm", "linear", "conv2d", "softmax",
            "log_softmax", "layer_norm", "batch_norm", "logsumexp", "cumsum"}

MUTATING = {"mul_", "add_", "clamp_", "relu_", "copy_slice", "fill_"}


def is_float(dtype):
    return dtype in FLOATS


# ---------------------------------------------------------------------------------------------------------
# Rendering


def render_inputs(inputs):
    lines = ["def make_inputs(device, seed=0):",
             "    g = torch.Generator().manual_seed(seed)",
             "    out = []"]
    for spec in inputs:
        shape, dtype = list(spec["shape"]), spec["dtype"]
        layout = spec.get("layout", "contig")
        base = list(shape)
        if layout == "transposed" and len(shape) >= 2:
            base[-1], base[-2] = base[-2], base[-1]
        elif layout == "sliced" and len(shape) >= 1:
            base[0] = base[0] * 2 + 1
        if dtype in FLOATS:
            make = f"torch.randn({base}, generator=g)"
        elif dtype == "bool":
            make = f"(torch.rand({base}, generator=g) > 0.5)"
        else:
            make = f"torch.randint(-6, 7, {base}, generator=g)"
        lines.append(f"    t = {make}")
        if spec.get("special") and dtype in FLOATS:
            lines.append("    t = _sprinkle(t, g)")
        lines.append(f"    t = t.to(device=device, dtype=torch.{dtype})")
        if layout == "transposed" and len(shape) >= 2:
            lines.append("    t = t.transpose(-1, -2)")
        elif layout == "sliced" and len(shape) >= 1:
            lines.append("    t = t[1::2]")
        elif layout == "channels_last" and len(shape) == 4:
            lines.append("    t = t.contiguous(memory_format=torch.channels_last)")
        if spec.get("grad"):
            lines.append("    t = t.detach().requires_grad_(True)")
        lines.append("    out.append(t)")
    lines.append("    return out")
    return "\n".join(lines)


SPRINKLE = '''def _sprinkle(t, g):
    """A few NaN, +-Inf and denormal values at seeded positions."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return t
    for value in (float("nan"), float("inf"), -float("inf"), 1e-41, -3e-39):
        if torch.rand((), generator=g) < 0.5:
            flat[torch.randint(0, flat.numel(), (), generator=g)] = value
    return flat.reshape(t.shape)'''


def used_args(program):
    return {a for op in program["ops"] for a in op["args"]}


def output_names(program):
    used = used_args(program)
    outs = [f"v{k}" for k in range(len(program["ops"])) if f"v{k}" not in used]
    return outs


def render_body(program):
    params = ", ".join(f"i{n}" for n in range(len(program["inputs"])))
    lines = [f"def program({params}):"]
    for k, op in enumerate(program["ops"]):
        lines.append(f"    v{k} = " + op["expr"].format(*op["args"]))
    outs = output_names(program)
    lines.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
    return "\n".join(lines)


def render(program):
    special = any(spec.get("special") and spec["dtype"] in FLOATS for spec in program["inputs"])
    parts = ["import torch\nimport torch.nn.functional as F", *([SPRINKLE] if special else []),
             render_inputs(program["inputs"]), render_body(program)]
    return "\n\n\n".join(parts) + "\n"


def load(program):
    """(program function, make_inputs function) of a program, from its rendered source."""
    env = {}
    exec(compile(render(program), "<fuzz program>", "exec"), env)
    return env["program"], env["make_inputs"]


# ---------------------------------------------------------------------------------------------------------
# Generation


class Val:
    def __init__(self, name, t, exact, leaf_grad=False, is_input=False):
        self.name, self.t, self.exact, self.leaf_grad, self.is_input = name, t, exact, leaf_grad, is_input


def random_shape(rng, ndim=None):
    ndim = rng.choice([0, 1, 2, 2, 3, 3, 4, 4]) if ndim is None else ndim
    sizes = [1, 2, 3, 4, 5, 7, 8, 11, 13, 16]
    shape = [rng.choice(sizes) for _ in range(ndim)]
    if ndim and rng.random() < 0.08:
        shape[rng.randrange(ndim)] = 0
    if ndim and rng.random() < 0.05:
        shape[rng.randrange(ndim)] = rng.choice([257, 1031])  # a large row
    return shape


def random_input(rng, shape=None, dtype=None):
    dtype = dtype or rng.choice(("float32",) * 6 + ("float16", "bfloat16", "int64", "int32", "bool"))
    shape = random_shape(rng) if shape is None else shape
    layout = rng.choice(["contig"] * 4 + ["transposed", "sliced"] + (["channels_last"] * 2 if len(shape) == 4 else []))
    return {"shape": shape, "dtype": dtype, "layout": layout, "special": rng.random() < 0.12,
            "grad": dtype in FLOATS and rng.random() < 0.4}


def _dims(rng, t):
    n = t.dim()
    if n == 0:
        return None
    k = rng.randint(1, n)
    return tuple(sorted(rng.sample(range(n), k)))


def _pick(rng, pool, pred=lambda v: True):
    cands = [v for v in pool if pred(v)]
    return rng.choice(cands) if cands else None


def _same_shape_partner(rng, pool, a):
    """Another value that broadcasts with a (same shape, or a shape with ones), or a scalar."""
    cands = [v for v in pool if v is not a and _broadcasts(v.t.shape, a.t.shape)]
    return rng.choice(cands) if cands and rng.random() < 0.85 else None


def _broadcasts(s1, s2):
    for x, y in zip(reversed(s1), reversed(s2)):
        if x != y and x != 1 and y != 1:
            return False
    return True


UNARY = [("neg", "torch.neg({0})"), ("abs", "torch.abs({0})"), ("tanh", "torch.tanh({0})"),
         ("sigmoid", "torch.sigmoid({0})"), ("relu", "torch.relu({0})"), ("sin", "torch.sin({0})"),
         ("exp", "torch.exp({0}.clamp(-8, 8))"), ("log", "torch.log({0}.abs() + 1)"),
         # sqrt's offset: at 0 its derivative is infinite, and a matmul that rounds to 1e-9 on one side and to 0 on
         # the other turned a gradient into NaN on one side alone (fuzz seed 809113)
         ("sqrt", "torch.sqrt({0}.abs() + 1e-6)"), ("rsqrt", "torch.rsqrt({0}.abs() + 0.5)"),
         ("gelu", "F.gelu({0})"), ("silu", "F.silu({0})"), ("square", "torch.square({0})"),
         ("clamp", "torch.clamp({0}, min=-0.5, max=0.75)"), ("reciprocal", "torch.reciprocal({0}.abs() + 1)"),
         ("pow", "torch.pow({0}, 2)"), ("erf", "torch.erf({0})"), ("nan_to_num", "torch.nan_to_num({0})")]
JUMPY = [("floor", "torch.floor({0})"), ("round", "torch.round({0})"), ("sign", "torch.sign({0})"),
         ("to_int", "{0}.to(torch.int32)"), ("to_long", "{0}.long()"), ("to_bool", "{0}.bool()"),
         ("isnan", "torch.isnan({0})"), ("isinf", "torch.isinf({0})"), ("to_half", "{0}.half()"),
         ("to_float", "{0}.float()"), ("to_bf16", "{0}.bfloat16()")]
BINARY = [("add", "torch.add({0}, {1})"), ("sub", "torch.sub({0}, {1})"), ("mul", "torch.mul({0}, {1})"),
          ("div", "torch.div({0}, {1}.abs() + 1)"), ("maximum", "torch.maximum({0}, {1})"),
          ("minimum", "torch.minimum({0}, {1})"), ("add_alpha", "torch.add({0}, {1}, alpha=2)"),
          ("atan2", "torch.atan2({0}, {1})")]
COMPARE = [("lt", "torch.lt({0}, {1})"), ("ge", "torch.ge({0}, {1})"), ("eq", "torch.eq({0}, {1})"),
           ("ne", "torch.ne({0}, {1})")]
INT_BINARY = [("bitwise_and", "torch.bitwise_and({0}, {1})"), ("bitwise_or", "torch.bitwise_or({0}, {1})"),
              ("remainder", "torch.remainder({0}, {1}.abs() + 1)"), ("floor_divide", "torch.floor_divide({0}, {1}.abs() + 1)")]
SCALARS = ["2", "0.5", "-1.5", "3", "True"]


def gen_op(rng, pool, training):
    """One candidate op (tag, expr, args, exact) over values in pool, or None."""
    kind = rng.choice(["unary"] * 4 + ["binary"] * 5 + ["scalar"] * 2 + ["jumpy"] * 2 + ["compare"] * 2 +
                      ["int"] + ["reduce"] * 3 + ["view"] * 5 + ["matmul"] * 2 + ["norm"] * 2 + ["conv"] +
                      ["cat"] * 2 + ["where"] + ["index"] * 2 + ["inplace"] * 3 + ["dropout"])
    floats = lambda v: v.t.is_floating_point()  # noqa: E731
    a = _pick(rng, pool, floats if kind in ("unary", "norm", "matmul", "conv", "dropout") else lambda v: True)
    if a is None:
        return None
    t = a.t
    if kind == "unary":
        tag, e = rng.choice(UNARY)
        return tag, e, [a], False
    if kind == "jumpy":
        a = _pick(rng, pool, lambda v: v.exact)
        tag, e = rng.choice(JUMPY)
        if a is None or (tag in ("floor", "round", "sign", "isnan", "isinf") and not a.t.is_floating_point()):
            return None
        return tag, e, [a], a.exact
    if kind in ("binary", "compare", "int"):
        if kind == "compare":
            a = _pick(rng, pool, lambda v: v.exact)
        if kind == "int":
            a = _pick(rng, pool, lambda v: not v.t.is_floating_point() and v.t.dtype != torch.bool)
        if a is None:
            return None
        b = _same_shape_partner(rng, pool, a)
        # floor_divide and remainder jump at every multiple of their divisor, as comparisons at their threshold.
        if kind in ("compare", "int") and b is not None and not b.exact:
            b = None
        if b is None:
            tag, e = rng.choice(COMPARE if kind == "compare" else (INT_BINARY if kind == "int" else BINARY))
            if tag == "atan2" and not a.exact:
                return None
            e = e.replace("{1}", "torch.ones_like({0})" if kind == "int" else rng.choice(SCALARS))
            if "{1}.abs()" in e or "ones_like" in e:
                e = e.replace("(1).abs() + 1", "2")
            return tag + "_s", e, [a], a.exact and not a.t.is_floating_point()
        tag, e = rng.choice(COMPARE if kind == "compare" else (INT_BINARY if kind == "int" else BINARY))
        # atan2(y, x) jumps by 2 pi where y crosses 0 (its sign, -0.0 too) at x < 0, and by pi where x's zero
        # changes sign at y = 0: both must be exact. (The sign of a zero a GEMM gives is the library's: eager's
        # CPU mm gives -1.5 * 0.0 as -0.0 in float32, MKL, and +0.0 in bfloat16, oneDNN.)
        if tag == "atan2" and not (a.exact and b.exact):
            return None
        exact = (kind == "compare") or (a.exact and b.exact and not a.t.is_floating_point()
                                        and not b.t.is_floating_point())
        return tag, e, [a, b], exact
    if kind == "scalar":
        op = rng.choice(["{0} * 0.5", "{0} + 1", "{0} - 2.5", "{0} * 3", "1 - {0}"])
        return "scalar", op, [a], a.exact and not t.is_floating_point() and "." not in op
    if kind == "reduce":
        dims = _dims(rng, t)
        keep = rng.random() < 0.5
        d = "" if dims is None else f"dim={dims}, keepdim={keep}"
        if not t.is_floating_point():
            op = rng.choice(["sum", "amax", "any"])
            e = {"sum": f"torch.sum({{0}}, {d})", "amax": f"torch.amax({{0}}, {d or 'dim=()'})",
                 "any": "torch.any({0})"}[op]
            return op, e, [a], a.exact
        op = rng.choice(["sum", "mean", "amax", "var", "norm", "logsumexp", "cumsum", "argmax", "prod", "max_dim"])
        if op == "argmax":
            if not a.exact or dims is None:
                return None
            return op, f"torch.argmax({{0}}, dim={dims[0]}, keepdim={keep})", [a], True
        if op == "max_dim":
            if dims is None:
                return None
            return op, f"torch.max({{0}}, dim={dims[0]}, keepdim={keep})[0]", [a], a.exact
        if op == "cumsum":
            return op, f"torch.cumsum({{0}}, dim={rng.randrange(max(t.dim(), 1)) if t.dim() else 0})", [a], False
        if op == "prod":
            return op, f"torch.prod({{0}}.tanh(), dim={dims[0] if dims else 0})" if dims else "torch.prod({0}.tanh())", [a], False
        if op == "logsumexp":
            return op, f"torch.logsumexp({{0}}, dim={dims or 0}, keepdim={keep})" if dims else None, [a], False
        if op == "var":
            return op, f"torch.var({{0}}, {d})", [a], False
        if op == "norm":
            return op, f"torch.linalg.vector_norm({{0}}, {d})", [a], False
        return op, f"torch.{op}({{0}}, {d})", [a], op == "amax" and a.exact
    if kind == "view":
        return gen_view(rng, a)
    if kind == "matmul":
        return gen_matmul(rng, pool, a)
    if kind == "norm":
        return gen_norm(rng, a, training)
    if kind == "conv":
        if t.dim() != 4 or t.shape[1] == 0 or t.shape[1] > 16:
            return None
        c, o, k = t.shape[1], rng.choice([1, 3, 4]), rng.choice([1, 2, 3])
        stride, pad = rng.choice([1, 2]), rng.choice([0, 1])
        w = f"torch.ones({o}, {c}, {k}, {k}, dtype={{0}}.dtype, device={{0}}.device).cumsum(0) * 0.1"
        return "conv2d", f"F.conv2d({{0}}, {w}, stride={stride}, padding={pad})", [a], False
    if kind == "cat":
        if t.dim() == 0:
            return None
        d = rng.randrange(t.dim())
        b = _pick(rng, pool, lambda v: v is not a and v.t.dim() == t.dim() and v.t.dtype == t.dtype and all(
            x == y for i, (x, y) in enumerate(zip(v.t.shape, t.shape)) if i != d))
        op = rng.choice(["cat", "stack", "split", "rotate_half"])
        if op == "rotate_half":  # a rotary embedding's, which passes/rotate_half.cpp rewrites
            h = t.shape[-1] // 2
            if t.shape[-1] % 2 or t.dtype in (torch.bool, torch.uint8):
                return None
            return op, f"torch.cat((-{{0}}[..., {h}:], {{0}}[..., :{h}]), dim=-1)", [a], a.exact
        if op == "split":
            # At most 8 pieces: Dynamo alone took 24 s to trace a split of 20560 rows into ones (seed 303546).
            n = max(rng.choice([1, 2, 3]), -(-t.shape[d] // 8))
            return "split", f"torch.split({{0}}, {n}, dim={d})[{rng.choice([0, -1])}]", [a], a.exact
        b = b or a
        return op, f"torch.{op}(({{0}}, {{1}}), dim={d})", [a, b], a.exact and b.exact
    if kind == "where":
        c = _pick(rng, pool, lambda v: v.t.dtype == torch.bool and _broadcasts(v.t.shape, t.shape))
        b = _same_shape_partner(rng, pool, a)
        if c is None:
            return None
        if b is None or b.t.dtype != t.dtype:
            return "where_s", "torch.where({0}, {1}, 0.25)" if t.is_floating_point() else "torch.where({0}, {1}, 1)", [c, a], a.exact
        return "where", "torch.where({0}, {1}, {2})", [c, a, b], a.exact and b.exact
    if kind == "index":
        return gen_index(rng, a)
    if kind == "inplace":
        return gen_inplace(rng, pool, a)
    if kind == "dropout":
        return "dropout", "F.dropout({0}, p=0.3, training=False)", [a], a.exact
    return None


def gen_view(rng, a):
    t = a.t
    n = t.dim()
    ex = a.exact
    choice = rng.choice(["transpose", "permute", "slice", "expand", "reshape", "view", "as_strided", "unsqueeze",
                         "flatten", "contiguous", "t_reshape"])
    if choice == "unsqueeze" or n == 0:
        return "unsqueeze", f"{{0}}.unsqueeze({rng.randint(-n - 1, n)})", [a], ex
    if choice == "transpose" and n >= 2:
        i, j = rng.sample(range(n), 2)
        return "transpose", f"{{0}}.transpose({i}, {j})", [a], ex
    if choice == "permute":
        p = list(range(n))
        rng.shuffle(p)
        return "permute", f"{{0}}.permute({p})", [a], ex
    if choice == "slice":
        d = rng.randrange(n)
        s = rng.choice([0, 1])
        step = rng.choice([1, 2, 3])
        return "slice", f"{{0}}[{':, ' * d}{s}::{step}]", [a], ex
    if choice == "expand":
        ones = [i for i, s in enumerate(t.shape) if s == 1]
        shape = [rng.choice([2, 3]) if i in ones else -1 for i in range(n)]
        return "expand", f"{{0}}.expand({shape})", [a], ex
    if choice in ("reshape", "view", "t_reshape"):
        if choice == "t_reshape" and n >= 2:
            return "t_reshape", "{0}.transpose(0, -1).reshape(-1)", [a], ex
        if n >= 2 and rng.random() < 0.5:
            return choice, f"{{0}}.{choice}({list(t.shape[:-2])} + [-1])", [a], ex
        return choice, f"{{0}}.{choice}(-1)", [a], ex
    if choice == "flatten":
        return "flatten", "{0}.flatten()", [a], ex
    if choice == "contiguous":
        return "contiguous", "{0}.contiguous()", [a], ex
    if choice == "as_strided":
        numel = t.numel()
        if numel < 4:
            return None
        rows = rng.choice([2, 3])
        cols = (numel - 1) // rows
        if cols < 1:
            return None
        return "as_strided", f"{{0}}.contiguous().as_strided(({rows}, {cols}), ({cols}, 1), {rng.choice([0, 1])})", [a], ex
    return None


def gen_matmul(rng, pool, a):
    t = a.t
    if t.dim() == 0 or t.shape[-1] > 64:
        return None
    k = t.shape[-1]
    op = rng.choice(["matmul", "linear", "bmm", "mm_input"])
    dt = "dtype={0}.dtype, device={0}.device"
    if op == "mm_input":
        b = _pick(rng, pool, lambda v: v.t.dim() >= 2 and v.t.shape[-2] == k and v.t.dtype == t.dtype and v is not a)
        if b is not None:
            return "matmul", "torch.matmul({0}, {1})", [a, b], False
        op = "matmul"
    n = rng.choice([1, 3, 5, 8])
    w = f"(torch.arange({k * n}, {dt}).reshape({k}, {n}) % 7 - 3) * 0.1"
    if op == "matmul":
        return "matmul", f"torch.matmul({{0}}, {w})", [a], False
    if op == "linear":
        bias = f"torch.linspace(-1, 1, {n}, {dt})" if rng.random() < 0.5 else "None"
        return "linear", f"F.linear({{0}}, {w}.t(), {bias})", [a], False
    if t.dim() != 3:
        return None
    return "bmm", f"torch.bmm({{0}}, {w}.expand({t.shape[0]}, -1, -1))", [a], False


def gen_norm(rng, a, training):
    t = a.t
    if t.dim() == 0:
        return None
    op = rng.choice(["softmax", "log_softmax", "layer_norm", "batch_norm", "batch_norm_train"])
    d = rng.randrange(-t.dim(), t.dim())
    if op in ("softmax", "log_softmax"):
        return op, f"torch.{op}({{0}}, dim={d})", [a], False
    if op == "layer_norm":
        n = rng.randint(1, t.dim())
        shape = list(t.shape[-n:])
        if rng.random() < 0.5:
            return op, f"F.layer_norm({{0}}, {shape})", [a], False
        return op, (f"F.layer_norm({{0}}, {shape}, torch.full({shape}, 1.5, dtype={{0}}.dtype, device={{0}}.device), "
                    f"torch.full({shape}, -0.25, dtype={{0}}.dtype, device={{0}}.device))"), [a], False
    if t.dim() < 2:
        return None
    c = t.shape[1]
    if op == "batch_norm":
        full = f"dtype={{0}}.dtype, device={{0}}.device"
        return op, (f"F.batch_norm({{0}}, torch.zeros({c}, {full}), torch.full(({c},), 2.0, {full}), "
                    "training=False)"), [a], False
    return "batch_norm_train", f"F.batch_norm({{0}}, None, None, training=True)", [a], False


def gen_index(rng, a):
    t = a.t
    if t.dim() == 0 or t.numel() == 0:
        return None
    d = rng.randrange(t.dim())
    size = t.shape[d]
    op = rng.choice(["index_select", "gather", "scatter_add", "index_tensor", "bool_mask"])
    idx = sorted(rng.choice(range(size)) for _ in range(rng.randint(1, 4)))
    dev = "device={0}.device"
    if op == "index_select":
        return op, f"torch.index_select({{0}}, {d}, torch.tensor({idx}, {dev}))", [a], a.exact
    if op == "index_tensor":
        return op, f"{{0}}[{':, ' * d}torch.tensor({idx}, {dev})]", [a], a.exact
    if op == "gather":
        return op, f"torch.gather({{0}}, {d}, torch.zeros_like({{0}}, dtype=torch.long).add_({rng.randrange(size)}))", [a], a.exact
    if op == "bool_mask":
        return None  # data-dependent output shape: a graph break, tested elsewhere
    return op, f"torch.scatter_add({{0}}, {d}, torch.zeros_like({{0}}, dtype=torch.long), {{0}})", [a], False


def gen_inplace(rng, pool, a):
    if a.leaf_grad:
        return None
    t = a.t
    if a.is_input and t.requires_grad:
        return None
    op = rng.choice(["mul_", "add_", "clamp_", "relu_", "copy_slice", "fill_"])
    if op == "mul_":
        return "mul_", "{0}.mul_(2)", [a], a.exact
    if op == "add_":
        b = _same_shape_partner(rng, pool, a)
        if b is not None and b.t.shape == t.shape and b.t.dtype == t.dtype:
            return "add_", "{0}.add_({1})", [a, b], a.exact and b.exact
        return "add_", "{0}.add_(1)", [a], a.exact
    if op == "clamp_" and t.is_floating_point():
        return "clamp_", "{0}.clamp_(-1, 1)", [a], a.exact
    if op == "relu_" and t.is_floating_point():
        return "relu_", "{0}.relu_()", [a], a.exact
    if op == "copy_slice" and t.dim() >= 1 and t.shape[0] >= 2:
        return "copy_slice", "({0}[0].copy_({0}[1]), {0})[1]", [a], a.exact
    if op == "fill_" and t.dim() >= 1:
        return "fill_", "({0}[..., :1].fill_(3), {0})[1]", [a], a.exact
    return None


MAX_NUMEL = 200_000  # the largest result an op may have


def _too_big(expr, args):
    """Whether expr's result would exceed MAX_NUMEL, from a run on meta tensors (no memory, no time): a broadcast of
    a 53612-vector against a [1031, 4, 13, 1] tensor is 2.9e9 elements, 17 s and 11 GB before the size check
    (fuzz seed 802042 took 46 s to generate, a hang by the worker's timeout). Ops meta tensors cannot run are
    left to the real run."""
    env = {"torch": torch, "F": torch.nn.functional}
    env.update({name: t.detach().to("meta") for name, t in args.items()})
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = eval(expr, env)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and out.numel() > MAX_NUMEL


def generate(seed, training=None):
    """A random program from a seed (deterministic: the same seed gives the same program)."""
    import warnings

    rng = random.Random(seed)
    n_ops = rng.randint(3, 40)
    training = rng.random() < 0.4 if training is None else training
    shape = random_shape(rng)
    inputs = []
    for _ in range(rng.randint(1, 4)):
        # Related shapes broadcast and concatenate with each other more often.
        s = list(shape) if rng.random() < 0.5 else ([1 if rng.random() < 0.3 else x for x in shape]
                                                    if rng.random() < 0.5 else None)
        inputs.append(random_input(rng, s))
    for spec in inputs:
        spec["grad"] = spec["grad"] and training
    prog = {"inputs": inputs, "ops": []}
    _, make_inputs = load(prog)
    pool = [Val(f"i{n}", t, True, leaf_grad=t.requires_grad, is_input=True) for n, t in enumerate(make_inputs("cpu"))]
    env = {"torch": torch, "F": torch.nn.functional}
    attempts = 0
    no_mutation = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(prog["ops"]) < n_ops and attempts < n_ops * 20:
            attempts += 1
            cand = gen_op(rng, pool[-12:] if rng.random() < 0.7 else pool, training)
            if cand is None or cand[1] is None:
                continue
            tag, expr, args, exact = cand
            if tag in MUTATING and args[0].t.untyped_storage().data_ptr() in no_mutation:
                continue
            names = [v.name for v in args]
            if _too_big(expr.format(*names), {v.name: v.t for v in args}):
                continue
            env.update({v.name: v.t for v in pool})
            try:
                with torch.set_grad_enabled(True):
                    out = eval(expr.format(*names), env)
                if not isinstance(out, torch.Tensor) or out.numel() > MAX_NUMEL:
                    continue
                # Growing values: keep magnitudes where tolerances mean something. (Reading a view that autograd
                # forbids, e.g. a split output whose base was modified in place, raises: the op is left out.)
                if out.is_floating_point() and out.numel() and out.abs().nan_to_num(0, 0, 0).max() > 1e4:
                    continue
            except Exception:
                continue
            prog["ops"].append({"tag": tag, "expr": expr, "args": names})
            if tag in ("as_strided", "dropout"):
                # Compiled code may not mutate these aliases: torch.compile bans mutating an as_strided view,
                # and functionalization makes eval dropout a copy where eager returns its input itself.
                no_mutation.add(out.untyped_storage().data_ptr())
            if tag in MUTATING:  # in place: what shares the storage changed
                exact = exact and all(v.exact for v in args)
                ptr = out.untyped_storage().data_ptr()
                for v in pool:
                    if v.t.untyped_storage().data_ptr() == ptr:
                        v.exact = v.exact and exact
            pool.append(Val(f"v{len(prog['ops']) - 1}", out, exact))
    return prog
