"""FX -> ember IR text, in one pass over the nodes of an AOTAutograd graph.

Every node becomes one IR line (getitem on a multi-output op becomes a reference to that op's output).
Control flow (torch.ops.higher_order.cond, while_loop, scan, map_impl) becomes an ember::cond / ember::while_loop /
ember::scan line naming its subgraphs, which the caller lowers and compiles first (lower_graph returns them;
backend/runtime/control_flow.cpp runs them); invoke_subgraph calls (torch.compiler.nested_compile_region) are
inlined beforehand (inline_invoke_subgraphs).
Every argument kind FX produces has a spelling in the IR text: value references, None, bools, ints,
floats, strings, dtypes, devices, layouts, memory formats and lists of these. Anything else is an
EmberError naming the node, so the caller can fall back instead of crashing.
"""

import math
import operator

import torch
import torch.fx

from .errors import EmberError

_DTYPES = {
    torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.float16: "f16", torch.float32: "f32", torch.float64: "f64", torch.complex32: "c32",
    torch.complex64: "c64", torch.complex128: "c128", torch.bool: "b8", torch.bfloat16: "bf16",
    torch.uint16: "u16", torch.uint32: "u32", torch.uint64: "u64",
    torch.float8_e4m3fn: "f8e4m3fn", torch.float8_e5m2: "f8e5m2",
}
_LAYOUTS = {
    torch.strided: "strided", torch.sparse_coo: "sparse_coo", torch.sparse_csr: "sparse_csr",
    torch.sparse_csc: "sparse_csc", torch.sparse_bsr: "sparse_bsr", torch.sparse_bsc: "sparse_bsc",
    torch._mkldnn: "_mkldnn", torch.jagged: "jagged",
}
_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous_format", torch.preserve_format: "preserve_format",
    torch.channels_last: "channels_last", torch.channels_last_3d: "channels_last_3d",
}
# AOTAutograd's wrapper of an op with side effects (lowered by _Lowering.with_effects).
_WITH_EFFECTS = getattr(torch.ops.higher_order, "with_effects", None)
# Python-level functions that appear in graphs over SymInts, and the prim ops that run them in C++.
_PRIMS = {
    operator.add: "prim::add", operator.sub: "prim::sub", operator.mul: "prim::mul",
    operator.floordiv: "prim::floordiv", operator.mod: "prim::mod", operator.truediv: "prim::truediv",
    operator.neg: "prim::neg", operator.pow: "prim::pow", operator.eq: "prim::eq", operator.ne: "prim::ne",
    operator.lt: "prim::lt", operator.le: "prim::le", operator.gt: "prim::gt", operator.ge: "prim::ge",
    torch.sym_float: "prim::sym_float", torch.sym_int: "prim::sym_int", torch.sym_max: "prim::sym_max",
    torch.sym_min: "prim::sym_min", torch.sym_not: "prim::sym_not",
    math.ceil: "prim::ceil", math.floor: "prim::floor", math.trunc: "prim::sym_int", round: "prim::round",
    int: "prim::sym_int", float: "prim::sym_float", abs: "prim::abs",
}


def op_name(target):
    """'aten::add.Tensor' for torch.ops.aten.add.Tensor; the default overload has no suffix."""
    schema = target._schema
    return schema.name + ("." + schema.overload_name if schema.overload_name else "")


def dim_text(d):
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        if getattr(expr, "is_number", False):
            return str(int(expr))
        return str(expr).replace(" ", "")
    return str(int(d))


def is_opaque_object(val):
    """Whether `val` is an opaque object (IR type `object`, ember/ir.h): a torchbind object, real or as AOTAutograd's
    FakeScriptObject, or an instance of a type registered with torch._library.opaque_object (DeviceMesh and
    ProcessGroup). DTensor flattens to its local tensor and its DeviceMesh, so tensor-parallel graphs take meshes
    as inputs and return them beside their DTensor results (and gradients)."""
    from torch._library.fake_class_registry import FakeScriptObject

    if isinstance(val, (FakeScriptObject, torch.ScriptObject)):
        return True
    opaque = getattr(torch._library, "opaque_object", None)
    return opaque is not None and hasattr(opaque, "is_opaque_value") and opaque.is_opaque_value(val)


def type_text(val):
    if isinstance(val, torch.Tensor):
        if val.layout != torch.strided:
            raise EmberError(f"tensors of layout {val.layout} are not supported")
        dtype = _DTYPES.get(val.dtype)
        if dtype is None:
            raise EmberError(f"dtype {val.dtype} is not supported")
        sizes = ", ".join(dim_text(s) for s in val.shape)
        strides = ", ".join(dim_text(s) for s in val.stride())
        return f"{dtype}[{sizes}]{{{strides}}}@{val.device}"
    if isinstance(val, (bool, torch.SymBool)):
        return "bool"
    if isinstance(val, (int, torch.SymInt)):
        return "int"
    if isinstance(val, (float, torch.SymFloat)):
        return "float"
    if val is None:
        return "none"
    if is_opaque_object(val):
        return "object"
    raise EmberError(f"values of type {type(val).__name__} are not supported")


def float_text(x):
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    r = repr(x)
    return r if any(c in r for c in ".e") else r + ".0"


def string_text(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _higher_order(name):
    return getattr(torch.ops.higher_order, name, None)


def _attribute(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def inline_invoke_subgraphs(gm):
    """A GraphModule computing what `gm` computes with every invoke_subgraph call (a region marked with
    torch.compiler.nested_compile_region) replaced by the subgraph's own nodes, nested calls too; `gm`
    itself where there is none. `gm` is left as it was."""
    invoke = _higher_order("invoke_subgraph")
    if invoke is None or not any(n.op == "call_function" and n.target is invoke for n in gm.graph.nodes):
        return gm
    graph = torch.fx.Graph()
    attributes = {}  # new attribute name -> object, for get_attr nodes copied out of subgraphs
    env = {}

    def copy_nodes(module, nodes, env, inputs):
        """Copies `module`'s nodes into `graph` (placeholders bound to `inputs`); returns its output args."""
        placeholders = iter(inputs or ())
        for node in nodes:
            if node.op == "placeholder" and inputs is not None:
                env[node] = next(placeholders)
            elif node.op == "output" and inputs is not None:
                return torch.fx.node.map_arg(node.args[0], lambda n: env[n])
            elif node.op == "get_attr":
                name = node.target if module is gm else f"_inlined_{len(attributes)}_{node.target.replace('.', '_')}"
                attributes[name] = _attribute(module, node.target)
                env[node] = graph.get_attr(name)
                env[node].meta = dict(node.meta)
            elif node.op == "call_function" and node.target is invoke:
                sub = node.args[0]
                if not (isinstance(sub, torch.fx.Node) and sub.op == "get_attr"):
                    raise EmberError(f"node {node.name}: invoke_subgraph of something other than an attribute")
                body = _attribute(module, sub.target)
                operands = [torch.fx.node.map_arg(a, lambda n: env[n]) for a in node.args[2:]]
                env[node] = ("inlined", copy_nodes(body, body.graph.nodes, {}, operands))
            elif node.op == "call_function" and node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
                results = env[node.args[0]][1]
                env[node] = results[node.args[1]]
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        return None

    copy_nodes(gm, gm.graph.nodes, env, None)
    for node in graph.nodes:  # the subgraphs' own get_attr nodes, now unread
        if node.op == "get_attr" and not node.users and isinstance(attributes.get(node.target), torch.fx.GraphModule):
            graph.erase_node(node)
    # A dict root: GraphModule takes from it just the attributes the graph's get_attr nodes read.
    inlined = torch.fx.GraphModule(attributes, graph, class_name=type(gm).__name__)
    inlined.meta = dict(getattr(gm, "meta", {}))
    return inlined


# Control flow ops (torch.ops.higher_order) lowered here; map_impl (torch._higher_order_ops.map) is a scan
# without carries.
_CONTROL_FLOW = ("cond", "while_loop", "scan", "map_impl")


class _Lowering:
    def __init__(self, gm, constant_prefix=""):
        self.gm = gm
        self.constant_prefix = constant_prefix  # before constant names: a package's subgraph path and '/'
        self.names = {}  # fx.Node -> IR value name, or list of names for multi-output nodes
        self.lines = []
        self.constants = {}
        self.inputs = []
        self.subgraphs = {}  # attribute name -> GraphModule, for the control flow nodes' subgraphs
        self.subgraph_nodes = {}  # get_attr fx.Node -> attribute name
        self.control_flow = {}
        for name in _CONTROL_FLOW:
            op = _higher_order(name)
            if op is not None:
                self.control_flow[op] = name

    def value(self, node, where):
        name = self.names.get(node)
        if name is None:
            raise EmberError(f"node {where.name}: argument {node.name} has no single value")
        if isinstance(name, list):
            raise EmberError(f"node {where.name}: uses all outputs of {node.name} at once")
        return "%" + name

    def literal(self, x, node):
        if isinstance(x, torch.fx.Node):
            return self.value(x, node)
        if x is None:
            return "None"
        if isinstance(x, bool):
            return "true" if x else "false"
        if isinstance(x, int):
            return str(x)
        if isinstance(x, float):
            return float_text(x)
        if isinstance(x, str):
            return string_text(x)
        if isinstance(x, torch.dtype):
            if x not in _DTYPES:
                raise EmberError(f"node {node.name}: dtype {x} is not supported")
            return _DTYPES[x]
        if isinstance(x, torch.device):
            return str(x)
        if isinstance(x, torch.layout):
            return _LAYOUTS[x]
        if isinstance(x, torch.memory_format):
            return _MEMORY_FORMATS[x]
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(self.literal(i, node) for i in x) + "]"
        if isinstance(x, complex):
            return self.complex_constant(x, node)
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) and x.node.is_constant():
            return self.literal(x.node.maybe_as_int() if isinstance(x, torch.SymInt) else x.node.constant, node)
        raise EmberError(
            f"node {node.name} ({node.target}): argument of unsupported kind {type(x).__name__}")

    def complex_constant(self, x, node):
        """A complex Python number (torch.polar's backward multiplies by 1j) as a 0-dim constant tensor of the
        node's complex dtype on its device: the IR has no complex literal, and a 0-dim tensor of the result's
        dtype promotes as the scalar would. Only Tensor arguments take it (aten() switches a .Scalar overload
        to its .Tensor twin first)."""
        val = self.val_of(node)
        val = val[0] if isinstance(val, (list, tuple)) and val else val
        dtype = val.dtype if isinstance(val, torch.Tensor) and val.is_complex() else torch.complex64
        device = val.device if isinstance(val, torch.Tensor) else torch.device("cpu")
        name = f"{node.name}_complex{sum(1 for k in self.constants if k.startswith(node.name + '_complex'))}"
        key = self.constant_prefix + name
        self.constants[key] = torch.tensor(x, dtype=dtype, device=device)
        self.lines.append(f"  {self.decl(name, self.constants[key])} = prim::constant({string_text(key)})")
        return "%" + name

    def val_of(self, node):
        if "val" in node.meta:
            return node.meta["val"]
        if "example_value" in node.meta:
            return node.meta["example_value"]
        raise EmberError(f"node {node.name} ({node.target}) has no shape metadata")

    def decl(self, name, val):
        return f"%{name}: {type_text(val)}"

    def placeholder(self, node):
        self.names[node] = node.name
        self.inputs.append(self.decl(node.name, self.val_of(node)))

    def get_attr(self, node):
        obj = _attribute(self.gm, node.target)
        if isinstance(obj, torch.fx.GraphModule):
            self.subgraph_nodes[node] = node.target  # a control flow node's subgraph: no IR line of its own
            return
        if not isinstance(obj, torch.Tensor):
            raise EmberError(f"node {node.name}: attribute {node.target} is a {type(obj).__name__}, not a tensor")
        key = self.constant_prefix + node.target
        self.constants[key] = obj
        self.names[node] = node.name
        self.lines.append(f"  {self.decl(node.name, obj)} = prim::constant({string_text(key)})")

    def call_args(self, node):
        parts = [self.literal(a, node) for a in node.args]
        parts += [f"{k}={self.literal(v, node)}" for k, v in node.kwargs.items()]
        return ", ".join(parts)

    def call_function(self, node):
        target = node.target
        if target is operator.getitem:
            return self.getitem(node)
        if isinstance(target, torch._ops.OpOverload):
            return self.aten(node)
        if target is getattr(torch, "sym_sum", None):
            return self.sym_sum(node)
        if target in self.control_flow:
            return self.control_flow_call(node, self.control_flow[target])
        if target is _WITH_EFFECTS:
            return self.with_effects(node)
        if target in _PRIMS:
            args = node.args
            if target is round:
                if len(args) > 1 and args[1] is not None:
                    raise EmberError(f"node {node.name}: round() with ndigits is not supported")
                args = args[:1]
            self.names[node] = node.name
            call = ", ".join(self.literal(a, node) for a in args)
            line = f"  {self.decl(node.name, self.val_of(node))} = {_PRIMS[target]}({call})"
            self.lines.append(line)
            return
        raise EmberError(f"node {node.name}: unsupported call target {getattr(target, '__name__', target)}")

    def sym_sum(self, node):
        """torch.sym_sum([a, b, ...]) (Hugging Face's cache lengths under dynamic shapes): a chain of prim::add."""
        (terms,) = node.args
        terms = list(terms) + [0] * max(0, 2 - len(terms))
        val = self.val_of(node)
        total = self.literal(terms[0], node)
        for i, term in enumerate(terms[1:], start=1):
            name = node.name if i == len(terms) - 1 else f"{node.name}_part{i}"
            self.lines.append(f"  {self.decl(name, val)} = prim::add({total}, {self.literal(term, node)})")
            total = "%" + name
        self.names[node] = node.name

    def subgraph(self, arg, node):
        if arg not in self.subgraph_nodes:
            raise EmberError(f"node {node.name}: a subgraph argument that is not a graph attribute")
        name = self.subgraph_nodes[arg]
        self.subgraphs[name] = _attribute(self.gm, name)
        return string_text(name)

    def control_flow_call(self, node, kind):
        """ember::cond(pred, "true", "false", [operands]); ember::while_loop("cond", "body", [carried],
        [additional]); ember::scan("combine", [init], [xs], [additional]); map as ember::scan("body", [], [xs],
        [additional])."""
        args = node.args
        if kind == "cond":
            pred, true_graph, false_graph, operands = args
            parts = [self.literal(pred, node), self.subgraph(true_graph, node), self.subgraph(false_graph, node),
                     self.literal(list(operands), node)]
        elif kind == "while_loop":
            if node.kwargs.get("mutated_arg_indices") or len(args) != 4:
                raise EmberError(f"node {node.name}: a while_loop that writes its inputs is not supported")
            cond_graph, body_graph, carried, additional = args
            parts = [self.subgraph(cond_graph, node), self.subgraph(body_graph, node),
                     self.literal(list(carried), node), self.literal(list(additional), node)]
        elif kind == "map_impl":
            if node.kwargs or len(args) != 3:
                raise EmberError(f"node {node.name}: map with arguments {list(node.kwargs)} is not supported")
            body, xs, additional = args
            kind = "scan"
            parts = [self.subgraph(body, node), "[]", self.literal(list(xs), node), self.literal(list(additional), node)]
        else:
            if node.kwargs or len(args) != 4:
                raise EmberError(f"node {node.name}: scan with arguments {list(node.kwargs)} is not supported")
            combine, init, xs, additional = args
            parts = [self.subgraph(combine, node), self.literal(list(init), node), self.literal(list(xs), node),
                     self.literal(list(additional), node)]
        vals = self.val_of(node)
        vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
        self.declare_outputs(node, vals, f"ember::{kind}({', '.join(parts)})")

    def declare_outputs(self, node, vals, call, first=0):
        """One line defining a value per output, named after the getitem that reads it, if any; the node's
        getitem i reads output i - first (with_effects: its item 0 is the token)."""
        names = [f"{node.name}_{i}" for i in range(first, first + len(vals))]
        for user in node.users:
            if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
                if 0 <= user.args[1] - first < len(names):
                    names[user.args[1] - first] = user.name
        self.names[node] = names
        decls = ", ".join(self.decl(n, v) for n, v in zip(names, vals))
        self.lines.append(f"  {decls} = {call}")

    def tensor_twin(self, node):
        """For an op given a complex number in a Scalar argument: the overload taking a Tensor there with the
        same argument names (aten.mul.Scalar -> aten.mul.Tensor), else the op itself."""
        schema = node.target._schema
        scalar_slots = [i for i, (a, arg) in enumerate(zip(node.args, schema.arguments))
                        if isinstance(a, complex) and isinstance(arg.type, torch.NumberType)]
        if not scalar_slots:
            return node.target
        packet = node.target.overloadpacket
        twin = getattr(packet, "Tensor", None)
        if twin is None or [a.name for a in twin._schema.arguments] != [a.name for a in schema.arguments]:
            raise EmberError(f"node {node.name} ({node.target}): a complex Scalar argument, and no Tensor overload")
        return twin

    def aten(self, node):
        target = self.tensor_twin(node) if any(isinstance(a, complex) for a in node.args) else node.target
        returns = target._schema.returns
        name = op_name(target)
        call = f"{name}({self.call_args(node)})"
        if not returns:
            self.names[node] = node.name
            self.lines.append(f"  {call}")
            return
        val = self.val_of(node)
        single_list = len(returns) == 1 and isinstance(returns[0].type, torch.ListType)
        if len(returns) == 1 and not single_list:
            self.names[node] = node.name
            self.lines.append(f"  {self.decl(node.name, val)} = {call}")
            return
        # Several outputs (or one list): name each after the getitem that reads it, if any.
        self.declare_outputs(node, list(val), call)

    def with_effects(self, node):
        """with_effects(token, op, *args): AOTAutograd threads a token through an op with side effects (linalg's
        _linalg_check_errors, which raises for a singular matrix) to keep it in order. The op is a call where the
        node stands (ember's steps keep their order, and a call without results is never dropped); the token
        passes through, as nothing but the graph's outputs reads it."""
        token, op, *args = node.args
        if not isinstance(op, torch._ops.OpOverload) or token not in self.names:
            raise EmberError(f"node {node.name}: with_effects of {op} over token {token} is not supported")
        parts = [self.literal(a, node) for a in args] + [f"{k}={self.literal(v, node)}" for k, v in node.kwargs.items()]
        call = f"{op_name(op)}({', '.join(parts)})"
        if not op._schema.returns:
            self.names[node] = [self.names[token]]
            self.lines.append(f"  {call}")
            return
        self.declare_outputs(node, list(self.val_of(node))[1:], call, first=1)  # val: (token, *the op's results)
        self.names[node] = [self.names[token], *self.names[node]]

    def getitem(self, node):
        source, index = node.args
        names = self.names.get(source)
        if not isinstance(names, list) or not isinstance(index, int):
            raise EmberError(f"node {node.name}: getitem on {source} is not supported")
        self.names[node] = names[index]

    def output(self, node):
        (outs,) = node.args
        if not isinstance(outs, (list, tuple)):
            outs = (outs,)
        parts = [self.literal(o, node) for o in outs]
        self.lines.append("  return (" + ", ".join(parts) + ")")

    def run(self):
        for node in self.gm.graph.nodes:
            handler = getattr(self, node.op, None)
            if handler is None:
                raise EmberError(f"node {node.name}: FX op kind {node.op} is not supported")
            handler(node)
        header = "graph(" + ", ".join(self.inputs) + "):"
        return "\n".join([header, *self.lines]) + "\n", self.constants


def lower_graph(gm):
    """Returns (IR text, {constant name: tensor}, {subgraph name: GraphModule}) for an AOTAutograd FX graph
    module: the subgraphs its control flow nodes name, each to be lowered and compiled before it."""
    lowering = _Lowering(gm)
    ir, constants = lowering.run()
    return ir, constants, lowering.subgraphs


def lower(gm):
    """Returns (IR text, {constant name: tensor}) for an AOTAutograd FX graph module without control flow."""
    ir, constants, subgraphs = lower_graph(gm)
    if subgraphs:
        raise EmberError(f"the graph has control flow over subgraphs {sorted(subgraphs)}: use lower_graph")
    return ir, constants
