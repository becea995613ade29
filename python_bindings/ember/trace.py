"""Inference graphs traced to ATen ops in one pass, without AOTAutograd.

For an inference graph (nothing needs a gradient) AOTAutograd runs the Dynamo graph twice on fake tensors:
once to collect runtime metadata (which inputs are mutated, which outputs alias what), once to trace the
functionalized, decomposed graph. Where that metadata would ask its runtime wrapper for nothing, one traced
pass gives the same graph: `make_fx` over `torch.func.functionalize` with ember's decompositions. BERT-base
b8 s128's ATen tracing in a fresh process: 1.72 s through AOTAutograd, 1.02 s so (H100 host); 1.57 and
0.58 s on this project's 2-core CPU host.

Symbolic sizes trace so too, on Dynamo's symbolic fakes and SymInt inputs, but without functionalization
(torch.func.functionalize reads sizes through aten.size, which fake tensors answer with ints: every size would
be specialized). A write left in the traced graph then sends it to AOTAutograd. BERT-base's symbolic recompile
(1x48 after 1x32, 2-core host): 4.72 s through AOTAutograd, 2.89 s so, against 2.62 s for Dynamo alone.

What keeps AOTAutograd, read from the Dynamo graph before tracing or from the traced graph after:
- anything that needs a gradient, autocast, inputs that are neither plain tensors nor sizes, two inputs
  sharing memory, a graph module holding tensors of its own, higher-order ops or submodules;
- a graph that still writes memory after functionalization (an input mutated: AOTAutograd's wrapper or its
  version-counter bookkeeping are needed), or whose outputs alias an input (the wrapper regenerates those).
ember.config.direct_trace = False sends every graph through AOTAutograd.

Repeated layers are traced once (`_trace_by_node`). A Dynamo graph of a 12-layer transformer holds each
layer's few dozen calls twelve times over, and make_fx pays ~1 ms of Python dispatch per call (BERT-base: 314
calls, 0.41 s in a fresh process on the 2-core host). Traced one call at a time instead, each distinct call (its
function, its literal arguments, and the dtype, sizes, strides, offset and device of its tensors) is traced once,
with the same functionalized make_fx and table, into a small graph that every repeat copies: BERT-base is 25
traces, 0.19-0.20 s, GPT-2 65, 0.38 -> 0.24-0.27 s; the IR is the same text either way. A trace of its own costs
2-12 ms of make_fx's fixed work (an eval batch norm's the most), so graphs run this way only where Dynamo's own
values say calls repeat: at least 12 calls, at most a sixth of them distinct (resnet50's 175 calls are 55
distinct, and took 0.35 -> 0.62 s so). Twelve is where it pays with room to spare: 20 x Linear(100, 100)
(20 calls, 1 distinct) traced in 0.090-0.141 s whole and 0.040-0.045 s so in fresh processes on the 2-core
host; stacks of 3-24 Linear(64, 64), with or without a ReLU after each, took less so in every size measured
there (3 calls: 13 -> 8 ms; 12: 56 -> 27 ms; 24 with ReLUs: 51 -> 15 ms). Graphs with anything a call-by-call
trace could get wrong keep the whole-graph trace: an in-place call or `out=` (functionalization across calls is the whole trace's work), a call
that changes global state (grad mode, autocast, the RNG seed), arguments of kinds without an exact key.
ember.config.trace_by_node = False keeps the whole-graph trace, True uses the call-by-call one wherever it can.
"""

from . import config


def _plain_inputs(gm, example_inputs):
    """Why the graph's inputs rule a one-pass trace out, or None."""
    import torch

    if any(type(x) not in (torch.Tensor, torch.nn.Parameter, int, torch.SymInt) for x in example_inputs):
        return "an input is not a plain tensor or a size"
    if torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs):
        return "an input requires grad"
    if torch._C._is_any_autocast_enabled():
        return "autocast is on"
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return "the graph module holds parameters"
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module"):
            return f"the graph has a {n.op} node"
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            return f"the graph calls {n.target}"
    if _writes_an_input(gm):
        return "the graph writes an input"
    return None


# Python's in-place operators, as functions (operator.iadd) and as methods (__iadd__).
_IN_PLACE_OPERATORS = frozenset(f"{prefix}{op}{suffix}" for prefix, suffix in (("i", ""), ("__i", "__"))
                                for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow",
                                           "and", "or", "xor", "lshift", "rshift", "concat"))


def _in_place(node):
    """Whether a Dynamo call writes its first argument: relu_, add_, inplace=True, item assignment, +=. Python's
    operator functions write only as iadd, iand and the like: and_, or_ and not_ (`mask & other`, as
    transformers' attention masks combine) only take the underscore of a keyword."""
    import operator

    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target in (operator.setitem, operator.delitem):
        return True
    if not isinstance(target, str) and target is getattr(operator, name, None):
        return name in _IN_PLACE_OPERATORS
    if name.endswith("_") and not name.endswith("__"):
        return True
    return node.kwargs.get("inplace") is True or (isinstance(target, str) and name in _IN_PLACE_OPERATORS)


def _writes_an_input(gm):
    """Whether the Dynamo graph plainly writes one of its inputs: an in-place op or item assignment on an
    input, or a training batch norm (its running statistics). Such graphs go to AOTAutograd without a trace
    here that would only find the write afterwards (writes through views of inputs are found then)."""
    import torch

    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        if _in_place(n) and n.args and n.args[0] in inputs:
            return True
        if n.target is torch.nn.functional.batch_norm and (n.kwargs.get("training") or (len(n.args) > 5 and n.args[5])):
            return True
    return False


def _pinned(gm):
    """Which placeholders Dynamo marked static (parameters and buffers), as AOTAutograd reads them."""
    pinned = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            pinned.append(bool((n.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type")))
    return pinned


def _returns_alias(op):
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _view_base(node):
    """The node whose memory `node` aliases, through view ops (and getitem of multi-output views)."""
    import operator

    while node.op == "call_function":
        source = node.args[0] if node.target is operator.getitem else node
        if source.op != "call_function" or not _returns_alias(source.target):
            break
        node = source.args[0]
    return node


def _restride_out_of_place(traced):
    """C++ functionalization leaves `as_strided_` on a fresh result (ATen's adaptive_avg_pool2d gives a 1x1
    mean of a channels_last input its layout so): where that result has no other use and aliases no input,
    the out-of-place `as_strided` view is the same."""
    import torch

    aten = torch.ops.aten
    for n in list(traced.graph.nodes):
        if n.op != "call_function" or n.target is not aten.as_strided_.default:
            continue
        base = n.args[0]
        if len(base.users) == 1 and _view_base(base).op != "placeholder":
            n.target = aten.as_strided.default


def _traced_problem(traced):
    """Why the traced graph needs AOTAutograd after all, or None. Mirrors what AOTAutograd's metadata would
    ask its runtime wrapper for in an inference graph: replaying input mutations, and regenerating outputs
    that alias inputs (outputs that are views of intermediates come out of the graph as they are)."""
    import operator

    import torch

    from .lower import _PRIMS

    for n in traced.graph.nodes:
        if n.op == "call_function":
            if n.target is operator.getitem or n.target in _PRIMS or n.target is getattr(torch, "sym_sum", None):
                continue  # (arithmetic on symbolic sizes, as lower.py runs it)
            if not isinstance(n.target, torch._ops.OpOverload):
                return f"the traced graph calls {n.target}"
            if n.target._schema.is_mutable:
                return f"the traced graph writes memory ({n.target})"
        elif n.op == "output":
            outputs = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
            for o in outputs:
                if not isinstance(o, torch.fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor):
                    return "an output is not a tensor"
                if o.meta["val"].requires_grad:
                    return "an output requires grad"
                if _view_base(o).op == "placeholder":
                    return "an output aliases an input"
            if len(set(outputs)) != len(outputs):
                return "an output is returned twice"
    return None


def _symbolic(fakes):
    """Whether any of these fakes is a symbolic size or has one among its sizes and strides."""
    import torch

    return any(isinstance(f, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in (*f.shape, *f.stride()))
               for f in fakes)


def _functionalized(fn, fakes):
    """fn functionalized (its writes to intermediates become out-of-place ops) for a trace over these fakes.
    Over symbolic sizes fn as it is: torch.func.functionalize reads sizes through aten.size, which fake tensors
    answer with ints, specializing every size; a write that is left then sends the graph to AOTAutograd
    (_traced_problem)."""
    import torch

    return fn if _symbolic(fakes) else torch.func.functionalize(fn, remove="mutations")


def _fake_inputs(gm, example_inputs, fake_mode):
    """What the trace runs on: each tensor as the fake mode has it (with Dynamo's symbolic sizes where the graph
    has them), each size input as the SymInt of Dynamo's placeholder (None where it has none)."""
    import torch

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = []
    for x, node in zip(example_inputs, placeholders):
        if isinstance(x, torch.Tensor):
            fakes.append(fake_mode.from_tensor(x))
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if not isinstance(value, torch.SymInt):
            return None
        fakes.append(value)
    return fakes if len(fakes) == len(example_inputs) else None


def _lazy_graph_modules():
    """The context in which make_fx and torch.fx make graph modules that generate their code on first use."""
    import contextlib

    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # a torch without lazy graph modules
        return contextlib.nullcontext()
    return _use_lazy_graph_module(True)


def trace_inference(gm, example_inputs, decompositions):
    """(traced graph module, pinned inputs) for an inference graph AOTAutograd would add nothing to, or
    (None, why not)."""
    if not config.direct_trace:
        return None, "direct_trace off"
    import torch
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.multiprocessing.reductions import StorageWeakRef

    why = _plain_inputs(gm, example_inputs)
    if why:
        return None, why
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return None, "no fake mode"
    fakes = _fake_inputs(gm, example_inputs, fake_mode)
    if fakes is None:
        return None, "a size input without its symbol"
    tensors = [f for f in fakes if isinstance(f, torch.Tensor)]
    storages = {StorageWeakRef(f.untyped_storage()) for f in tensors}
    if len(storages) != len(tensors):
        return None, "two inputs share memory"
    # Graph modules whose Python code is generated when first run or read, not when made: lower.py reads
    # only the graph (BERT-base's 722 traced nodes took 80 ms to generate and compile, twice).
    with _lazy_graph_modules():
        traced = None
        if _repeats_enough(gm):
            try:
                traced = _trace_by_node(gm, fakes, decompositions, fake_mode)
            except Exception:  # _NotByNode, or anything unforeseen: the whole-graph trace below decides
                traced = None
        if traced is None:
            try:
                # The Python dispatcher, as AOTAutograd traces with it: decompositions registered for the
                # Autograd key apply (an eval batch norm becomes _native_batch_norm_legit_no_training).
                with fake_mode, enable_python_dispatcher():
                    traced = make_fx(_functionalized(gm, fakes), decomposition_table=decompositions)(*fakes)
            except Exception as e:  # AOTAutograd's own trace then reports it, or copes
                return None, f"tracing failed: {type(e).__name__}: {e}"
    _restride_out_of_place(traced)
    why = _traced_problem(traced)
    if why:
        return None, why
    traced.graph.eliminate_dead_code()  # as AOTAutograd does: unused results of decompositions (an empty reserve)
    traced.recompile()
    return traced, _pinned(gm)


# ----------------------------------------------------------------------------------------------------------
# Tracing one distinct call at a time
# ----------------------------------------------------------------------------------------------------------


class _NotByNode(Exception):
    """The graph keeps the whole-graph trace."""


_MIN_CALLS = 12  # below this, or with more than a sixth of the calls distinct, a trace per distinct call costs more

# Calls that change global state between the calls around them: traced once, their effect would be missing
# where a repeat is copied instead of run.
_STATEFUL_NAMES = frozenset({
    "_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast", "manual_seed", "seed",
    "set_rng_state", "set_default_dtype", "_set_deterministic_algorithms", "use_deterministic_algorithms",
    "_record_function_enter", "_record_function_enter_new", "_record_function_exit", "_enter_inference_mode",
    "_exit_inference_mode", "set_device", "synchronize",
})
_STATEFUL_MODULES = ("torch.autograd", "torch.amp", "torch.random", "torch.cuda", "torch._C._autograd",
                     "torch.profiler", "torch._functorch")


def _stateful(node):
    """Whether a Dynamo call may write memory or global state (then the whole graph is traced at once)."""
    if _in_place(node) or "out" in node.kwargs:
        return True
    target = node.target
    if (target if isinstance(target, str) else getattr(target, "__name__", "")) in _STATEFUL_NAMES:
        return True
    return (getattr(target, "__module__", None) or "").startswith(_STATEFUL_MODULES)


def _literal_key(x):
    """A key for a literal (not a container: _arg_key) that equals another's only where the two trace the same,
    or _NotByNode.
    Floats go by their text (0.0 and -0.0 compare equal but scale differently); types are part of the key
    (True == 1)."""
    import torch

    if x is None or isinstance(x, (bool, int, str, torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return (type(x), x)
    if isinstance(x, float):
        return (float, repr(x))
    if x is Ellipsis:
        return (type(x),)
    raise _NotByNode(f"an argument of kind {type(x).__name__}")


def _arg_key(x, slots):
    """The key of a (nested) argument: tensors (graph nodes) by their slot among the call's tensor inputs."""
    import torch

    if isinstance(x, torch.fx.Node):
        return ("tensor", slots[x])
    if isinstance(x, (list, tuple)):
        return (type(x), *(_arg_key(i, slots) for i in x))
    if isinstance(x, dict):
        return (dict, *((k, _arg_key(v, slots)) for k, v in x.items()))
    if isinstance(x, slice):
        return (slice, _arg_key(x.start, slots), _arg_key(x.stop, slots), _arg_key(x.step, slots))
    return _literal_key(x)


def _map_args(x, fn):
    """`x` with every graph node in it replaced by fn(node), through lists, tuples, dicts and slices."""
    import torch

    if isinstance(x, torch.fx.Node):
        return fn(x)
    if isinstance(x, (list, tuple)):
        mapped = [_map_args(i, fn) for i in x]
        return type(x)(*mapped) if hasattr(x, "_fields") else type(x)(mapped)  # namedtuples take fields
    if isinstance(x, dict):
        return {k: _map_args(v, fn) for k, v in x.items()}
    if isinstance(x, slice):
        return slice(_map_args(x.start, fn), _map_args(x.stop, fn), _map_args(x.step, fn))
    return x


def _tensor_nodes(x, found):
    """Appends the graph nodes in `x` to `found`, each once, in order of appearance."""
    _map_args(x, lambda n: found.append(n) if n not in found else None)
    return found


def _dim_key(d):
    """A size by its value, or a symbolic one by its expression (equal expressions are equal sizes)."""
    import torch

    return ("sym", str(d.node.expr)) if isinstance(d, torch.SymInt) else d


def _tensor_key(t):
    """The key of a call's input: a tensor's dtype, sizes, strides, offset and device, or a size's expression."""
    import torch

    if isinstance(t, torch.SymInt):
        return ("size", _dim_key(t))
    if not isinstance(t, torch.Tensor):
        raise _NotByNode(f"an input of kind {type(t).__name__}")
    return (t.dtype, tuple(map(_dim_key, t.shape)), tuple(map(_dim_key, t.stride())), _dim_key(t.storage_offset()),
            t.device)


def _repeats_enough(gm):
    """Whether a trace per distinct call should pay: enough calls, at most a sixth of them distinct by the key
    Dynamo's own values give (the traced values decide the real keys; this only estimates)."""
    mode = config.trace_by_node
    if mode is False:
        return False
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    if mode is True:
        return True
    if len(calls) < _MIN_CALLS:
        return False
    import torch

    keys = set()
    for n in calls:
        tensors = _tensor_nodes((n.args, n.kwargs), [])
        slots = {t: i for i, t in enumerate(tensors)}
        try:
            metas = tuple(_tensor_key(t.meta["example_value"]) for t in tensors
                          if isinstance(t.meta.get("example_value"), torch.Tensor))
            keys.add((n.op, n.target, metas, _arg_key((n.args, n.kwargs), slots)))
        except (_NotByNode, TypeError):
            return False
    return 6 * len(keys) <= len(calls)


def _fresh_like(t):
    """A new fake tensor of t's dtype, sizes, strides, offset and device, sharing nothing with any other."""
    import torch

    if isinstance(t, torch.SymInt):  # a size: the same symbol (sizes are values, not memory)
        return t
    if t.storage_offset() == 0:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    base = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=t.device)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _trace_call(call, tensors, decompositions, fake_mode):
    """One call (op kind, target, (args, kwargs)) traced alone, functionalized and decomposed as the whole graph
    would be, on fresh fake inputs (tensors that are one node in the graph are one input here)."""
    import torch
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    op, target, args = call

    def run(*values):
        value_of = dict(zip(tensors, values))
        positional, keywords = _map_args(args, value_of.__getitem__)
        if op == "call_method":
            return getattr(positional[0], target)(*positional[1:], **keywords)
        return target(*positional, **keywords)

    with fake_mode, enable_python_dispatcher():
        fresh = [_fresh_like(t.meta["val"]) for t in tensors]
        try:
            traced = make_fx(_functionalized(run, fresh), decomposition_table=decompositions)(*fresh)
        except Exception as e:
            raise _NotByNode(f"{target}: {type(e).__name__}: {e}") from e
    for n in traced.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            if n.target is torch.ops.aten.as_strided_.default and _view_base(n.args[0]).op != "placeholder":
                continue  # a restride of a result of its own, as the whole graph's trace keeps (_restride_out_of_place)
            raise _NotByNode(f"{target} writes memory ({n.target})")
        if n.op in ("call_module", "call_method"):
            raise _NotByNode(f"{target} traced to a {n.op}")
    return traced


def _resolved_call(node, value):
    """(op kind, target, (args, kwargs), its tensor nodes, their slots) of a Dynamo call whose arguments `value`
    maps to the new graph's nodes; None where the node only picks an element of a multi-output call's result
    (value[node] is then set to it)."""
    import operator

    import torch

    if node.op not in ("call_function", "call_method"):
        raise _NotByNode(f"a {node.op} node")
    args = _map_args((node.args, node.kwargs), value.__getitem__)
    if node.target is operator.getitem and not isinstance(args[0][0], torch.fx.Node):
        value[node] = args[0][0][args[0][1]]
        return None
    if node.op == "call_method" and not isinstance(args[0][0], torch.fx.Node):
        raise _NotByNode(f"{node.name} calls a method of a {type(args[0][0]).__name__}")
    tensors = _tensor_nodes(args, [])
    return node.op, node.target, args, tensors, {t: i for i, t in enumerate(tensors)}


def _trace_by_node(gm, fakes, decompositions, fake_mode):
    """The traced graph of `gm` built call by call, each distinct call traced once (see the module's text)."""
    import torch
    import torch.fx

    if any(_stateful(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")):
        raise _NotByNode("a call writes memory or global state")
    graph = torch.fx.Graph()
    root = torch.nn.Module()
    traces = {}  # call key -> its traced graph module
    constant_names = {}  # (traced module, attribute) -> name on root
    value = {}  # Dynamo node -> what it computes here: graph nodes, Python values, or containers of them
    inputs = iter(fakes)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value[node] = graph.placeholder(node.name)
            value[node].meta["val"] = next(inputs)
            continue
        if node.op == "output":
            graph.output(_map_args(node.args[0], value.__getitem__))
            continue
        call = _resolved_call(node, value)
        if call is None:
            continue
        op, target, args, tensors, slots = call
        key = (op, target, tuple(_tensor_key(t.meta["val"]) for t in tensors), _arg_key(args, slots))
        traced = traces.get(key)
        if traced is None:
            traced = traces[key] = _trace_call((op, target, args), tensors, decompositions, fake_mode)
        copies = {}
        placeholders = iter(tensors)
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                copies[n] = next(placeholders)
            elif n.op == "get_attr":
                name = constant_names.get((traced, n.target))
                if name is None:
                    name = constant_names[(traced, n.target)] = f"_traced_constant{len(constant_names)}"
                    setattr(root, name, getattr(traced, n.target))
                copies[n] = graph.get_attr(name)
                copies[n].meta = dict(n.meta)
            elif n.op == "output":
                value[node] = _map_args(n.args[0], copies.__getitem__)
            else:
                copies[n] = graph.node_copy(n, copies.__getitem__)
    from torch.fx._lazy_graph_module import _make_graph_module

    return _make_graph_module(root, graph)
