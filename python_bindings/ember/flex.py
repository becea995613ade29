"""flex_attention as one fused CUDA kernel: `ember::flex_attention`.

A flex_attention call whose score_mod and mask_mod ember can write as CUDA expressions, on 16-bit CUDA
inputs that need no gradient, becomes one `ember::flex_attention` node in the Dynamo graph instead of the dense
ATen ops of attention.py. AOTAutograd keeps it whole (it is an opaque op with a fake implementation), and the
plan runs it through kernels/cuda/flex_attention.cpp: a flash-attention kernel (tensor-core MMAs, online
softmax, no scores in memory) that visits only the key blocks the BlockMask lists, evaluating mask_mod only in
its partial blocks, as inductor's generated kernel does.

1. The mods become C++ statements here, one per FX node (`mod_program`): index arithmetic, comparisons,
   logic, `where`, float math and loads from captured buffers. Anything else leaves the call dense.
2. Where the plan cannot run the kernel (an architecture before sm_80, NVRTC missing), the op's CUDA
   implementation below runs the dense form with the original mods, so the result never depends on it.
"""

import math
import operator

import torch

from .attention import _like_strides, dense_flex_attention

_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # head dims: multiples of 16 up to this (registers hold a warp's queries and outputs)
TILE = 64  # query rows of one thread block, and key columns of one step (kernels/cuda/flex_attention.cpp)

# Mods of the programs defined so far, for the op's fallback implementation: (score, mask) text -> callables.
_MODS = {}
_DEFINED = False


class Unsupported(Exception):
    """A mod ember does not write as CUDA: the call stays dense."""


# ---- mods -> C++ ------------------------------------------------------------------------------------------

_FLOAT_FUNCS = {
    "tanh": "tanhf({})", "exp": "expf({})", "exp2": "exp2f({})", "log": "logf({})", "log2": "log2f({})",
    "sqrt": "sqrtf({})", "rsqrt": "rsqrtf({})", "sin": "sinf({})", "cos": "cosf({})",
    "sigmoid": "(1.0f / (1.0f + expf(-({}))))", "erf": "erff({})",
}
_BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.lt: "<", operator.le: "<=",
    operator.gt: ">", operator.ge: ">=", operator.eq: "==", operator.ne: "!=", operator.and_: "&",
    operator.or_: "|", operator.xor: "^",
}
_TORCH_BINARY = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
                 "ne": "!=", "bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^", "logical_and": "&&",
                 "logical_or": "||"}
_DUNDER = {"and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor", "truediv": "div", "floordiv": "floor_divide",
           "mod": "remainder", "invert": "bitwise_not"}
_REFLECTED = {"radd": "add", "rsub": "sub", "rmul": "mul", "rtruediv": "truediv", "rfloordiv": "floordiv",
              "rmod": "mod", "rand": "and", "ror": "or", "rxor": "xor"}
_CASTS = ("float", "int", "long", "bool", "half", "bfloat16", "double")


def _ctype(dtype):
    if dtype is torch.bool:
        return "bool"
    if dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):
        return "int"
    if dtype is torch.int64:
        return "long long"
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "float"
    raise Unsupported(f"values of dtype {dtype}")


_LOADS = {torch.float32: "ld_f32", torch.float16: "ld_f16", torch.bfloat16: "ld_bf16", torch.int32: "ld_i32",
          torch.int64: "ld_i64", torch.bool: "ld_u8", torch.uint8: "ld_u8", torch.int16: "ld_i16",
          torch.int8: "ld_i8"}


def _literal(x):
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, int):
        if not -(2**31) <= x < 2**31:
            return f"{x}LL"
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "__int_as_float(0x7fc00000)"
        if math.isinf(x):
            return "__int_as_float(0x7f800000)" if x > 0 else "__int_as_float(0xff800000)"
        return f"{float(x)!r}f"
    raise Unsupported(f"constant {x!r}")


def _value_dtype(node):
    val = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        raise Unsupported(f"node {node.name} is not a scalar")
    return val.dtype


def mod_program(gm, indices, buffer_offset):
    """C++ statements computing `gm` (a score_mod with `indices` == 5 leading arguments score, b, h, q, kv,
    or a mask_mod with 4) and returning its result; captured buffers are p.buf[buffer_offset + i]."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) < indices:
        raise Unsupported("a mod with fewer arguments than flex_attention passes")
    names = ("score", "b", "h", "q", "kv")[5 - indices:]
    expr, buffers, lines = {}, {}, []
    for i, node in enumerate(placeholders):
        if i < indices:
            expr[node] = names[i]
        else:
            val = node.meta.get("example_value", node.meta.get("val"))
            if not isinstance(val, torch.Tensor) or val.dtype not in _LOADS or val.dim() > 4:
                raise Unsupported(f"captured buffer {node.name}")
            buffers[node] = (buffer_offset + i - indices, val)
            if val.dim() == 0:  # a captured scalar tensor (a cache position) read as a value
                expr[node] = f"{_LOADS[val.dtype]}(p.buf[{buffer_offset + i - indices}], 0)"

    def arg(a):
        if isinstance(a, torch.fx.Node):
            if a not in expr:
                raise Unsupported(f"{a.name} is not a scalar the kernel computes")
            return expr[a]
        return _literal(a)

    def float_arg(a):
        return f"(float)({arg(a)})"

    for node in gm.graph.nodes:
        if node.op in ("placeholder",):
            continue
        if node.op == "output":
            (result,) = node.args
            if isinstance(result, (tuple, list)):
                (result,) = result
            final = arg(result)
            lines.append(f"return ({'float' if indices == 5 else 'bool'})({final});")
            break
        if node.op not in ("call_function", "call_method"):
            raise Unsupported(f"{node.op} {node.name}")
        target, args, kwargs = node.target, list(node.args), dict(node.kwargs)
        if isinstance(target, str) and target.startswith("__") and target.endswith("__"):
            # Tensor operators as Dynamo may record them (doc[qi] == doc[ki] as __eq__), reflected ones swapped.
            target = target[2:-2]
            if target in _REFLECTED:
                target, args = _REFLECTED[target], args[::-1]
            target = operator.getitem if target == "getitem" else _DUNDER.get(target, target)
        out_dtype = _value_dtype(node)
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        if target is operator.getitem:
            source, index = args
            if source not in buffers:
                raise Unsupported(f"indexing {source}")
            slot, val = buffers[source]
            index = index if isinstance(index, (tuple, list)) else (index,)
            if len(index) != val.dim():
                raise Unsupported(f"{node.name}: {len(index)} indices into a {val.dim()}-d buffer")
            offset = " + ".join(f"(long long)({arg(x)}) * p.bs[{slot}][{d}]" for d, x in enumerate(index)) or "0"
            code = f"{_LOADS[val.dtype]}(p.buf[{slot}], {offset})"
        elif target in _BINARY and not kwargs:
            code = f"({arg(args[0])} {_BINARY[target]} {arg(args[1])})"
        elif name in _TORCH_BINARY and len(args) == 2 and not kwargs and (target is getattr(torch, name, None)
                                                                           or isinstance(target, str)):
            code = f"({arg(args[0])} {_TORCH_BINARY[name]} {arg(args[1])})"
        elif target in (operator.truediv,) or (name in ("div", "true_divide") and not kwargs.get("rounding_mode")
                                               and (target is getattr(torch, name, None) or isinstance(target, str))):
            code = f"({float_arg(args[0])} / {float_arg(args[1])})"
        elif target is operator.floordiv or name == "floor_divide":
            if out_dtype.is_floating_point:
                code = f"floorf({float_arg(args[0])} / {float_arg(args[1])})"
            else:
                code = f"py_floordiv((long long)({arg(args[0])}), (long long)({arg(args[1])}))"
        elif target is operator.mod or name in ("remainder",):
            if out_dtype.is_floating_point:
                code = f"py_fmod({float_arg(args[0])}, {float_arg(args[1])})"
            else:
                code = f"py_mod((long long)({arg(args[0])}), (long long)({arg(args[1])}))"
        elif target is operator.neg or name == "neg":
            code = f"(-{arg(args[0])})"
        elif target is operator.invert or name in ("bitwise_not", "logical_not"):
            code = f"(!{arg(args[0])})" if out_dtype is torch.bool else f"(~{arg(args[0])})"
        elif target is operator.abs or name == "abs":
            code = f"fabsf({arg(args[0])})" if out_dtype.is_floating_point else f"py_abs({arg(args[0])})"
        elif name in _FLOAT_FUNCS and not kwargs:
            code = _FLOAT_FUNCS[name].format(float_arg(args[0]))
        elif name == "where" and len(args) == 3 and not kwargs:
            code = f"({arg(args[0])} ? ({_ctype(out_dtype)})({arg(args[1])}) : ({_ctype(out_dtype)})({arg(args[2])}))"
        elif name in ("minimum", "maximum") and len(args) == 2 and not kwargs:
            fn = "fminf" if name == "minimum" else "fmaxf"
            if out_dtype.is_floating_point:
                code = f"{fn}({float_arg(args[0])}, {float_arg(args[1])})"
            else:
                op = "<" if name == "minimum" else ">"
                code = f"(({arg(args[0])}) {op} ({arg(args[1])}) ? ({arg(args[0])}) : ({arg(args[1])}))"
        elif name in ("clamp", "clip") and out_dtype.is_floating_point:
            lo = kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = kwargs.get("max", args[2] if len(args) > 2 else None)
            code = float_arg(args[0])
            if lo is not None:
                code = f"fmaxf({code}, {float_arg(lo)})"
            if hi is not None:
                code = f"fminf({code}, {float_arg(hi)})"
        elif isinstance(target, str) and (target in _CASTS or target == "to"):
            code = f"({_ctype(out_dtype)})({arg(args[0])})"
        elif isinstance(target, str) and target in ("new_ones", "new_zeros"):
            code = "1" if target == "new_ones" else "0"
        else:
            raise Unsupported(f"{node.op} {name}")
        expr[node] = f"v{len(lines)}"
        lines.append(f"const {_ctype(out_dtype)} v{len(lines)} = ({_ctype(out_dtype)})({code});")
    return " ".join(lines)


# ---- the op -----------------------------------------------------------------------------------------------

def _define():
    """ember::flex_attention, its fake (shapes and layout) and its dense CUDA fallback, once per process."""
    global _DEFINED
    if _DEFINED:
        return
    lib = torch.library.Library("ember", "FRAGMENT")  # noqa: TOR901 (kept alive below)
    lib.define("flex_attention(Tensor query, Tensor key, Tensor value, Tensor kv_num_blocks, Tensor kv_indices, "
               "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor[] buffers, int score_buffers, "
               "float scale, int q_block, int kv_block, str score_mod, str mask_mod) -> (Tensor, Tensor, Tensor)")

    def shapes(query, value):
        b, h, length, _ = query.shape
        out = _like_strides(query.new_empty(b, h, length, value.size(-1)), query)
        lse = query.new_empty(b, h, length, dtype=torch.float32)
        return out, lse, torch.empty_like(lse)

    def fake(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, buffers,
             score_buffers, scale, q_block, kv_block, score_mod, mask_mod):
        return shapes(query, value)

    def dense(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, buffers,
              score_buffers, scale, q_block, kv_block, score_mod, mask_mod):
        score_fn, mask_fn = _MODS[(score_mod, mask_mod)]
        buffers = list(buffers)
        out, lse, row_max = dense_flex_attention(query, key, value, score_fn, (mask_fn,), scale, {},
                                                 buffers[:score_buffers], buffers[score_buffers:], outputs=3)
        return out, lse.contiguous(), row_max.contiguous()

    torch.library.register_fake("ember::flex_attention", fake, lib=lib)
    lib.impl("flex_attention", dense, "CUDA")
    _define.lib = lib
    _DEFINED = True


def _block_mask_parts(block_mask):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_block, kv_block, mask_mod) of the
    higher-order op's block-mask tuple: (Q_LEN, KV_LEN,) kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod."""
    parts = list(block_mask)
    start = 2 if isinstance(parts[0], int) else 0
    return (*parts[start:start + 4], parts[-3], parts[-2], parts[-1])


def _val(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def fused_call(gm, node):
    """(args of ember::flex_attention) for a flex_attention node the kernel runs, else None (with why)."""
    query, key, value, score_mod, block_mask, scale, _kernel_options, *rest = node.args
    score_buffers = list(rest[0]) if rest else []
    mask_buffers = list(rest[1]) if len(rest) > 1 else []
    q, k, v = _val(query), _val(key), _val(value)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None, "inputs without example values"
    if not (q.is_cuda and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype):
        return None, "not 16-bit CUDA inputs"
    dims = (q.size(-1), v.size(-1)) if q.dim() == 4 else (0, 0)
    if any(not isinstance(e, int) or e % 16 or not 0 < e <= MAX_HEAD_DIM for e in dims) or k.size(-1) != dims[0]:
        return None, f"head dims {dims} (the kernel takes multiples of 16 up to {MAX_HEAD_DIM})"
    if q.size(1) % k.size(1) or k.size(1) != v.size(1) or k.size(0) != q.size(0) or v.size(0) != q.size(0):
        return None, "batch or head counts the kernel does not pair"
    tensors = [q, k, v] + [_val(b) for b in score_buffers + mask_buffers]
    if any(not isinstance(t, torch.Tensor) for t in tensors):
        return None, "inputs without example values"
    # Gradients flow where an output requires one: a parameter read by score_mod under torch.no_grad does not.
    outputs = node.meta.get("example_value")
    outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
    if any(not isinstance(t, torch.Tensor) or t.requires_grad for t in outputs):
        return None, "gradients (the kernel is forward only)"
    if not isinstance(scale, float):
        return None, "a scale that is not a constant"
    kv_num, kv_idx, full_num, full_idx, q_block, kv_block, mask_fn = _block_mask_parts(block_mask)
    if not (isinstance(q_block, int) and isinstance(kv_block, int) and q_block % TILE == 0 and kv_block % TILE == 0):
        return None, f"block sizes {q_block} x {kv_block} (multiples of {TILE} run fused)"
    for t in (kv_num, kv_idx) + ((full_num, full_idx) if full_num is not None else ()):
        val = _val(t)
        if not isinstance(val, torch.Tensor) or val.dtype != torch.int32 or not val.is_cuda:
            return None, "block-mask tensors that are not int32 on the GPU"
    if (full_num is None) != (full_idx is None):
        return None, "half a full-block list"
    try:
        score_text = mod_program(getattr(gm, score_mod.target), 5, 0)
        mask_text = mod_program(getattr(gm, mask_fn.target), 4, len(score_buffers))
    except Exception as e:  # noqa: BLE001 (a mod the translation does not know stays dense, whatever it holds)
        return None, f"mods: {e}"
    _MODS.setdefault((score_text, mask_text), (getattr(gm, score_mod.target), getattr(gm, mask_fn.target)))
    return (query, key, value, kv_num, kv_idx, full_num, full_idx, score_buffers + mask_buffers,
            len(score_buffers), scale, q_block, kv_block, score_text, mask_text), None


def fuse_flex_attention(gm, nodes):
    """Replaces each of `nodes` (flex_attention calls) that the kernel runs by ember::flex_attention; returns
    the nodes left for the dense form."""
    from . import report

    left = []
    for node in nodes:
        args, why = fused_call(gm, node)
        report.record_flex(why)
        if args is None:
            left.append(node)
            continue
        _define()
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(torch.ops.ember.flex_attention.default, args)
        value = node.meta.get("example_value")
        fused.meta = dict(node.meta)
        if isinstance(value, (tuple, list)) and len(value) == 3:
            fused.meta["example_value"] = tuple(value)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
    return left
