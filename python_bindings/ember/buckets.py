"""Size buckets (options={"pad_to_buckets": ...}): which symbolic sizes of an ATen graph are padded up to a bucket,
and the plan that backend/runtime/size_buckets.h applies per call in C++.

1. Which sizes: each symbol that is the size of dim d (d in `pad_dims`) of one of the graph's tensor inputs. Every
   input carrying it (a tensor dim of that size, an int that is the size) is padded with it, and every output
   carrying it is sliced back (a tensor dim of that size narrowed, an int given the call's size).
2. Refused, with the reason (the graph then runs at its own sizes; backend.py warns): an input or output whose
   size folds the symbol into another expression (2*s0: slicing cannot take it back); a value computed from padded
   inputs whose shape no longer carries the symbol (a sum or mean over the padded dim, a product contracting it, a
   0-dim tensor of the size) or a product contracting it while keeping it elsewhere (h @ h.t() over padded h, attention
   over padded keys): rows the padding added would reach the real ones; the size used as a value (an op's
   Scalar or Tensor argument: x * x.shape[0], a mean's divisor), which would be the bucket; a write into a padded
   input (the caller's tensor is not the one padded).
3. Not seen here, and the user's to know (docs/configuration.md): an op that mixes rows but keeps the dim, as a
   softmax, a cumulative op or attention over it, or a batch norm's batch statistics.
"""

import torch

from .errors import EmberError


class Refused(EmberError):
    """A graph whose outputs padding could change (the message says how)."""


def _val(node):
    return node.meta.get("val", node.meta.get("example_value"))


def _expr(size):
    """The sympy expression of a symbolic size, None for a plain int."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return None if getattr(expr, "is_number", False) else expr
    return None


def _symbols(value):
    """The free symbols of a SymInt / SymFloat / SymBool, or of a tensor's sizes."""
    if isinstance(value, torch.Tensor):
        out = set()
        for size in value.shape:
            expr = _expr(size)
            if expr is not None:
                out |= expr.free_symbols
        return out
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(getattr(value.node.expr, "free_symbols", ()))
    return set()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _uses(value, padded, index, what):
    """[(dim, symbol index)] where `value` (an input's or output's) carries a padded symbol; dim -1: an int that is
    the symbol. Refused where it carries one within another expression."""
    uses = []
    if isinstance(value, torch.Tensor):
        for d, size in enumerate(value.shape):
            expr = _expr(size)
            if expr is None or not expr.free_symbols & padded:
                continue
            if expr not in padded:
                raise Refused(f"{what} has size {expr} in dim {d}: a padded size within another, which slicing "
                              "cannot take back")
            uses.append((d, index[expr]))
    elif _symbols(value) & padded:
        expr = value.node.expr
        if not isinstance(value, torch.SymInt) or expr not in padded:
            raise Refused(f"{what} is {expr}, computed from a padded size")
        uses.append((-1, index[expr]))
    return uses


def _as_value(node, padded):
    """The argument of an ATen op that takes a padded size as a value (a Scalar or Tensor argument, not a size
    argument: int, SymInt and their lists), or None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target is torch.ops.aten._assert_scalar.default:
        return None  # a runtime assert reads the size, computes nothing from it
    for i, arg in enumerate(target._schema.arguments):
        if "int" in str(arg.type).lower() or (arg.name == "end" and target.overloadpacket is torch.ops.aten.arange):
            continue  # a size; arange(n)'s first n values are those of arange(bucket)
        given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        for item in given if isinstance(given, (list, tuple)) else (given,):
            if isinstance(item, torch.fx.Node) and not isinstance(_val(item), torch.Tensor) and _symbols(_val(item)) & padded:
                return item
    return None


def _contracted(node, padded):
    """Whether a matmul or attention contracts over a padded size: the padded rows' values, zeros or not after the
    ops before it, would reach every real row."""
    aten = torch.ops.aten
    target = getattr(node.target, "overloadpacket", None)
    operand = {aten.mm: 0, aten.bmm: 0, aten.addmm: 1, aten.baddbmm: 1}.get(target)
    if operand is not None:
        a = node.args[operand] if len(node.args) > operand else None
        v = _val(a) if isinstance(a, torch.fx.Node) else None
        return isinstance(v, torch.Tensor) and bool(_symbols_of(v.shape[-1]) & padded)
    if target is not None and "scaled_dot_product" in str(target) and len(node.args) > 1:
        key = _val(node.args[1]) if isinstance(node.args[1], torch.fx.Node) else None
        return isinstance(key, torch.Tensor) and key.dim() >= 2 and bool(_symbols_of(key.shape[-2]) & padded)
    return False


def _symbols_of(size):
    expr = _expr(size)
    return set(expr.free_symbols) if expr is not None else set()


def _writes(node):
    """The arguments an op writes in place (its schema's mutable ones)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return []
    out = []
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out


def padding_plan(gm, buckets, pad_dims):
    """The arguments of CompiledGraph.set_size_buckets for ATen graph `gm` (sizes, symbols, inputs, outputs), or
    None where no input has a symbolic size in `pad_dims`. Raises Refused for a graph padding could change."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [_val(n) for n in placeholders]
    symbols = []
    for v in values:
        if isinstance(v, torch.Tensor):
            for d in pad_dims:
                expr = _expr(v.shape[d]) if d < v.dim() else None
                if expr is not None and expr.is_Symbol and expr not in symbols:
                    symbols.append(expr)
    if not symbols:
        return None
    padded = set(symbols)
    index = {s: i for i, s in enumerate(symbols)}
    sources = [None] * len(symbols)
    inputs, carrying = [], set()
    for i, (node, v) in enumerate(zip(placeholders, values)):
        for d, s in _uses(v, padded, index, f"input {node.name}"):
            inputs.append((i, d, s))
            carrying.add(node)
            if d >= 0 and sources[s] is None:
                sources[s] = (str(symbols[s]), i, d)

    # Values computed from padded inputs must keep the symbol: one that lost it mixed the padded rows in.
    reached = set(carrying)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not any(a in reached for a in node.all_input_nodes):
            continue
        reached.add(node)
        if any(w in carrying for w in _writes(node)):
            raise Refused(f"{node.name} ({node.target}) writes into a padded input")
        if _contracted(node, padded):
            raise Refused(f"{node.name} ({node.target}) contracts over the padded size: the padded rows would reach "
                          "every real one")
        value = _as_value(node, padded)
        if value is not None:
            raise Refused(f"{node.name} ({node.target}) uses {value.name} = {_val(value)} as a value, which padding "
                          "would make the bucket")
        for t in _tensors(_val(node)):
            if not _symbols(t) & padded:
                raise Refused(f"{node.name} ({node.target}) makes a {list(t.shape)} tensor from padded inputs: it "
                              f"mixes the rows along the padded size {', '.join(map(str, symbols))} (a reduction or "
                              "product over it)")

    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    outputs = []
    for k, item in enumerate(results):
        if isinstance(item, (list, tuple, dict)):
            raise Refused(f"output {k} is a nested {type(item).__name__}")
        if isinstance(item, torch.fx.Node):
            outputs.extend((k, d, s) for d, s in _uses(_val(item), padded, index, f"output {k} ({item.name})"))
    sizes = [] if buckets == "pow2" else list(buckets)
    return sizes, sources, inputs, outputs
