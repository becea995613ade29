"""What an attention mask computed from a symbolic length is, for every length: proven over index expressions.

attention.simplify_masks reads a mask built from constants alone by running it once. Under dynamic shapes the
mask is built from a size symbol too (transformers 5 builds BERT's "no padding" mask as
`arange(s)[None, None, :, None] >= 0` and a decoder's causal one as `kv_idx <= q_idx`, with a packed-sequence check
made of `diff`, `cumsum` and indexing), and no single run says what it is at every length. Here the mask's subgraph
is evaluated symbolically instead: each tensor is its shape (sympy expressions of the size symbols) and one sympy
expression of its element, over index symbols I0, I1, ... (nonnegative integers, one per dimension). An arange is
`start + step*I0`, a comparison a sympy relation, indexing a substitution; the mask's element expression then
either simplifies to True (it masks nothing, at every length) or is exactly `I_col <= I_row` (causal).

Sound by construction: an op this module does not know, or one whose result it cannot express exactly (a
reshape, a cumsum of something that is not constant along its dimension), makes the whole mask unknown (None),
and the mask stays. Nothing here runs a kernel.
"""

import operator

import sympy
import torch


class Unknown(Exception):
    """The subgraph holds something this algebra cannot express exactly."""


def _index(k):
    return sympy.Symbol(f"I{k}", integer=True, nonnegative=True)


class Sym:
    """A tensor as its shape (ints or sympy expressions) and its element as an expression over _index(k)."""

    def __init__(self, shape, expr, kind):
        self.shape = list(shape)
        self.expr = sympy.sympify(expr)
        self.kind = kind  # "bool", "int" or "float"

    @property
    def rank(self):
        return len(self.shape)


def _is_one(size):
    return size == 1 or (isinstance(size, sympy.Basic) and size.is_Integer and int(size) == 1)


def _same(a, b):
    gap = sympy.expand(sympy.sympify(a) - sympy.sympify(b))
    return gap == 0 or sympy.simplify(gap) == 0  # (simplify, 10-100 ms, only where expanding is not enough)


def _moved(x, mapping):
    """x's expression with its index symbols renamed or replaced: mapping[k] is the new expression of index k."""
    return x.expr.xreplace({_index(k): sympy.sympify(v) for k, v in mapping.items()})


def _broadcast(*values):
    """(shape, [each value's expression over the broadcast shape's indices]) as torch broadcasts them."""
    rank = max(v.rank for v in values)
    shape = [1] * rank
    for v in values:
        for d, size in enumerate(v.shape):
            out = d + rank - v.rank
            if _is_one(size):
                continue
            if _is_one(shape[out]):
                shape[out] = size
            elif not _same(shape[out], size):
                raise Unknown("shapes that do not broadcast")
    exprs = []
    for v in values:
        off = rank - v.rank
        exprs.append(_moved(v, {d: 0 if _is_one(v.shape[d]) else _index(d + off) for d in range(v.rank)}))
    return shape, exprs


def _scalar(x):
    """A Python number or a size (SymInt) as a Sym of rank 0."""
    if isinstance(x, Sym):
        return x
    if isinstance(x, bool):
        return Sym([], sympy.true if x else sympy.false, "bool")
    if isinstance(x, int):
        return Sym([], sympy.Integer(x), "int")
    if isinstance(x, float):
        return Sym([], sympy.Float(x) if x == x and abs(x) != float("inf") else (sympy.oo if x > 0 else -sympy.oo),
                   "float")
    if isinstance(x, torch.SymInt):
        return Sym([], x.node.expr, "int")
    if isinstance(x, sympy.Basic):
        return Sym([], x, "int")
    raise Unknown(f"an operand of kind {type(x).__name__}")


def _size(x):
    """An int or a size expression from a literal, a SymInt or a rank-0 int Sym."""
    if isinstance(x, bool):
        raise Unknown("a bool size")
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        return x.node.expr
    if isinstance(x, Sym) and x.rank == 0 and x.kind == "int":
        return x.expr
    if isinstance(x, sympy.Basic) and x.is_integer:
        return x
    raise Unknown("a size that is not an integer")


def _as_bool(e, kind):
    return e if kind == "bool" else sympy.Ne(e, 0)


_ARITH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_COMPARE = {"ge": sympy.Ge, "gt": sympy.Gt, "le": sympy.Le, "lt": sympy.Lt, "eq": sympy.Eq, "ne": sympy.Ne}
_LOGIC = {"and": sympy.And, "or": sympy.Or}


def _binary(name, a, b):
    a, b = _scalar(a), _scalar(b)
    shape, (ea, eb) = _broadcast(a, b)
    if name in _ARITH:
        if "bool" in (a.kind, b.kind):
            raise Unknown("arithmetic on bools")
        kind = "float" if "float" in (a.kind, b.kind) else "int"
        return Sym(shape, _ARITH[name](ea, eb), kind)
    if name in _COMPARE:
        if (a.kind == "bool") != (b.kind == "bool"):
            raise Unknown("a bool compared with a number")
        if a.kind == "bool":
            if name == "eq":
                return Sym(shape, sympy.Equivalent(ea, eb), "bool")
            if name == "ne":
                return Sym(shape, sympy.Xor(ea, eb), "bool")
            raise Unknown("an ordering of bools")
        return Sym(shape, _COMPARE[name](ea, eb), "bool")
    if name in _LOGIC:
        return Sym(shape, _LOGIC[name](_as_bool(ea, a.kind), _as_bool(eb, b.kind)), "bool")
    raise Unknown(name)


def _getitem(x, key):
    if not isinstance(x, Sym):
        raise Unknown("indexing a non-tensor")
    key = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, Sym) for k in key):
        return _advanced(x, key)
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    shape, mapping, d = [], {}, 0
    for k in key:
        if k is None:
            shape.append(1)
        elif k is Ellipsis:
            for _ in range(x.rank - used):
                mapping[d] = _index(len(shape))
                shape.append(x.shape[d])
                d += 1
        elif isinstance(k, slice):
            start = 0 if k.start is None else k.start
            step = 1 if k.step is None else k.step
            if not isinstance(start, int) or not isinstance(step, int) or step <= 0 or start < 0:
                raise Unknown("a slice of this kind")
            if k.stop is None:
                length = x.shape[d] - start if start else x.shape[d]
            elif isinstance(k.stop, int) and k.stop >= 0:
                length = sympy.Min(x.shape[d], k.stop) - start if not isinstance(x.shape[d], int) else \
                    max(0, min(x.shape[d], k.stop) - start)
            else:
                raise Unknown("a slice of this kind")
            length = length if step == 1 else sympy.ceiling(sympy.sympify(length) / step)
            mapping[d] = start + step * _index(len(shape))
            shape.append(length)
            d += 1
        elif isinstance(k, int) and not isinstance(k, bool):
            if k < 0:
                raise Unknown("a negative index")
            mapping[d] = k
            d += 1
        else:
            raise Unknown(f"an index of kind {type(k).__name__}")
    for rest in range(d, x.rank):
        mapping[rest] = _index(len(shape))
        shape.append(x.shape[rest])
    return Sym(shape, _moved(x, mapping), x.kind)


def _advanced(x, key):
    """x[i0, i1, ...] with integer index tensors for its leading dimensions (as transformers reads its packed-
    sequence ids): the result's element is x's with those indices substituted."""
    if len(key) > x.rank or not all(isinstance(k, Sym) and k.kind == "int" for k in key):
        raise Unknown("advanced indexing of this kind")
    shape, exprs = _broadcast(*key)
    off = len(shape)
    mapping = {d: exprs[d] for d in range(len(key))}
    for d in range(len(key), x.rank):
        mapping[d] = _index(off + d - len(key))
    return Sym(shape + x.shape[len(key):], _moved(x, mapping), x.kind)


def _unsqueeze(x, dim):
    dim = dim if dim >= 0 else dim + x.rank + 1
    if not 0 <= dim <= x.rank:
        raise Unknown("an unsqueeze out of range")
    mapping = {d: _index(d if d < dim else d + 1) for d in range(x.rank)}
    return Sym(x.shape[:dim] + [1] + x.shape[dim:], _moved(x, mapping), x.kind)


def _expand(x, sizes):
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    if len(sizes) < x.rank:
        raise Unknown("an expand to fewer dimensions")
    lead = len(sizes) - x.rank
    shape, mapping = [], {}
    for d, s in enumerate(sizes):
        if d < lead:
            shape.append(_size(s))
            continue
        own = x.shape[d - lead]
        if isinstance(s, int) and s == -1:
            shape.append(own)
            mapping[d - lead] = _index(d)
        elif _is_one(own):
            shape.append(_size(s))
            mapping[d - lead] = 0
        elif _same(own, _size(s)):
            shape.append(own)
            mapping[d - lead] = _index(d)
        else:
            raise Unknown("an expand of a dimension larger than 1")
    return Sym(shape, _moved(x, mapping), x.kind)


def _diff(x, n=1, dim=-1, prepend=None, append=None):
    """x[k] - x[k-1] along `dim` (n = 1), with `prepend`'s one element before x[0]: exact where x is affine in
    that index."""
    if n != 1 or append is not None or not isinstance(x, Sym):
        raise Unknown("a diff of this kind")
    dim = dim if dim >= 0 else dim + x.rank
    i = _index(dim)
    slope = sympy.simplify(x.expr.xreplace({i: i + 1}) - x.expr)
    if slope.has(i):
        raise Unknown("a diff of something not affine in its dimension")
    shape = list(x.shape)
    if prepend is None:  # out[k] = x[k + 1] - x[k]
        shape[dim] = shape[dim] - 1
        return Sym(shape, slope, x.kind)
    if not isinstance(prepend, Sym) or prepend.rank != x.rank or not _is_one(sympy.simplify(prepend.shape[dim])):
        raise Unknown("a diff with this prepend")
    # out[0] = x[0] - prepend[0], out[k] = x[k] - x[k - 1]: as long as x
    first = sympy.simplify(x.expr.xreplace({i: 0}) - prepend.expr.xreplace({i: 0}))
    expr = slope if _same(first, slope) else sympy.Piecewise((first, sympy.Eq(i, 0)), (slope, True))
    return Sym(shape, expr, x.kind)


def _cumsum(x, dim):
    """A cumulative sum along `dim` of something constant along it (a count): c * (index + 1)."""
    dim = dim if dim >= 0 else dim + x.rank
    i = _index(dim)
    value = sympy.Piecewise((1, x.expr), (0, True)) if x.kind == "bool" else x.expr
    value = sympy.simplify(value)
    if value.has(i):
        raise Unknown("a cumsum of something that varies along its dimension")
    return Sym(x.shape, value * (i + 1), "int")


def _where(cond, a, b):
    cond, a, b = _scalar(cond), _scalar(a), _scalar(b)
    shape, (ec, ea, eb) = _broadcast(cond, a, b)
    if a.kind == "bool" and b.kind == "bool":
        return Sym(shape, sympy.Or(sympy.And(_as_bool(ec, cond.kind), ea), sympy.And(sympy.Not(_as_bool(ec, cond.kind)), eb)),
                   "bool")
    kind = "float" if "float" in (a.kind, b.kind) else "int"
    return Sym(shape, sympy.Piecewise((ea, _as_bool(ec, cond.kind)), (eb, True)), kind)


def _to(x, *args, **kwargs):
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    if dtype is None:
        return x
    return _cast(x, dtype)


def _cast(x, dtype):
    if dtype == torch.bool:
        return Sym(x.shape, _as_bool(x.expr, x.kind), "bool")
    if dtype.is_floating_point:
        return Sym(x.shape, sympy.Piecewise((1, x.expr), (0, True)) if x.kind == "bool" else x.expr, "float")
    if x.kind == "float":
        raise Unknown("a float cast to an integer")
    return Sym(x.shape, sympy.Piecewise((1, x.expr), (0, True)) if x.kind == "bool" else x.expr, "int")


def _filled(sizes, value, dtype):
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    shape = [_size(s) for s in sizes]
    kind = "bool" if dtype == torch.bool else "float" if dtype is None or dtype.is_floating_point else "int"
    if dtype is None and isinstance(value, bool):
        kind = "bool"
    x = _scalar(value)
    return Sym(shape, _as_bool(x.expr, x.kind) if kind == "bool" else x.expr, kind)


def _arange(*args, **kwargs):
    nums = [a for a in args]
    if len(nums) == 1:
        start, end, step = 0, nums[0], 1
    elif len(nums) == 2:
        (start, end), step = nums, 1
    elif len(nums) == 3:
        start, end, step = nums
    else:
        raise Unknown("an arange of this kind")
    if not isinstance(start, int) or not isinstance(step, int) or step <= 0:
        raise Unknown("an arange with a symbolic start or step")
    dtype = kwargs.get("dtype")
    if dtype is not None and (dtype.is_floating_point or dtype == torch.bool):
        raise Unknown("a floating-point arange")
    length = sympy.ceiling((sympy.sympify(_size(end)) - start) / step) if step != 1 else sympy.sympify(_size(end)) - start
    return Sym([length], start + step * _index(0), "int")


def _tril(x, diagonal=0, upper=False):
    if x.rank < 2:
        raise Unknown("a tril of fewer than two dimensions")
    r, c = _index(x.rank - 2), _index(x.rank - 1)
    keep = sympy.Ge(c - r, diagonal) if upper else sympy.Le(c - r, diagonal)
    if x.kind == "bool":
        return Sym(x.shape, sympy.And(keep, x.expr), "bool")
    return Sym(x.shape, sympy.Piecewise((x.expr, keep), (0, True)), x.kind)


# The binary calls and methods of a mask's subgraph, by the name _binary knows them by.
_FUNCTIONS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", torch.add: "add", torch.sub: "sub",
              torch.mul: "mul", operator.ge: "ge", operator.gt: "gt", operator.le: "le", operator.lt: "lt",
              operator.eq: "eq", operator.ne: "ne", torch.ge: "ge", torch.gt: "gt", torch.le: "le", torch.lt: "lt",
              torch.eq: "eq", torch.ne: "ne", operator.and_: "and", operator.or_: "or", torch.logical_and: "and",
              torch.logical_or: "or", torch.bitwise_and: "and", torch.bitwise_or: "or"}
_METHODS = {"__and__": "and", "__rand__": "and", "__or__": "or", "__ror__": "or", "logical_and": "and",
            "logical_or": "or", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt",
            "__ge__": "ge", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "add": "add",
            "__add__": "add", "__radd__": "add", "sub": "sub", "__sub__": "sub", "mul": "mul", "__mul__": "mul",
            "__rmul__": "mul"}


def _call(target, args, kwargs):
    """One call_function of the mask's subgraph on Sym / scalar operands."""
    if target in _FUNCTIONS and len(args) == 2 and (not kwargs or set(kwargs) == {"alpha"} and kwargs["alpha"] == 1):
        if not isinstance(args[0], Sym) and not isinstance(args[1], Sym):
            return _plain(target, args)
        return _binary(_FUNCTIONS[target], *args)
    if target in (operator.invert, torch.logical_not, torch.bitwise_not) and len(args) == 1:
        x = _scalar(args[0])
        if x.kind != "bool":
            raise Unknown("a not of a number")
        return Sym(x.shape, sympy.Not(x.expr), "bool")
    if target is operator.neg and len(args) == 1:
        x = args[0]
        return Sym(x.shape, -x.expr, x.kind) if isinstance(x, Sym) else -x
    if target is operator.getitem:
        return _getitem(args[0], args[1])
    if target is torch.arange:
        return _arange(*args, **kwargs)
    if target in (torch.ones, torch.zeros):
        return _filled(args, 1 if target is torch.ones else 0, kwargs.get("dtype"))
    if target is torch.full:
        return _filled([args[0]], args[1], kwargs.get("dtype"))
    if target is torch.where and len(args) == 3:
        return _where(*args)
    if target is torch.unsqueeze:
        return _unsqueeze(args[0], args[1] if len(args) > 1 else kwargs["dim"])
    if target is torch.diff:
        return _diff(*args, **kwargs)
    if target is torch.cumsum:
        return _cumsum(args[0], args[1] if len(args) > 1 else kwargs["dim"])
    if target in (torch.tril, torch.triu):
        return _tril(args[0], args[1] if len(args) > 1 else kwargs.get("diagonal", 0), upper=target is torch.triu)
    if target is torch.broadcast_to:
        return _expand(args[0], args[1])
    raise Unknown(f"a call of {getattr(target, '__name__', target)}")


def _plain(target, args):
    """Arithmetic on sizes alone (SymInts and ints), as sympy."""
    a, b = (_size(x) if not isinstance(x, float) else x for x in args)
    return target(sympy.sympify(a), sympy.sympify(b))


def _method(name, args, kwargs):
    x = args[0]
    if not isinstance(x, Sym):
        raise Unknown(f"a method {name} of a non-tensor")
    rest = args[1:]
    if name in _METHODS and len(rest) == 1:
        return _binary(_METHODS[name], x, rest[0])
    if name == "__rsub__" and len(rest) == 1:
        return _binary("sub", rest[0], x)
    if name in ("__invert__", "logical_not"):
        return _call(torch.logical_not, [x], {})
    if name == "unsqueeze":
        return _unsqueeze(x, rest[0] if rest else kwargs["dim"])
    if name in ("expand", "broadcast_to"):
        return _expand(x, rest)
    if name == "expand_as":
        return _expand(x, rest[0].shape)
    if name == "to":
        return _to(x, *rest, **kwargs)
    if name in ("bool", "float", "half", "bfloat16", "long", "int"):
        return _cast(x, {"bool": torch.bool, "float": torch.float32, "half": torch.float16,
                         "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32}[name])
    if name in ("contiguous", "clone"):
        return x
    if name in ("new_ones", "new_zeros", "new_full"):
        value = 1 if name == "new_ones" else 0 if name == "new_zeros" else rest[1]
        dtype = kwargs.get("dtype", {"bool": torch.bool, "int": torch.int64, "float": torch.float32}[x.kind])
        return _filled([rest[0]] if rest else [()], value, dtype)
    if name == "__getitem__":
        return _getitem(x, rest[0])
    if name == "cumsum":
        return _cumsum(x, rest[0] if rest else kwargs["dim"])
    if name in ("tril", "triu"):
        return _tril(x, rest[0] if rest else kwargs.get("diagonal", 0), upper=name == "triu")
    if name == "masked_fill" and len(rest) == 2:
        return _where(rest[0], rest[1], x)
    raise Unknown(f"a method {name}")


def evaluate(mask):
    """The mask node's value as a Sym, from its subgraph of size symbols, literals and the calls above; raises
    Unknown for anything else (a parameter, an input tensor, an op not listed)."""
    values = {}

    def value_of(n):
        if n not in values:
            raise Unknown("an operand outside the subgraph")
        return values[n]

    seen, stack = set(), [mask]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(mask.graph.nodes)}
    for n in sorted(seen, key=position.__getitem__):
        if n.op == "placeholder":
            v = n.meta.get("example_value", n.meta.get("val"))
            if not isinstance(v, torch.SymInt):
                raise Unknown("a graph input that is not a size")
            values[n] = v.node.expr
            continue
        args = torch.fx.node.map_arg(n.args, value_of)
        kwargs = torch.fx.node.map_arg(n.kwargs, value_of)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "requires_grad")}
        if n.op == "call_function":
            values[n] = _call(n.target, list(args), kwargs)
        elif n.op == "call_method":
            values[n] = _method(n.target, list(args), kwargs)
        else:
            raise Unknown(f"a node of kind {n.op}")
    result = values[mask]
    if not isinstance(result, Sym):
        raise Unknown("a mask that is not a tensor")
    return result


def _zero_where(expr):
    """Where an additive mask's element is 0 (kept), for an element that is 0 or -inf everywhere; else Unknown."""
    if expr == 0:
        return sympy.true
    if expr == -sympy.oo:
        return sympy.false
    if isinstance(expr, sympy.Piecewise):
        kept, before = [], sympy.false
        for value, cond in expr.args:
            kept.append(sympy.And(cond, sympy.Not(before), _zero_where(value)))
            before = sympy.Or(before, cond)
        return sympy.Or(*kept)
    raise Unknown("an additive mask with values other than 0 and -inf")


def _integer_relations(e):
    """e with each relation between integers written as `x <= 0` (x expanded), so that `i < j + 1`, `j >= i` and
    `i <= j` compare equal."""
    if isinstance(e, sympy.core.relational.Relational) and not isinstance(e, (sympy.Eq, sympy.Ne)):
        lhs, rhs = e.lhs, e.rhs
        if lhs.is_integer and rhs.is_integer:
            gap = {sympy.Le: lhs - rhs, sympy.Lt: lhs - rhs + 1, sympy.Ge: rhs - lhs, sympy.Gt: rhs - lhs + 1}.get(type(e))
            if gap is not None:
                return sympy.Le(sympy.expand(gap), 0)
        return e
    if isinstance(e, (sympy.And, sympy.Or, sympy.Not, sympy.Xor, sympy.Equivalent)):
        return type(e)(*(_integer_relations(a) for a in e.args))
    return e


def _causal(rank):
    """The causal mask's element over the last two index symbols (column <= row), as _integer_relations writes it."""
    return _integer_relations(sympy.Le(_index(rank - 1) - _index(rank - 2), 0))


def what_mask_is(mask, scores):
    """'none', 'causal' or None for the mask node of an attention whose scores have the sizes `scores` (ints or
    SymInts; the last two are the query rows and key columns), at every value of the sizes it is built from."""
    try:
        m = evaluate(mask)
        if m.kind == "float":
            m = Sym(m.shape, _zero_where(sympy.piecewise_fold(m.expr)), "bool")
        if m.kind != "bool" or m.rank > len(scores):
            return None
        shape, _ = _broadcast(m, Sym([_size(s) for s in scores], sympy.true, "bool"))
        if len(shape) != len(scores) or not all(_same(a, _size(b)) for a, b in zip(shape, scores)):
            return None  # eager broadcasts the scores to the mask's shape, or raises
        # As written first: sympy's simplify of a relation over the index symbols took 0.1-0.2 s (a symbolic
        # LLaMA's `I3 <= I2`), and is needed only where the mask is written otherwise.
        plain = _integer_relations(m.expr)
        written = plain is sympy.true or (m.rank >= 2 and plain == _causal(m.rank))
        kept = plain if written else sympy.simplify(_integer_relations(sympy.simplify(m.expr)))
        if kept is sympy.true:
            return "none"
        rows, cols = _size(scores[-2]), _size(scores[-1])
        if m.rank < 2 or not _same(rows, cols) or not _same(m.shape[-2], rows) or not _same(m.shape[-1], cols):
            return None
        row, col = _index(m.rank - 2), _index(m.rank - 1)
        if kept.free_symbols - {row, col}:
            return None
        if kept == _causal(m.rank):
            return "causal"
        same = sympy.simplify(sympy.Equivalent(kept, sympy.Le(col - row, 0)))
        return "causal" if same is sympy.true else None
    except (Unknown, TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError):
        return None
