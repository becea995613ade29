"""The torch.compile entry point: torch.compile(model, backend="ember", mode=..., options=...).

Dynamo hands ember a torch-level FX graph; AOTAutograd (with ember's decomposition table) turns it into
forward / backward / inference graphs of ATen ops; each of those is lowered to IR text, compiled in
C++ and handed back as a C++ callable (boxed calling convention, no Python per call). An inference graph
whose AOTAutograd wrapper would have nothing to do is traced to ATen ops in one pass instead (trace.py:
the same graph at about half AOTAutograd's cost); ember.config.direct_trace = False sends it through AOTAutograd
too.
A training graph whose wrapper would add nothing but its autograd function is traced call by call with each
call's backward instead (joint.py: BERT-base training's ATen tracing 1.3-1.5 s less on the 2-core host);
trace_by_node = False keeps AOTAutograd for it.

Options (torch.compile's `options=` dict) are the settings of ember.config marked `option` (config.py:
fallback, disable_passes, debug_dir, cudagraphs, cudagraph_warmup, cudagraph_max_graphs, autotune,
autotune_budget_s, parameter_cache, pad_to_buckets, pad_dims);
one compile's options take precedence over ember.config and the environment. torch.compile hands mode and
options to the backend only at the first call, so that is where an unknown one raises (CompileConfig), before
anything is traced.

Inference graphs whose AOTAutograd runtime wrapper would only pass arguments through are handed to
Dynamo as the C++ graph itself, so a call runs no Python frame between Dynamo's guards and the plan. A
training graph whose wrapper would add nothing but its autograd.Function becomes one C++ autograd function
instead (python_bindings/training_graph.h): its backward then compiles with the forward, not at the first
backward. ember.config.direct_call = False keeps AOTAutograd's wrappers for both.

mode="reduce-overhead" captures the CUDA parts of each graph into CUDA graphs (cudagraph/ in C++): host
syncs, CPU tensors and data-dependent shapes split a graph into captured parts with eager steps between
them; outputs a caller still holds are never overwritten by a later replay. `ember.explain` shows the parts.
"""

import contextlib
import gc
import itertools
import os
import time
import warnings

from . import config as ember_config
from .errors import EmberError

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Inductor's tuning modes: their CUDA GEMMs time every candidate at their first calls, within autotune_budget_s per
# graph (CompileOptions::autotune, kernels/cuda/gemm.cpp; options={"autotune": True} asks the same of any mode, as
# torch.compile takes a mode or options, not both); max-autotune captures CUDA graphs as reduce-overhead does (as
# inductor's does), max-autotune-no-cudagraphs does not.
_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
OPTIONS = ember_config.OPTIONS

_graph_ids = itertools.count()
_warned_no_cuda_graphs = False
_mark_step_hooked = False


class CompileConfig:
    """The resolved mode and options of one torch.compile call (ember.config.resolve_options)."""

    def __init__(self, mode=None, options=None):
        if mode not in MODES:
            raise EmberError(f"unknown mode {mode!r}; ember accepts: {', '.join(repr(m) for m in MODES)}")
        resolved = ember_config.resolve_options(options)
        self.mode = mode or "default"
        self.fallback = resolved["fallback"]
        self.disabled_passes = list(resolved["disable_passes"])
        self.debug_dir = resolved["debug_dir"]
        graphs = resolved["cudagraphs"]
        self.cudagraphs = self.mode in _GRAPH_MODES if graphs is None else graphs
        self.cudagraph_warmup = resolved["cudagraph_warmup"]
        self.cudagraph_max_graphs = resolved["cudagraph_max_graphs"]
        self.parameter_cache = resolved["parameter_cache"]
        tune = resolved["autotune"]
        self.autotune = self.mode in _AUTOTUNE_MODES if tune is None else tune
        self.autotune_budget_s = resolved["autotune_budget_s"]
        self.pad_to_buckets = resolved["pad_to_buckets"]
        self.pad_dims = resolved["pad_dims"]

    def check_passes(self, known):
        unknown = [p for p in self.disabled_passes if p not in known]
        if unknown:
            raise EmberError(f"unknown pass(es) {unknown} in disable_passes; ember's passes: {', '.join(known)}")


def _hint_nvrtc():
    """Points ember at the NVRTC that torch's CUDA wheels install, unless ember.config.nvrtc_path is set."""
    if ember_config.nvrtc_path:
        return
    import glob

    import torch

    root = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")
    found = sorted(glob.glob(os.path.join(root, "**", "libnvrtc.so*"), recursive=True))
    if found:
        ember_config.nvrtc_path = os.path.realpath(found[-1])


def compile_fx_graph(gm, config, kind, pinned=None, lowered=None):
    """Lowers and compiles one ATen graph (from AOTAutograd or trace.py); returns a boxed callable. `pinned`:
    which inputs keep their address from call to call, where AOTAutograd did not say (_pinned_inputs).
    `lowered`: a list that gets what the compile cache stores of this graph (cache.py), where it has no
    control flow and compiled."""
    graph_name = f"g{next(_graph_ids)}_{kind}"
    try:
        from .lower import inline_invoke_subgraphs, lower_graph

        gm = inline_invoke_subgraphs(gm)
        _dump_fx(config, graph_name, gm)
        start = time.perf_counter()
        ir, constants, subgraphs = lower_graph(gm)
        lower_ms = (time.perf_counter() - start) * 1e3
        if pinned is None:
            pinned = _pinned_inputs(gm, kind)
        fx_nodes = _fx_nodes(gm)
        is_cuda = any(n.op == "placeholder" and getattr(n.meta.get("val"), "is_cuda", False) for n in gm.graph.nodes)
        padding = _size_buckets(gm, config, kind, graph_name)
        compiled = _compile_ir(ir, constants, _compile_subgraphs(subgraphs, config, graph_name), config, kind,
                               graph_name, pinned, fx_nodes, lower_ms, is_cuda, _unversioned_inputs(gm), padding)
        if lowered is not None and not subgraphs:
            lowered.append({"ir": ir, "constants": dict(constants), "pinned": list(pinned), "fx_nodes": fx_nodes,
                            "cuda": is_cuda, "padding": padding})
        return compiled
    except Exception as e:
        return _fell_back(e, config, kind, gm)


def _size_buckets(gm, config, kind, graph_name):
    """pad_to_buckets for one ATen graph: (the plan CompiledGraph.set_size_buckets takes, or None; why not, or "").
    A graph that has symbolic sizes to pad but must not be padded (buckets.py says why; a training graph, whose
    padded rows would reach the parameters' gradients) runs at its own sizes, with one warning."""
    if config.pad_to_buckets is None:
        return None, ""
    from .buckets import Refused, padding_plan

    try:
        plan = padding_plan(gm, config.pad_to_buckets, config.pad_dims)
        why = "" if plan is None or kind == "inference" else (
            f"a {kind} graph: padding is for inference graphs alone (padded rows would reach the gradients)")
    except Refused as e:
        plan, why = None, str(e)
    if not why:
        return plan, ""
    if kind != "backward":  # its forward said it
        warnings.warn(f"ember: pad_to_buckets leaves {graph_name} at its own sizes: {why}", stacklevel=4)
    return None, why


def _fx_nodes(gm):
    """The calls of an ATen graph (what ember.explain counts as its FX nodes)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def compile_cached_graph(graph, config, kind):
    """compile_fx_graph for one graph of a compile cache entry: the C++ pipeline over its stored IR."""
    graph_name = f"g{next(_graph_ids)}_{kind}"
    return _compile_ir(graph["ir"], graph["constants"], {}, config, kind, graph_name, graph["pinned"],
                       graph["fx_nodes"], 0.0, graph["cuda"], padding=graph.get("padding") or (None, ""))


def _compile_ir(ir, constants, subgraphs, config, kind, graph_name, pinned, fx_nodes, lower_ms, is_cuda,
                unversioned=(), padding=(None, "")):
    from . import _C, report

    if is_cuda:
        _hint_nvrtc()
    # Inference graphs: steps over parameters alone (weights in channels_last, a padded LM head, a batch
    # norm's scale and shift) run once, and again only when a parameter changes (as its version counter
    # says: not for `unversioned` inputs).
    cached = pinned if kind == "inference" and config.parameter_cache else []
    if cached and any(unversioned):
        cached = [p and not u for p, u in zip(cached, unversioned)]
    # Under the Python dispatcher, as the tracing was (and as AOTAutograd compiles): the plan's view steps
    # take their geometry from meta kernels, and only where those agree with the traced types do they
    # become fast paths (under plain C++ meta kernels, 12 of BERT-base's views did not: the strides of
    # size-1 dims differ).
    from torch._dispatch.python import enable_python_dispatcher

    with enable_python_dispatcher():
        compiled = _C.compile(ir, constants, config.disabled_passes, config.debug_dir, graph_name, cached, subgraphs,
                              config.autotune, config.autotune_budget_s, list(unversioned))
    compiled._boxed_call = True
    if cached:  # and over a symbolic graph's sizes, kept per size, where no CUDA graph replays it (runtime.h)
        compiled.cache_parameter_steps(cached, sizes=not config.cudagraphs)
    plan, unpadded = padding
    if plan is not None:  # before the CUDA graphs: they then see the padded sizes alone
        compiled.set_size_buckets(*plan)
    graphs_note = _enable_cuda_graphs(compiled, is_cuda, config, pinned) if config.cudagraphs else ""
    report.record_graph(graph_name, kind, fx_nodes, compiled, lower_ms, ir, graphs_note, unpadded)
    return compiled


def _fell_back(e, config, kind, gm):
    """What a graph ember could not compile becomes: EmberError with fallback="raise", else gm itself (a
    warning says so)."""
    from functorch.compile import make_boxed_func

    from . import report

    report.record_fallback(kind, str(e))
    if config.fallback == "raise":
        if isinstance(e, EmberError):
            raise
        raise EmberError(f"ember could not compile the {kind} graph: {e}") from e
    warnings.warn(f"ember could not compile the {kind} graph and runs it eagerly: {e}", stacklevel=3)
    return make_boxed_func(gm.forward)


def _dump_fx(config, graph_name, gm):
    """debug_dir: the readable FX graph ember lowers, as <graph_name>.fx.py."""
    if config.debug_dir:
        os.makedirs(config.debug_dir, exist_ok=True)
        with open(os.path.join(config.debug_dir, graph_name + ".fx.py"), "w") as f:
            f.write(gm.print_readable(print_output=False))


def _compile_subgraphs(subgraphs, config, prefix):
    """{name: CompiledGraph} for the subgraphs a graph's control flow names (lower.py), each lowered and
    compiled as a graph of its own, and its own control flow's subgraphs before it."""
    from . import _C, report
    from .lower import inline_invoke_subgraphs, lower_graph

    compiled = {}
    for name, sub in subgraphs.items():
        sub = inline_invoke_subgraphs(sub)
        graph_name = f"{prefix}_{name}"
        _dump_fx(config, graph_name, sub)
        start = time.perf_counter()
        ir, constants, nested = lower_graph(sub)
        lower_ms = (time.perf_counter() - start) * 1e3
        nested = _compile_subgraphs(nested, config, graph_name)
        compiled[name] = _C.compile(ir, constants, config.disabled_passes, config.debug_dir, graph_name, [], nested,
                                    config.autotune, config.autotune_budget_s)
        report.record_graph(graph_name, "subgraph", _fx_nodes(sub), compiled[name], lower_ms, ir)
    return compiled


def _pinned_inputs(gm, kind):
    """Which graph inputs keep their address from call to call: what AOTAutograd reports as static for a
    forward or inference graph (parameters, buffers); for a backward graph everything but the tangents
    (saved tensors and parameters; the C++ runner copies one instead once it is seen to move)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if kind == "backward":
        return ["tangents" not in n.name for n in placeholders]
    import torch._guards

    context = torch._guards.TracingContext.try_get()
    static = getattr(getattr(context, "fw_metadata", None), "static_input_indices", None) or []
    pinned = [False] * len(placeholders)
    for i in static:
        if 0 <= i < len(pinned):
            pinned[i] = True
    return pinned


def _unversioned_inputs(gm):
    """Per placeholder of an AOTAutograd graph, whether it may change without its version counter moving
    (CompileOptions::unversioned_inputs): the inner tensors AOTAutograd flattened a tensor subclass into, as its
    input descriptors say (a DTensor parameter's local shard, written by the optimizer's in-place step below the
    DTensor, whose counter alone moves), in a forward and where a backward takes one as a saved input."""
    def inner(desc):
        while desc is not None:
            if type(desc).__name__ == "SubclassGetAttrAOTInput":
                return True
            desc = getattr(desc, "base", None)
        return False

    flags = [inner(n.meta.get("desc")) for n in gm.graph.nodes if n.op == "placeholder"]
    return flags if any(flags) else []


def _plain_metadata(meta):
    """Whether AOTAutograd's runtime metadata asks its wrapper for nothing but calling the graph (and bumping
    the version counters of inputs the graph writes itself, `_bumped_inputs`): no input mutations to replay
    after the call, no aliased outputs, intermediate bases, effect tokens, functionalized RNG, tensor subclasses
    or grad mode to restore."""
    from torch._functorch._aot_autograd.schemas import MutationType, OutputType

    for i in meta.input_info:
        if not (i.mutates_data or i.mutates_metadata):
            continue
        # Data written in place by the graph itself (a batch norm's running statistics, a cache) is fine;
        # a change of sizes, strides or storage is the wrapper's to replay.
        if i.mutation_type != MutationType.MUTATED_IN_GRAPH or i.mutates_metadata:
            return False
        if getattr(i, "mutation_inductor_storage_resize", False):
            return False
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        return False
    if meta.num_intermediate_bases or meta.tokens or meta.grad_enabled_mutation is not None:
        return False
    if getattr(meta, "is_rng_op_functionalized", False):
        return False
    subclass_meta = list(getattr(meta, "subclass_inp_meta", None) or []) + list(
        getattr(meta, "subclass_fw_graph_out_meta", None) or []
    )
    return all(isinstance(m, int) or type(m).__name__ == "PlainTensorMeta" for m in subclass_meta)


def _dynamic_dims_marker():
    """How AOTAutograd's wrapper marks an output's symbolic dims for Dynamo, so that a graph fed by this output
    after a graph break treats those dims as dynamic at once: its function where this torch has one (an
    unguarded attribute), else what torchs without it do (`_dynamo_weak_dynamic_indices`, widened in place)."""
    from torch._functorch._aot_autograd import runtime_wrappers

    return getattr(runtime_wrappers, "mark_dynamo_propagated_dynamic_indices", _mark_weak_dynamic_indices)


def _mark_weak_dynamic_indices(t, dims):
    if hasattr(t, "_dynamo_weak_dynamic_indices"):
        t._dynamo_weak_dynamic_indices |= dims
    else:
        t._dynamo_weak_dynamic_indices = set(dims)


def _output_dynamic_dims(meta):
    """[(output index, its symbolic dims)] that AOTAutograd's wrapper marks per call (see _marking_dims)."""
    if not getattr(meta, "dynamic_outputs", False):
        return []
    return [(i, sorted(o.dynamic_dims)) for i, o in enumerate(meta.output_info) if o.dynamic_dims]


def _marking_dims(direct, dims):
    """`direct`, or where outputs have symbolic dims, a function that calls it and marks them as AOTAutograd's
    wrapper would: the one per-call Python step of a DirectCall, taken by symbolic-shape graphs alone."""
    if not dims:
        return direct
    mark = _dynamic_dims_marker()
    marks = [(i, frozenset(d)) for i, d in dims]

    def call(*args):
        outputs = direct(*args)
        for i, d in marks:
            mark(outputs[i], set(d))
        return outputs

    call._boxed_call = getattr(direct, "_boxed_call", False)
    return call


def _bumped_inputs(meta):
    """The inputs whose version counter AOTAutograd's wrapper bumps per call: those the graph writes in place
    where autograd can see it (so that a tensor saved for a backward and changed since is caught)."""
    return list(getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", None) or [])


def _wrapper_would_do_nothing(compiled):
    """Whether AOTAutograd's runtime wrapper around this inference graph would only pass arguments through
    (`_plain_metadata`, and no autocast to switch off). Then Dynamo may call the C++ graph directly (see
    DirectCall in python_bindings/module.cpp)."""
    import torch
    import torch._guards

    if not hasattr(compiled, "num_inputs") or torch._C._is_any_autocast_enabled():
        return False
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return False
    try:
        return _plain_metadata(meta)
    except AttributeError:  # a torch whose metadata reads differently: keep the wrapper
        return False


def _inference_facts():
    """The inference graph's inputs whose version counters a call bumps, and its outputs' symbolic dims."""
    import torch._guards

    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return [], []
    try:
        return _bumped_inputs(meta), _output_dynamic_dims(meta)
    except AttributeError:
        return [], []


def _forward_facts(gm, compiled):
    """What a training graph's C++ autograd function needs to know about its forward, read while
    AOTAutograd compiles it (None where the forward cannot run without AOTAutograd's wrapper): the runtime
    metadata, the inputs that are parameters, the number of results."""
    import torch
    import torch._guards

    if not hasattr(compiled, "num_inputs") or torch._C._is_any_autocast_enabled():
        return None
    try:
        from torch._functorch._aot_autograd.runtime_wrappers import _should_disable_saved_tensors_hooks

        if _should_disable_saved_tensors_hooks():  # hooks Dynamo inlined, switched off around each call
            return None
        if torch._dynamo.compiled_autograd.in_compiled_autograd_region or torch._dynamo.config.compiled_autograd:
            return None  # compiled autograd retraces AOTAutograd's backward
    except (ImportError, AttributeError):
        return None
    meta = getattr(torch._guards.TracingContext.try_get(), "fw_metadata", None)
    if meta is None:
        return None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return {"meta": meta, "pinned": _pinned_inputs(gm, "forward"), "results": len(output.args[0])}


def _backward_facts(gm):
    """The backward's number of inputs and which of its results (one per forward input) are always None."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return {"inputs": sum(1 for n in gm.graph.nodes if n.op == "placeholder"), "none": [a is None for a in output.args[0]]}


_MEMORY_FORMATS = {"torch.contiguous_format": 0, "torch.channels_last": 2, "torch.channels_last_3d": 3}  # c10::MemoryFormat


def _training_spec(forward, backward):
    """The arguments of _C.training_graph for a forward and backward AOTAutograd partitioned, or None where
    its wrapper does more than python_bindings/training_graph.cpp does."""
    import torch

    meta = forward["meta"]
    try:
        if not _plain_metadata(meta) or meta.num_mutated_inp_runtime_indices:
            return None
        if getattr(meta, "dynamic_outputs", False):  # the C++ training call marks no symbolic dims
            return None
        if meta.num_symints_saved_for_bw != 0 or getattr(meta, "num_opaque_objects_saved_for_bw", 0):
            return None
        if getattr(meta, "num_backward_tokens", 0) or getattr(meta, "num_graphsafe_rng_states", 0):
            return None
        if getattr(meta, "num_unsafe_view_outputs", 0):
            return None
        unchecked = getattr(meta, "num_tensors_saved_with_no_vc_check", 0) or 0
        saved = forward["results"] - meta.num_outputs
        requires = [
            bool(o.requires_grad) and isinstance(o.raw_type, type) and issubclass(o.raw_type, torch.Tensor)
            for o in meta.output_info
        ]
        tangent_meta = list(meta.subclass_tangent_meta)
        if saved < unchecked or backward["inputs"] != saved + sum(requires) or len(tangent_meta) != sum(requires):
            return None
        if len(backward["none"]) != len(meta.input_info):
            return None
        tangents = []
        for m in tangent_meta:
            layout = getattr(m, "memory_format", None)
            if type(m).__name__ != "PlainTensorMeta" or layout is None:
                return None
            if layout.memory_format is not None:
                if str(layout.memory_format) not in _MEMORY_FORMATS:
                    return None
                tangents.append((_MEMORY_FORMATS[str(layout.memory_format)], [], []))
            else:
                sizes, strides = list(layout.size), list(layout.stride)
                if not all(type(v) is int for v in sizes + strides):
                    return None
                tangents.append((-1, sizes, strides))
        no_edge = [none and info.requires_grad and not info.is_leaf for none, info in zip(backward["none"], meta.input_info)]
        deterministic = -1 if meta.deterministic is None else int(bool(meta.deterministic))
    except AttributeError:  # a torch whose metadata reads differently: keep the wrapper
        return None
    return {
        "output_requires_grad": requires,
        "saved_checked": saved - unchecked,
        "saved_unchecked": unchecked,
        "tangents": tangents,
        "no_edge": no_edge,
        "deterministic": deterministic,
    }


def _called_directly(gm, example_inputs, compiled):
    """Whether Dynamo may call `compiled` (a C++ graph taking this Dynamo graph's inputs) itself."""
    if not ember_config.direct_call or compiled.num_inputs != len(example_inputs):
        return False  # AOTAutograd deduplicated or rebased inputs
    if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return False
    # AOTAutograd would prepend parameters and buffers the graph module holds; graphs from Dynamo take them
    # as inputs
    return next(gm.parameters(), None) is None and next(gm.buffers(), None) is None


def _training_call(gm, example_inputs, compiled, stored):
    """The C++ DirectCall of a training graph, its forward and backward one C++ autograd function
    (python_bindings/training_graph.h), or None where AOTAutograd's wrapper must stay. `stored` gets what
    else the compile cache keeps to build it again (_cached_call)."""
    if [kind for kind, _, _ in compiled] != ["forward", "backward"]:
        return None
    (_, forward, forward_facts), (_, backward, backward_facts) = compiled
    from . import _C

    if forward_facts is None or not isinstance(backward, _C.CompiledGraph):
        return None
    if not _called_directly(gm, example_inputs, forward):
        return None
    spec = _training_spec(forward_facts, backward_facts)
    if spec is None:
        return None
    pinned = forward_facts["pinned"]
    pinned = pinned if len(pinned) == len(example_inputs) else []
    bump = _bumped_inputs(forward_facts["meta"])
    stored.update(kind="training", pinned=list(pinned), bump=list(bump), spec=spec)
    return _C.direct_call(forward, [], pinned, _shapes_guarded(gm, example_inputs), bump=bump,
                          training=_C.training_graph(forward, backward, **spec))


def _direct_call(gm, example_inputs, inference, stored):
    """The C++ DirectCall for this Dynamo graph, or None where AOTAutograd's wrapper must stay. `stored` gets
    what else the compile cache keeps to build it again (_cached_call)."""
    if inference is None:
        return None
    compiled, ok, pinned, (bump, dims) = inference
    if not ok or not _called_directly(gm, example_inputs, compiled):
        return None
    from . import _C

    pinned = pinned if len(pinned) == len(example_inputs) else []
    stored.update(kind="inference", pinned=list(pinned), bump=list(bump), dynamic_dims=dims)
    return _marking_dims(_C.direct_call(compiled, [], pinned, _shapes_guarded(gm, example_inputs), bump=bump), dims)


def _traced_call(gm, example_inputs, config, stored):
    """The C++ DirectCall of an inference graph traced in one pass without AOTAutograd (trace.py), the
    Dynamo graph itself where ember could not compile it (and warned), or None: then AOTAutograd traces it.
    `stored` gets the compile cache's entry (cache.py)."""
    if not ember_config.direct_call:
        return None
    from .decompositions import decomposition_table
    from .trace import trace_inference

    traced, pinned = trace_inference(gm, example_inputs, decomposition_table())
    if traced is None:
        return None
    lowered = []
    compiled = compile_fx_graph(traced, config, "inference", pinned, lowered)
    if not hasattr(compiled, "num_inputs"):  # fell back (with a warning): Dynamo's graph runs as it is
        return gm.forward
    if not _called_directly(gm, example_inputs, compiled):
        return None
    from . import _C

    dims = _traced_dynamic_dims(traced)
    if lowered:
        stored.update(kind="inference", graphs=lowered, pinned=list(pinned), dynamic_dims=dims)
    return _marking_dims(_C.direct_call(compiled, [], pinned, _shapes_guarded(gm, example_inputs), bump=[]), dims)


def _traced_dynamic_dims(traced):
    """[(output index, its symbolic dims)] of a traced graph's outputs, as AOTAutograd's metadata has them."""
    import torch

    (output,) = [n for n in traced.graph.nodes if n.op == "output"]
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    dims = []
    for i, o in enumerate(values):
        shape = o.meta["val"].shape
        symbolic = [d for d, size in enumerate(shape) if isinstance(size, torch.SymInt) and not size.node.is_constant()]
        if symbolic:
            dims.append((i, symbolic))
    return dims


def _cached_call(gm, example_inputs, config, entry):
    """The C++ DirectCall of a compile cache entry (cache.py), or None where it does not fit these inputs."""
    return entry_call(entry, config, lambda first: _called_directly(gm, example_inputs, first),
                      _shapes_guarded(gm, example_inputs))


def entry_call(entry, config, fits, shapes_guarded):
    """The C++ DirectCall built from a compile cache entry's graphs (the C++ pipeline over the stored IR, no
    tracing), or None where `fits(first compiled graph)` says it does not fit. Also how an aot_compile artifact
    is loaded (aot.py), which has no Dynamo graph to check against."""
    from . import _C

    graphs = [compile_cached_graph(g, config, kind)
              for g, kind in zip(entry["graphs"], ("inference",) if entry["kind"] == "inference" else ("forward", "backward"))]
    if not fits(graphs[0]):
        return None
    training = _C.training_graph(graphs[0], graphs[1], **entry["spec"]) if entry["kind"] == "training" else None
    direct = _C.direct_call(graphs[0], [], entry["pinned"], shapes_guarded,
                            bump=entry.get("bump", []), **({"training": training} if training is not None else {}))
    return _marking_dims(direct, entry.get("dynamic_dims", []))


def _joint_traced_call(gm, example_inputs, config, stored):
    """The C++ DirectCall of a training graph traced call by call without AOTAutograd (joint.py), its forward
    and backward one C++ autograd function; the Dynamo graph itself where ember could not compile them (and
    warned); or None: then AOTAutograd traces it. `stored` gets the compile cache's entry (cache.py)."""
    from .decompositions import decomposition_table
    from .joint import trace_training

    forward_gm, backward_gm, spec, pinned = trace_training(gm, example_inputs, decomposition_table())
    if forward_gm is None:
        return None
    from . import _C

    lowered = []
    forward = compile_fx_graph(forward_gm, config, "forward", pinned, lowered)
    if not isinstance(forward, _C.CompiledGraph):  # fell back (with a warning): Dynamo's graph runs as it is
        return gm.forward
    backward = compile_fx_graph(backward_gm, config, "backward", _pinned_inputs(backward_gm, "backward"), lowered)
    if not isinstance(backward, _C.CompiledGraph):
        return gm.forward
    if not _called_directly(gm, example_inputs, forward):
        return None
    if len(lowered) == 2:
        stored.update(kind="training", graphs=lowered, pinned=list(pinned), spec=spec)
    return _C.direct_call(forward, [], pinned, _shapes_guarded(gm, example_inputs), bump=[],
                          training=_C.training_graph(forward, backward, **spec))


def _shapes_guarded(gm, example_inputs):
    """Whether Dynamo's guards fix the sizes, strides, dtype and device of every tensor this graph takes:
    neither its placeholders (Dynamo's fake values) nor its example inputs have symbolic sizes or strides
    (under dynamic shapes Dynamo guards relations between sizes, not the sizes)."""
    import torch

    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    if len(values) != len(example_inputs) or any(v is None for v in values):
        return False
    for x in (*values, *example_inputs):
        if isinstance(x, torch.Tensor):
            if any(isinstance(d, symbolic) for d in (*x.shape, *x.stride())):
                return False
        elif isinstance(x, symbolic):
            return False
    return True


def _hook_mark_step_begin():
    """torch.compiler.cudagraph_mark_step_begin() tells inductor's cudagraph trees; tell ember too."""
    global _mark_step_hooked
    if _mark_step_hooked:
        return
    _mark_step_hooked = True
    from torch._inductor import cudagraph_trees

    from . import _C

    original = cudagraph_trees.mark_step_begin

    def mark_step_begin():
        _C.mark_step_begin()
        original()

    mark_step_begin.__doc__ = original.__doc__
    cudagraph_trees.mark_step_begin = mark_step_begin


def _enable_cuda_graphs(compiled, is_cuda, config, pinned):
    """Installs CUDA graph capture on `compiled` (a graph with CUDA inputs where is_cuda); returns '' or why
    the graph runs without it."""
    global _warned_no_cuda_graphs
    from . import _C

    if not _C.cuda_graphs_supported():
        if not _warned_no_cuda_graphs and is_cuda:
            _warned_no_cuda_graphs = True
            warnings.warn("ember: this build has no CUDA graph support (built against a torch without CUDA)")
        return "this ember build has no CUDA graph support"
    why_not = compiled.enable_cuda_graphs(pinned, config.cudagraph_warmup, config.cudagraph_max_graphs)
    if not why_not:
        _hook_mark_step_begin()
    return why_not


# Tensor methods and functions that compute nothing: a view or a detached alias of their input.
_VIEW_METHODS = frozenset({"detach", "view", "t", "permute", "transpose", "unsqueeze", "squeeze", "expand"})


def _nothing_to_compile(gm):
    """What the graph does, where all it does is take views or detached aliases of its inputs (the rest of a
    training step after `loss.backward()`: `loss.detach()`), else None. Run as it is, such a graph costs a
    few Python calls; through AOTAutograd its aliased outputs keep the Python wrapper around a plan with
    nothing in it."""
    import torch

    done = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_method" and n.target in _VIEW_METHODS:
            done.append(n.target)
        elif n.op == "call_function" and n.target in (torch.detach, torch.Tensor.detach):
            done.append("detach")
        else:
            return None
    return ", ".join(sorted(set(done))) or "nothing"


def ember_backend(gm, example_inputs, mode=None, options=None):
    """The backend torch.compile calls (registered as "ember" through the package's entry point)."""
    _hold_full_collections_in_dynamo()  # again: torch._dynamo.reset() drops Dynamo's callbacks
    config = CompileConfig(mode, options)
    with _collector_paused():
        if _compiling_ahead_of_time():
            from .aot import compile_for_aot

            return compile_for_aot(gm, example_inputs, config)
        return _compile_graph(gm, example_inputs, config)


def _compiling_ahead_of_time():
    """Whether this compile runs inside torch.compile(...).aot_compile(...), which needs a SerializableCallable
    back (aot.py). torch's aot_compile_fullgraph (torch/_dynamo/aot_compile.py) sets
    torch._functorch.config.force_autograd_cache around its backend call, and torch's own "eager" backend reads
    that flag to return its serializable graph (torch/_dynamo/backends/debugging.py): a config flag torch's
    backends already answer to, where a look up the stack for aot_compile_fullgraph's frame would depend on
    function names. Off unless set; a process that sets it for good gets the Python wrapper around every graph
    (one Python call more per call), not an error."""
    import torch._functorch.config

    return bool(getattr(torch._functorch.config, "force_autograd_cache", False))


@contextlib.contextmanager
def _collector_paused():
    """Python's garbage collector off while ember compiles a graph (AOTAutograd's tracing and ember's own work),
    back on after it, as it was. Tracing keeps most of what it allocates alive, so each full collection in it
    walked the whole heap and freed little. In BERT-base training's fresh first call on H200 hosts, 0.34-0.50 s
    of collecting fell inside the backend, two full collections in the call; paused, 0.07-0.09 s and one full
    collection, none moved into the next five calls, peak memory within 25 MB (1.69 GB). ember.config.pause_gc =
    False leaves the collector running."""
    if not gc.isenabled() or not ember_config.pause_gc:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _hold_full_collections_in_dynamo():
    """No full collection while Dynamo compiles a frame for ember: for the compile (its bytecode tracing, guards and
    code generation around ember_backend) the collector's oldest-generation threshold is out of reach, young
    collections still run, and the thresholds are restored when the compile ends, also when it raises. Dynamo
    keeps what it traces alive until the end, so a full collection inside it walks a growing heap and frees
    little. Fresh processes on an H200 host, collecting in the first call, before / after: GPT-2 b4 0.32-0.37 s
    (one full collection) / 0.05-0.06 s, BERT training 0.38-0.44 / 0.11-0.15 s. The collection held off runs at
    the program's next allocations (0.27-0.35 s there); for BERT training the program ran one there either way.
    Installed as Dynamo's compile start and end callbacks (torch._dynamo.callback_handler) where Dynamo is loaded,
    again at each ember_backend call (torch._dynamo.reset() drops them); they act only on frames compiled for
    ember (_compiling_for_ember). pause_gc = False leaves the collector alone here as in _collector_paused."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    handler = getattr(dynamo, "callback_handler", None)
    if handler is None or not ember_config.pause_gc:
        return
    if _dynamo_compile_started not in handler.start_callbacks:
        handler.register_start_callback(_dynamo_compile_started)
    if _dynamo_compile_ended not in handler.end_callbacks:
        handler.register_end_callback(_dynamo_compile_ended)


_thresholds_before_dynamo = None  # the collector's thresholds _dynamo_compile_started replaced, or None


def _dynamo_compile_started(args=None):
    global _thresholds_before_dynamo
    if gc.isenabled() and _thresholds_before_dynamo is None and _compiling_for_ember():
        _thresholds_before_dynamo = gc.get_threshold()
        gc.set_threshold(*_thresholds_before_dynamo[:2], 1 << 30)


def _dynamo_compile_ended(args=None):
    # Only what _dynamo_compile_started changed: the callbacks may have been installed in the middle of a compile.
    global _thresholds_before_dynamo
    if _thresholds_before_dynamo is not None:
        gc.set_threshold(*_thresholds_before_dynamo)
        _thresholds_before_dynamo = None


def _compiling_for_ember():
    """Whether the Dynamo compile running now has ember as its backend: the `compiler_fn` of Dynamo's
    `_compile` frame, unwrapped (Dynamo's debug wrapper, torch.compile's wrapper for string backends). False
    where no such frame is found (another torch's internals), so an unknown case keeps the collector running."""
    import sys

    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return False
        if frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals:
            break
        frame = frame.f_back
    else:
        return False
    fn = frame.f_locals["compiler_fn"]
    for _ in range(8):
        if fn is None:
            return False
        if fn is ember_backend or getattr(fn, "func", None) is ember_backend:
            return True
        if getattr(fn, "_compiler_name", None) == "ember" or getattr(fn, "compiler_name", None) == "ember":
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    return False


def _from_cache(gm, example_inputs, config, entry):
    """_cached_call, or None (then the graph compiles afresh) where the entry does not compile or fit."""
    from . import report

    try:
        direct = _cached_call(gm, example_inputs, config, entry)
    except Exception as e:  # an entry this ember cannot run: a miss
        from . import cache

        cache._log.debug("ember: compile cache entry %s not used (%s: %s)", entry.get("key"), type(e).__name__, e)
        direct = None
    report.record_cache(direct is not None)
    return direct


def _compile_graph(gm, example_inputs, config, built=None):
    """ember_backend's work, with the collector paused. `built`, where given, gets the compile cache entry the
    returned DirectCall is built from (whether or not the cache is on and stores it): what aot_compile saves."""
    if config.disabled_passes:  # a configuration error raises whatever the fallback setting
        from . import _C

        config.check_passes(_C.pass_names())
    what = _nothing_to_compile(gm)
    if what is not None:
        from . import report

        report.record_as_is(what)
        return gm.forward

    import torch._functorch.config

    from . import cache
    from .decompositions import decomposition_table

    # DDP's graph splitter (DDPOptimizer) calls each compiled piece once on fake tensors to get the inputs of the
    # next: AOTAutograd's wrapper answers that call, a DirectCall (C++, real tensors) cannot. Such pieces keep
    # the wrapper and skip the compile cache, whose hits are DirectCalls.
    direct_ok = not _first_call_is_fake()
    key = cache.key(gm, example_inputs, config) if direct_ok else None
    assumed = cache.shape_state(gm, example_inputs) if key is not None else None
    entry = cache.load(key)
    if entry is not None:
        direct = _from_cache(gm, example_inputs, config, entry)
        if direct is not None:
            if built is not None:
                built.update(entry)
            return direct
    if any(getattr(x, "is_cuda", False) for x in example_inputs):
        from . import _C

        _C.warm_up_cuda_compiler()  # NVRTC's first use in the process overlaps the tracing below

    inference = []
    training = []  # (kind, compiled, facts) for the forward and the backward
    lowered = []  # what the compile cache stores of the graphs AOTAutograd hands over
    # A tensor subclass among the inputs (a DTensor) reaches the graph only through AOTAutograd's wrapper, which
    # unwraps it: its metadata does not always say so (torch 2.11 hands the compilers the unwrapped graph's, and a
    # DTensor passed straight to the C++ graph crashed its first oneDNN call).
    plain = not any(isinstance(x, torch.Tensor) and type(x) not in (torch.Tensor, torch.nn.Parameter)
                    for x in example_inputs)

    def compiler(kind):
        def compile_one(g, inputs):
            compiled = compile_fx_graph(g, config, kind, lowered=lowered)
            if kind == "inference":
                inference.append((compiled, plain and _wrapper_would_do_nothing(compiled), _pinned_inputs(g, kind),
                                  _inference_facts()))
            elif kind == "forward":
                training.append((kind, compiled, _forward_facts(g, compiled) if plain else None))
            else:
                training.append((kind, compiled, _backward_facts(g)))
            return compiled

        return compile_one

    backend = _aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=decomposition_table(),
        keep_inference_input_mutations=True,
    )
    if any(n.target is torch._C._nn.scaled_dot_product_attention for n in gm.graph.nodes):
        from . import report
        from .attention import simplify_masks

        report.record_masks(*simplify_masks(gm))  # constant masks that mask nothing, or are causal (attention.py)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None and any(n.target is flex for n in gm.graph.nodes):
        from .attention import densify_flex_attention

        densify_flex_attention(gm)  # flex_attention as ATen ops AOTAutograd traces (see attention.py)
    if ember_config.fused_attention and any(getattr(x, "is_cuda", False) for x in example_inputs):
        from .attention import route_attention

        if route_attention(gm) and config.autotune:  # CUDA attention to cuDNN's, flash or memory-efficient kernel
            from .attention_tuning import tune_attention

            tune_attention(gm, config.autotune_budget_s)  # each call's fastest kernel, timed (attention_tuning.py)
    if ember_config.conv_channels_last:
        from .layout import (channels_last_convolutions, direct_eval_batch_norms, global_pools_as_means,
                             pays_in_cpu_training)

        global_pools_as_means(gm)  # no as_strided_ restride after a 1x1 average pool (see layout.py)
        needs_grad = torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in example_inputs)
        if any(getattr(x, "is_cuda", False) for x in example_inputs):
            # cuDNN's NHWC convolutions without per-call conversions, then symbolic eval batch norms traced without
            # the copy ATen's cuDNN route adds (see layout.py)
            if channels_last_convolutions(gm) and not needs_grad:
                direct_eval_batch_norms(gm)
        else:
            if not needs_grad or pays_in_cpu_training(gm):
                channels_last_convolutions(gm, force=True, weights=False)  # oneDNN's, NCHW weights (see layout.py)
    stored = {}  # what the DirectCall returned is built from: the compile cache's entry
    direct = _traced_call(gm, example_inputs, config, stored) if direct_ok else None
    if direct is None and direct_ok:
        direct = _joint_traced_call(gm, example_inputs, config, stored)
    if direct is not None:
        if key is not None and cache.shape_state(gm, example_inputs) == assumed:  # symbolic sizes: no guard added
            cache.store(key, stored)
        if built is not None:
            built.update(stored)
        return direct
    if ember_config.direct_call and hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):
        # The backward compiles with the forward (AOTAutograd would wait for the first backward), so that a
        # training graph's forward and backward can become one C++ autograd function (_training_call).
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            compiled_fn = backend(gm, example_inputs)
    else:
        compiled_fn = backend(gm, example_inputs)
    if not direct_ok:
        return compiled_fn
    stored = {}
    direct = _direct_call(gm, example_inputs, inference[0] if len(inference) == 1 else None, stored)
    if direct is None:
        direct = _training_call(gm, example_inputs, training, stored)
    if direct is None:
        return compiled_fn
    # Symbolic sizes: stored where the compile added no guard on them (a hit would not add it again).
    whole = len(lowered) == (1 if stored["kind"] == "inference" else 2)
    if whole and cache.shape_state(gm, example_inputs) == assumed:
        cache.store(key, dict(stored, graphs=lowered))
    if whole and built is not None:
        built.update(stored, graphs=lowered)
    return direct


def _first_call_is_fake():
    """Whether the graph being compiled will first be called on fake tensors (DDPOptimizer's pieces)."""
    import torch._guards

    context = torch._guards.TracingContext.try_get()
    return bool(getattr(context, "fakify_first_call", False))


def _aot_autograd(**kwargs):
    """A backend that hands the graph to AOTAutograd with these compilers, as torch._dynamo.backends.common's
    aot_autograd does, without importing what that wrapper imports for its logging switch: torch._inductor.debug,
    and through it Inductor's scheduler and IR. The import took 62 ms, and with those modules loaded Dynamo and
    AOTAutograd ran slower as well: a fresh process's MLP training first call was 0.59-0.62 s against 0.39-0.42 s
    without them (2-core host). Under TORCH_COMPILE_DEBUG=1, whose logs that switch writes, the wrapper runs."""
    if os.environ.get("TORCH_COMPILE_DEBUG", "0") == "1":
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(**kwargs)

    def backend(gm, example_inputs):
        from torch._dynamo import disable
        from torch._dynamo.utils import counters, flatten_graph_inputs
        from torch._functorch.aot_autograd import aot_module_simplified

        if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
            return flatten_graph_inputs(gm, example_inputs, backend)  # AOTAutograd takes tensors and scalars
        backward = kwargs["bw_compiler"]

        def bw_compiler(*args, **kw):  # Dynamo traces neither the compiler nor the backward it returns
            return disable(disable(backward)(*args, **kw))

        counters["aot_autograd"]["total"] += 1
        compiled = aot_module_simplified(gm, example_inputs, **{**kwargs, "bw_compiler": bw_compiler})
        counters["aot_autograd"]["ok"] += 1
        return disable(compiled)

    return backend


def _warm_up_if_cuda_in_use():
    """torch.compile(..., backend="ember") imports this module (the entry point) before the first call is
    traced. Where the process already uses CUDA, NVRTC's first use starts now, on a thread of its own, and
    overlaps Dynamo's tracing instead of only ember's (_compile_graph starts it on a compile cache miss
    otherwise). Not where the compile cache holds entries: a restarted process then mostly hits and needs no
    NVRTC, so the warm-up's loading and compiling would only compete with Dynamo's tracing for the host."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        from . import _C, cache

        if not cache.holds_entries():
            _C.warm_up_cuda_compiler()


_warm_up_if_cuda_in_use()
_hold_full_collections_in_dynamo()
