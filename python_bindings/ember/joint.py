"""Training graphs traced call by call, without AOTAutograd.

For a graph that needs gradients AOTAutograd runs the Dynamo graph on fake tensors to collect its runtime
metadata, then traces the joint forward and backward of the whole graph through the autograd engine, and
its partitioner splits that. BERT-base training's Dynamo graph cost 1.13-1.27 s of joint trace and 0.21-0.23 s
of metadata so (2-core host), a fifth of the step's first call, its 12 identical layers traced twelve times.

Here each distinct call (trace.py's key, plus which of its inputs need a gradient and which of its outputs
get one) is traced once with its own backward: make_fx over the call followed by `torch.autograd.grad` of
its outputs, with ember's decompositions, on fresh fake inputs. The joint graph is built from copies of
those traces: each call's forward part (what was traced before the gradients were asked for) where the call
stands, then, after the last call, each call's backward part in reverse order, fed the sum of the gradients
its outputs received (summed as they arrive, as the autograd engine does). A backward part is first traced
for gradients laid out as Dynamo's value of the output (or contiguously where that overlaps itself) and
for the outputs Dynamo's values say get one; where the gradients that arrive differ (a transpose's), the
call is traced again for them, its forward part then mapped op by op onto the copy already made (if it
traced to other ops, AOTAutograd takes the graph). The split is AOTAutograd's default partition's: the
forward keeps what the forward parts traced and returns, after the user outputs, what the backward reads
of it. BERT-base training gives the same IR as through AOTAutograd, and its first call on the 2-core host
took 5.02-5.03 s against 6.34-6.74 (backend 0.47-0.53 s against 1.81-2.03); an MLP step's backend 0.14 ->
0.10 s; a single transformer layer, 25 distinct calls, as fast either way.

Only graphs whose AOTAutograd wrapper would add nothing but its autograd function come here (the C++
TrainingGraph stands in for that, python_bindings/training_graph.h): plain tensor inputs that share no
memory, static shapes and no symbolic values, no autocast, no call that writes memory or global state (in
place, `out=`, grad mode, the RNG seed; a training batch norm's statistics are found in its trace), no
higher-order ops, outputs that are fresh tensors (not inputs, not views, each once), no saved-tensor hooks
or compiled autograd. Anything else, or anything unforeseen while tracing, goes to AOTAutograd, as does
every graph with ember.config.trace_by_node, direct_trace or direct_call False, or under TORCH_COMPILE_DEBUG=1
(whose output holds AOTAutograd's graphs).
"""

import os

from . import config
from .trace import (
    _NotByNode,
    _arg_key,
    _fresh_like,
    _lazy_graph_modules,
    _map_args,
    _pinned,
    _resolved_call,
    _returns_alias,
    _stateful,
    _symbolic,
    _tensor_key,
    _tensor_nodes,
)


def trace_training(gm, example_inputs, decompositions):
    """(forward graph module, backward graph module, TrainingGraph arguments, pinned inputs) for a training
    graph traced call by call, or (None, None, why not, None)."""
    for name in ("direct_trace", "direct_call", "trace_by_node"):
        if getattr(config, name) is False:
            return None, None, f"{name} off", None
    if os.environ.get("TORCH_COMPILE_DEBUG") == "1":  # torch's own variable: its debug output holds AOTAutograd's graphs
        return None, None, "TORCH_COMPILE_DEBUG=1", None
    import torch
    from torch._guards import detect_fake_mode
    from torch.multiprocessing.reductions import StorageWeakRef

    why = _training_inputs(gm, example_inputs)
    if why:
        return None, None, why, None
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        return None, None, "no fake mode", None
    fakes = [fake_mode.from_tensor(x) for x in example_inputs]
    if _symbolic(fakes):
        return None, None, "dynamic shapes", None
    if len({StorageWeakRef(f.untyped_storage()) for f in fakes}) != len(fakes):
        return None, None, "two inputs share memory", None
    requires_grad = [bool(x.requires_grad) for x in example_inputs]
    try:
        with _lazy_graph_modules():
            forward, backward, spec = _JointBuilder(gm, fakes, requires_grad, decompositions, fake_mode).build()
    except _NotByNode as e:
        return None, None, str(e), None
    except Exception as e:  # anything unforeseen: AOTAutograd traces the graph, and copes or reports it
        return None, None, f"{type(e).__name__}: {e}", None
    spec["no_edge"] = [r and not x.is_leaf and none for r, x, none in zip(requires_grad, example_inputs, spec.pop("none"))]
    spec["deterministic"] = int(torch.are_deterministic_algorithms_enabled())
    return forward, backward, spec, _pinned(gm)


def _training_inputs(gm, example_inputs):
    """Why the graph or the state around it rules a call-by-call training trace out, or None."""
    import torch

    if not torch.is_grad_enabled() or not any(getattr(x, "requires_grad", False) for x in example_inputs):
        return "nothing needs a gradient"
    if any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in example_inputs):
        return "an input is not a plain tensor"
    if torch._C._is_any_autocast_enabled():
        return "autocast is on"
    if next(gm.parameters(), None) is not None or next(gm.buffers(), None) is not None:
        return "the graph module holds parameters"
    try:
        from torch._functorch._aot_autograd.runtime_wrappers import _should_disable_saved_tensors_hooks

        if _should_disable_saved_tensors_hooks():
            return "saved-tensor hooks are inlined"
        if torch._dynamo.compiled_autograd.in_compiled_autograd_region or torch._dynamo.config.compiled_autograd:
            return "compiled autograd"
    except (ImportError, AttributeError):
        return "this torch's AOTAutograd reads differently"
    if getattr(torch._functorch.config, "functionalize_rng_ops", False):
        return "functionalized RNG"
    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module"):
            return f"the graph has a {n.op} node"
        value = n.meta.get("example_value")
        if isinstance(value, symbolic) or isinstance(value, torch.Tensor) and any(
                isinstance(d, symbolic) for d in (*value.shape, *value.stride())):
            return f"{n.name} has a symbolic value"
        if n.op == "call_function" and isinstance(n.target, torch._ops.HigherOrderOperator):
            return f"the graph calls {n.target}"
        if n.op in ("call_function", "call_method") and _stateful(n):
            return f"{n.name} writes memory or global state"
    return None


def _tensor_leaves(value):
    import torch
    import torch.utils._pytree as pytree

    return [x for x in pytree.tree_leaves(value) if isinstance(x, (torch.Tensor, torch.fx.Node))]


def _expected_gradients(gm):
    """{Dynamo node: [whether a gradient is expected, per tensor in its value]}: tensors that need a gradient
    and reach an output that needs one (Dynamo's values say which need one)."""
    import operator

    import torch

    def needing(node):
        value = node.meta.get("example_value")
        return [bool(t.requires_grad) for t in _tensor_leaves(value)]

    expected = {}
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op in ("placeholder", "call_function", "call_method"):
            expected[n] = [False] * len(needing(n))
    output = nodes[-1]
    for o in _tensor_nodes(output.args, []):
        expected[o] = needing(o)
    for n in reversed(nodes):
        if n.op not in ("call_function", "call_method") or not any(expected.get(n, ())):
            continue
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and isinstance(n.args[1], int):
            source = n.args[0]
            value = source.meta.get("example_value")
            if isinstance(value, (list, tuple)):
                flags = expected[source]
                position = sum(len(_tensor_leaves(v)) for v in value[: n.args[1]])
                for i in range(len(_tensor_leaves(value[n.args[1]]))):
                    flags[position + i] = flags[position + i] or needing(source)[position + i]
                continue
        for t in _tensor_nodes((n.args, n.kwargs), []):
            if t in expected:
                expected[t] = [a or b for a, b in zip(expected[t], needing(t))] if expected[t] else []
    return expected


def _gradient_layout(t):
    """The fake gradient a backward part is first traced for, for an output `t`: its sizes and strides, or
    contiguous in its memory format where it overlaps itself (an expand's result), as AOTAutograd lays out
    tangents."""
    import torch

    if torch._debug_has_internal_overlap(t) == 1:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device,
                           memory_format=torch._prims_common.suggest_memory_format(t))
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


class _Trace:
    """One call traced with its backward: the graph, its forward nodes in order (those traced before the
    gradients were asked for), and whether each output tensor needs a gradient."""

    def __init__(self, traced, forward_nodes, outputs_need_grad):
        self.traced = traced
        self.forward_nodes = forward_nodes
        self.outputs_need_grad = outputs_need_grad
        self.placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        self.output = traced.graph.output_node().args[0]  # (the call's result, the inputs' gradients)


def _trace_joint(call, tensors, needs_grad, expected, layouts, decompositions, fake_mode):
    """`call` (op kind, target, (args, kwargs)) traced on fresh fake inputs (`needs_grad`: which need a
    gradient), followed by the gradients of those inputs given gradients for the output tensors `expected`
    marks, laid out as the fakes `layouts`."""
    import torch
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

    op, target, args = call
    seen = {}

    def joint(*values):
        inputs, gradients = values[: len(tensors)], values[len(tensors):]
        value_of = dict(zip(tensors, inputs))
        positional, keywords = _map_args(args, value_of.__getitem__)
        if op == "call_method":
            out = getattr(positional[0], target)(*positional[1:], **keywords)
        else:
            out = target(*positional, **keywords)
        leaves = _tensor_leaves(out)
        seen["need"] = [bool(t.requires_grad) for t in leaves]
        traced_so_far = list(get_proxy_mode().tracer.graph.nodes)  # the forward part ends here
        seen["last"] = traced_so_far[-1].name if traced_so_far else None  # (None: a call of no tensors)
        wanted, given, supplied = [], [], iter(gradients)
        for t, e in zip(leaves, expected):
            g = next(supplied) if e else None
            if e and t.requires_grad:  # (Dynamo's values may expect a gradient where none can flow)
                wanted.append(t)
                given.append(g)
        sources = [t for t, n in zip(inputs, needs_grad) if n]
        grads = list(torch.autograd.grad(wanted, sources, given, allow_unused=True)) if wanted and sources else []
        return out, grads

    with fake_mode, enable_python_dispatcher(), torch.enable_grad():
        fresh = [_fresh_like(t.meta["val"]).requires_grad_(n) for t, n in zip(tensors, needs_grad)]
        gradients = [torch.empty_strided(g.shape, g.stride(), dtype=g.dtype, device=g.device) for g in layouts]
        try:
            traced = make_fx(joint, decomposition_table=decompositions)(*fresh, *gradients)
        except Exception as e:
            raise _NotByNode(f"{target}: {type(e).__name__}: {e}") from e
    forward_nodes, ended = [], seen["last"] is None
    for n in traced.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            raise _NotByNode(f"{target} traces to a write ({n.target})")
        if n.op in ("call_module", "call_method"):
            raise _NotByNode(f"{target} traced to a {n.op}")
        if not ended and n.op not in ("placeholder", "output"):
            forward_nodes.append(n)
        ended = ended or n.name == seen["last"]
    return _Trace(traced, forward_nodes, seen["need"])


class _JointBuilder:
    """The forward and backward graphs of a Dynamo training graph, built from per-call traces."""

    def __init__(self, gm, fakes, requires_grad, decompositions, fake_mode):
        import torch
        import torch.fx

        self.gm, self.fakes, self.requires_grad = gm, fakes, requires_grad
        self.decompositions, self.fake_mode = decompositions, fake_mode
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.traces = {}  # (call key, expected gradients, their layouts) -> _Trace
        self.constants = {}  # (traced module, attribute) -> name on root
        self.needs_grad = {}  # joint node -> whether its value needs a gradient
        self.gradients = {}  # joint node -> the sum of the gradients it received so far (a joint node)
        self.backward_nodes = set()
        self.tangent_layouts = []  # per tangent: TangentLayout's (memory format or -1, sizes, strides)

    def build(self):
        """(forward, backward, TrainingGraph arguments with "none": which inputs get no gradient)."""
        expected = _expected_gradients(self.gm)
        value, primals, calls, outputs = {}, [], [], None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                p = self.graph.placeholder(node.name)
                p.meta["val"] = self.fakes[len(primals)]
                self.needs_grad[p] = self.requires_grad[len(primals)]
                primals.append(p)
                value[node] = p
            elif node.op == "output":
                outputs = _map_args(node.args[0], value.__getitem__)
            else:
                call = self._forward(node, value, expected)
                if call is not None:
                    calls.append(call)
        user_outputs = self._user_outputs(outputs, primals)
        tangents, last = [], primals[-1]
        for o in user_outputs:
            if self.needs_grad[o]:
                with self.graph.inserting_after(last):
                    last = self.graph.placeholder(f"tangents_{len(tangents) + 1}")
                with self.fake_mode:
                    last.meta["val"], layout = _tangent(o.meta["val"])
                tangents.append(last)
                self.tangent_layouts.append(layout)
                self._received(o, last)
        for call in reversed(calls):
            self._backward(*call)
        grads = [self.gradients.get(p) if self.needs_grad[p] else None for p in primals]
        return self._partition(primals, user_outputs, tangents, grads)

    def _forward(self, node, value, expected):
        """Copies the forward part of `node`'s trace where the node stands; returns what its backward part
        needs, or None where it has none."""
        resolved = _resolved_call(node, value)
        if resolved is None:
            return None
        op, target, args, tensors, slots = resolved
        needs = tuple(self.needs_grad[t] for t in tensors)
        key = (op, target, tuple(_tensor_key(t.meta["val"]) for t in tensors), needs, _arg_key(args, slots))
        wanted = tuple(expected.get(node, ()))
        with self.fake_mode:
            layouts = [_gradient_layout(t) for t, e in zip(_tensor_leaves(node.meta.get("example_value")), wanted) if e]
        call = (op, target, args)
        trace = self._trace(key, call, tensors, needs, wanted, layouts)
        copies = dict(zip(trace.placeholders, tensors))
        for n in trace.forward_nodes:
            copies[n] = self._copy(trace, n, copies)
        try:
            result = _map_args(trace.output[0], copies.__getitem__)
        except KeyError:
            raise _NotByNode(f"{node.name}: a result was traced after its gradient was asked for") from None
        value[node] = result
        leaves = _tensor_leaves(result)
        if any(leaf in tensors for leaf in leaves):  # the call returned an input as it is (a no-op contiguous())
            if len(leaves) != 1:
                raise _NotByNode(f"{node.name} returns one of its inputs among other results")
            return None  # the same node, so its gradients are the input's: no backward of its own
        for leaf, need in zip(leaves, trace.outputs_need_grad):
            self.needs_grad[leaf] = need
        if not any(needs) or not any(trace.outputs_need_grad):
            return None
        return key, call, tensors, needs, trace, copies, leaves

    def _trace(self, key, call, tensors, needs, wanted, layouts):
        full = (key, tuple(wanted), tuple(_tensor_key(g) for g in layouts))
        trace = self.traces.get(full)
        if trace is None:
            trace = self.traces[full] = _trace_joint(call, tensors, needs, wanted, layouts, self.decompositions,
                                                     self.fake_mode)
        return trace

    def _backward(self, key, call, tensors, needs, trace, copies, leaves):
        """Copies the backward part of a call's trace after the graph so far, fed the gradients its outputs
        received, and hands the gradients it computes to its inputs."""
        received = [self.gradients.get(leaf) if self.needs_grad.get(leaf) else None for leaf in leaves]
        wanted = tuple(g is not None for g in received)
        if not any(wanted):
            return
        arrived = [g.meta["val"] for g in received if g is not None]
        planned = self.traces.get((key, wanted, tuple(_tensor_key(g) for g in arrived)))
        if planned is not trace:  # other gradients than the forward's trace was made for: trace for these
            planned = self._trace(key, call, tensors, needs, wanted, arrived)
            if [n.target for n in planned.forward_nodes] != [n.target for n in trace.forward_nodes]:
                raise _NotByNode(f"{call[1]}: its forward traced differently for other gradients")
            copies = {**dict(zip(planned.placeholders, tensors)),
                      **{n: copies[m] for n, m in zip(planned.forward_nodes, trace.forward_nodes)}}
        else:
            copies = dict(copies)
        copies.update(zip(planned.placeholders[len(tensors):], (g for g in received if g is not None)))
        forward = set(planned.forward_nodes)
        for n in planned.traced.graph.nodes:
            if n.op in ("placeholder", "output") or n in forward:
                continue
            copies[n] = self._copy(planned, n, copies)
            self.backward_nodes.add(copies[n])
        grads = iter(planned.output[1])
        for t, need in zip(tensors, needs):
            g = next(grads) if need else None
            if g is not None:
                self._received(t, copies[g])

    def _received(self, node, gradient):
        """Adds a gradient to what `node` received, where it arrives, as the autograd engine sums them (so a
        matmul's product can take the sum as its epilogue)."""
        import torch

        total = self.gradients.get(node)
        if total is not None:
            gradient_sum = self.graph.call_function(torch.ops.aten.add.Tensor, (total, gradient))
            with self.fake_mode:
                gradient_sum.meta["val"] = torch.ops.aten.add.Tensor(total.meta["val"], gradient.meta["val"])
            self.backward_nodes.add(gradient_sum)
            gradient = gradient_sum
        self.gradients[node] = gradient

    def _copy(self, trace, n, copies):
        if n.op == "get_attr":
            name = self.constants.get((trace.traced, n.target))
            if name is None:
                name = self.constants[(trace.traced, n.target)] = f"_traced_constant{len(self.constants)}"
                setattr(self.root, name, getattr(trace.traced, n.target))
            copy = self.graph.get_attr(name)
            copy.meta = dict(n.meta)
            return copy
        return self.graph.node_copy(n, copies.__getitem__)

    def _user_outputs(self, outputs, primals):
        """The graph's outputs as joint nodes, each a fresh tensor (AOTAutograd's wrapper would regenerate
        inputs and views returned, and outputs returned twice)."""
        import operator

        import torch

        flat = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        for o in flat:
            if not isinstance(o, torch.fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor):
                raise _NotByNode("an output is not a tensor")
            if o.op == "placeholder":
                raise _NotByNode("an output is an input")
            source = o.args[0] if o.target is operator.getitem else o
            if source.op == "call_function" and _returns_alias(source.target):
                raise _NotByNode("an output is a view")
        if len(set(flat)) != len(flat):
            raise _NotByNode("an output is returned twice")
        return flat

    def _partition(self, primals, user_outputs, tangents, grads):
        """Splits the joint graph as AOTAutograd's default partition does: the forward keeps every node the
        forward parts traced, returns the user outputs and then what the backward reads of it (saved); the
        backward takes the saved tensors and the tangents and returns one gradient (or None) per input."""
        import torch
        import torch.fx
        from torch.fx._lazy_graph_module import _make_graph_module

        nodes = list(self.graph.nodes)
        forward_side = [n for n in nodes if n not in self.backward_nodes and n.op != "output" and n not in tangents]
        forward_set = set(forward_side)
        saved = [n for n in forward_side if any(u in self.backward_nodes for u in n.users)]
        if any(not isinstance(s.meta.get("val"), torch.Tensor) for s in saved):
            raise _NotByNode("the backward reads a forward value that is not one tensor")
        if any(g is not None and g in forward_set for g in grads):
            raise _NotByNode("an input's gradient does not depend on the output's")
        forward, env = torch.fx.Graph(), {}
        for n in forward_side:
            env[n] = forward.node_copy(n, env.__getitem__)
        forward.output((*(env[o] for o in user_outputs), *(env[s] for s in saved)))
        backward, benv = torch.fx.Graph(), {}
        for n in (*saved, *tangents):
            benv[n] = backward.placeholder(n.name)
            benv[n].meta = dict(n.meta)
        for n in nodes:
            if n in self.backward_nodes:
                benv[n] = backward.node_copy(n, benv.__getitem__)
        backward.output([benv[g] if g is not None else None for g in grads])
        forward.eliminate_dead_code()
        backward.eliminate_dead_code()
        spec = {
            "output_requires_grad": [bool(self.needs_grad[o]) for o in user_outputs],
            "saved_checked": len(saved),
            "saved_unchecked": 0,
            "tangents": self.tangent_layouts,
            "none": [g is None for g in grads],
        }
        return _make_graph_module(self.root, forward), _make_graph_module(self.root, backward), spec


def _tangent(t):
    """(fake gradient, TangentLayout arguments) for a graph output `t`, laid out as AOTAutograd lays out its
    tangents in this torch: with the output's strides where it guesses them so
    (`guess_tangent_strides_as_outputs`) and the output does not overlap itself, else contiguous in the
    output's memory format (a gradient that arrives otherwise is copied so, python_bindings/training_graph.h).
    cuDNN's attention backward on torch 2.11 gave wrong gradients for a gradient laid out as its output where
    eager's was contiguous."""
    import torch

    from .backend import _MEMORY_FORMATS

    guess = getattr(torch._functorch.config, "guess_tangent_strides_as_outputs", False)
    if guess and torch._debug_has_internal_overlap(t) != 1:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device), (-1, list(t.shape), list(t.stride()))
    layout = torch._prims_common.suggest_memory_format(t)
    fake = torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=layout)
    return fake, (_MEMORY_FORMATS[str(layout)], [], [])
