"""Inference graphs traced to ATen ops in one pass, without AOTAutograd.

For an inference graph (nothing needs a gradient) AOTAutograd runs the Dynamo graph twice on fake tensors:
once to collect runtime metadata (which inputs are mutated, which outputs alias what), once to trace the
functionalized, decomposed graph. Where that metadata would ask its runtime wrapper for nothing, one traced
pass gives the same graph: `make_fx` over `torch.func.functionalize` with ember's decompositions. BERT-base
b8 s128's ATen tracing in a fresh process: 1.72 s through AOTAutograd, 1.02 s so (H100 host); 1.57 and
0.58 s on this project's 2-core CPU host.

What keeps AOTAutograd, read from the Dynamo graph before tracing or from the traced graph after:
- anything that needs a gradient, autocast, dynamic shapes, inputs that are not plain tensors, two inputs
  sharing memory, a graph module holding tensors of its own, higher-order ops or submodules;
- a graph that still writes memory after functionalization (an input mutated: AOTAutograd's wrapper or its
  version-counter bookkeeping are needed), or whose outputs alias an input (the wrapper regenerates those).
EMBER_DIRECT_TRACE=0 sends every graph through AOTAutograd.
"""

import os


def _plain_inputs(gm, example_inputs):
    """Why the graph's inputs rule a one-pass trace out, or None."""
    import torch

    if any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in example_inputs):
        return "an input is not a plain tensor"
    if torch.is_grad_enabled() and any(x.requires_grad for x in example_inputs):
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


def _writes_an_input(gm):
    """Whether the Dynamo graph plainly writes one of its inputs: an in-place op or item assignment on an
    input, or a training batch norm (its running statistics). Such graphs go to AOTAutograd without a trace
    here that would only find the write afterwards (writes through views of inputs are found then)."""
    import operator

    import torch

    inputs = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        in_place = (name.endswith("_") and not name.endswith("__")) or n.kwargs.get("inplace") is True
        in_place = in_place or n.target in (operator.setitem, operator.iadd, operator.isub, operator.imul,
                                            operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                                            operator.iand, operator.ior, operator.ixor, operator.ilshift,
                                            operator.irshift)
        if in_place and n.args and n.args[0] in inputs:
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

    for n in traced.graph.nodes:
        if n.op == "call_function":
            if n.target is operator.getitem:
                continue
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


def trace_inference(gm, example_inputs, decompositions):
    """(traced graph module, pinned inputs) for an inference graph AOTAutograd would add nothing to, or
    (None, why not)."""
    if os.environ.get("EMBER_DIRECT_TRACE", "1") == "0":
        return None, "EMBER_DIRECT_TRACE=0"
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
    fakes = [fake_mode.from_tensor(x) for x in example_inputs]
    if any(isinstance(d, torch.SymInt) for f in fakes for d in (*f.shape, *f.stride())):
        return None, "dynamic shapes"
    storages = {StorageWeakRef(f.untyped_storage()) for f in fakes}
    if len(storages) != len(fakes):
        return None, "two inputs share memory"
    try:
        # The Python dispatcher, as AOTAutograd traces with it: decompositions registered for the Autograd key
        # apply (an eval batch norm becomes _native_batch_norm_legit_no_training, not native_batch_norm).
        with fake_mode, enable_python_dispatcher():
            traced = make_fx(torch.func.functionalize(gm, remove="mutations"), decomposition_table=decompositions)(*fakes)
    except Exception as e:  # AOTAutograd's own trace then reports it, or copes
        return None, f"tracing failed: {type(e).__name__}: {e}"
    _restride_out_of_place(traced)
    why = _traced_problem(traced)
    if why:
        return None, why
    traced.graph.eliminate_dead_code()  # as AOTAutograd does: unused results of decompositions (an empty reserve)
    traced.recompile()
    return traced, _pinned(gm)
