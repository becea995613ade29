"""ember.export: a model -> one package file that C++ loads without Python (ember::load).

    ember.export(model, (x,), "model.ember", dynamic_shapes={"x": {0: torch.export.Dim("batch")}})

The flow: torch.export -> run_decompositions with ember's table -> FX to IR (lower.py, with the lifted
parameters, buffers and constants turned into graph constants) -> the same C++ compile pipeline as
torch.compile, which proves the graph compiles and collects the CUDA kernels it builds -> the package
(backend/package/format.h): IR text, weights, CUDA images, and metadata (versions, device, GPU
architecture, input/output specs with symbolic sizes and their ranges), under a checksum.

ember.load(path, device) loads a package in Python through the same C++ loader (for tests and
benchmarks; a deployed program calls ember::load).
"""

import copy
import time
import warnings

from .errors import EmberError
from .lower import _Lowering, inline_invoke_subgraphs, string_text, type_text


class _ExportLowering(_Lowering):
    """lower.py's lowering, where the placeholders torch.export lifted (parameters, buffers, tensor
    constants) become prim::constant nodes and only the user's outputs are returned."""

    def __init__(self, gm, lifted, user_outputs):
        super().__init__(gm)
        self.lifted = lifted
        self.user_outputs = user_outputs

    def placeholder(self, node):
        tensor = self.lifted.get(node.name)
        if tensor is None:
            val = self.val_of(node)
            import torch

            if not isinstance(val, torch.Tensor):
                raise EmberError(f"input {node.name} is a {type(val).__name__}; ember.export takes tensor inputs only")
            return super().placeholder(node)
        self.constants[node.name] = tensor
        self.names[node] = node.name
        self.lines.append(f"  {self.decl(node.name, tensor)} = prim::constant({string_text(node.name)})")

    def output(self, node):
        (outs,) = node.args
        outs = [outs[i] for i in self.user_outputs]
        import torch

        for o in outs:
            if not (hasattr(o, "meta") and isinstance(o.meta.get("val"), torch.Tensor)):
                raise EmberError(f"output {o} is not a tensor; ember.export returns tensors only")
        self.lines.append("  return (" + ", ".join(self.literal(o, node) for o in outs) + ")")


def _lower_subgraphs(subgraphs, prefix, constants):
    """[(path, IR text)] for the control flow subgraphs of a lowered graph and theirs (backend/package/export.h:
    a subgraph's path is its name, a nested one's its parent's path, '/', its name); their constants are added
    to `constants` under "<path>/" names."""
    lowered = []
    for name, sub in subgraphs.items():
        path = prefix + name
        lowering = _Lowering(inline_invoke_subgraphs(sub), constant_prefix=path + "/")
        ir, sub_constants = lowering.run()
        constants.update(sub_constants)
        lowered.append((path, ir))
        lowered += _lower_subgraphs(lowering.subgraphs, path + "/", constants)
    return lowered


def _device_of(example_inputs, device):
    import torch

    if device is not None:
        device = torch.device(device)
    else:
        device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _lifted_tensors(ep):
    """Placeholder name -> tensor, for every parameter, buffer and constant torch.export lifted."""
    from torch.export.graph_signature import InputKind

    lifted = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            source = ep.state_dict if spec.target in ep.state_dict else ep.constants
            lifted[spec.arg.name] = source[spec.target].detach()
        else:
            raise EmberError(f"ember.export: input {spec.arg.name} of kind {spec.kind.name} is not supported")
    return lifted


def _user_outputs(ep):
    from torch.export.graph_signature import OutputKind

    kinds = [spec.kind for spec in ep.graph_signature.output_specs]
    if any(k in (OutputKind.BUFFER_MUTATION, OutputKind.USER_INPUT_MUTATION) for k in kinds):
        warnings.warn("ember.export: the model mutates buffers or inputs; the package returns the outputs only "
                      "and does not carry the mutation", stacklevel=3)
    return [i for i, k in enumerate(kinds) if k == OutputKind.USER_OUTPUT]


def _symbol_lines(ep, user_placeholders, example_inputs):
    """"<name> <min> <max> <example>" per symbol of the inputs; max -1 when unbounded."""
    import torch

    examples = {}
    for node, x in zip(user_placeholders, example_inputs):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and getattr(size.node.expr, "is_Symbol", False):
                examples.setdefault(str(size.node.expr), int(x.shape[d]))

    def bound(v, default):
        try:
            v = int(v)
        except (TypeError, ValueError, OverflowError):
            return default
        return v if abs(v) < 2**62 else default

    lines = []
    ranges = {str(sym): vr for sym, vr in ep.range_constraints.items()}
    for name, example in examples.items():
        vr = ranges.get(name)
        lo = bound(vr.lower, 0) if vr is not None else 0
        hi = bound(vr.upper, -1) if vr is not None else -1
        lines.append(f"{name} {max(lo, 0)} {hi} {example}")
    return lines


def _densify_flex_attention(ep, example_inputs, dynamic_shapes):
    """`ep` with each flex_attention call as the dense ATen ops of attention.py, exported again: a package runs
    anywhere libember does, with no kernel of its own for the higher-order op (ember::flex_attention, the fused
    CUDA kernel of torch.compile, is an op registered from Python, which a C++ program has not)."""
    from .attention import _flex_hop, densify_flex_attention

    hop = _flex_hop()
    if hop is None or not any(n.op == "call_function" and n.target is hop for n in ep.graph_module.graph.nodes):
        return ep
    import torch

    module = ep.module()
    densify_flex_attention(module, fused=False)
    return torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)


def export(model, example_inputs, path, dynamic_shapes=None, device=None, strict=False, disable_passes=()):
    """Exports `model` (an nn.Module, or a torch.export.ExportedProgram) to the package file `path`.

    example_inputs: a tuple of tensors (the model's positional inputs). dynamic_shapes: as for
    torch.export.export. device: where the package runs ("cpu", "cuda", "cuda:1"); default: the device
    of the example inputs. A module is moved there on a copy, so the caller's model is left alone.
    Returns a dict: the package size, the number of CUDA kernel images, and the seconds each step took.
    """
    import torch

    from . import _C
    from .backend import _hint_nvrtc
    from .decompositions import decomposition_table

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    device = _device_of(example_inputs, device)
    seconds = {}
    start = time.perf_counter()
    if isinstance(model, torch.export.ExportedProgram):
        ep = model
    else:
        tensors = list(model.parameters()) + list(model.buffers())
        if any(t.device != device for t in tensors):
            model = copy.deepcopy(model).to(device)
        example_inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes, strict=strict)
    ep = _densify_flex_attention(ep, example_inputs, dynamic_shapes)
    seconds["torch.export"] = time.perf_counter() - start

    start = time.perf_counter()
    with warnings.catch_warnings():
        # torch 2.13's run_decompositions deep-copies the program's module call graph, whose pytree specs
        # torch.export built from the deprecated LeafSpec class; copying one constructs a LeafSpec again and
        # warns, on every export, about code that is torch's, not the caller's. Only that warning is hidden.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        ep = ep.run_decompositions(decomposition_table(for_export=True))
    seconds["decompose"] = time.perf_counter() - start

    start = time.perf_counter()
    gm = ep.graph_module
    from torch.export.graph_signature import InputKind

    user_names = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    user_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in user_names]
    if len(user_placeholders) != len(example_inputs):
        raise EmberError(f"ember.export: the exported program takes {len(user_placeholders)} inputs, "
                         f"example_inputs has {len(example_inputs)} (pass positional tensors only)")
    lowering = _ExportLowering(inline_invoke_subgraphs(gm), _lifted_tensors(ep), _user_outputs(ep))
    ir, constants = lowering.run()
    subgraphs = _lower_subgraphs(lowering.subgraphs, "", constants)
    seconds["lower"] = time.perf_counter() - start

    meta = [("ember", __import__("ember").__version__), ("torch", torch.__version__),
            ("cuda", torch.version.cuda or "none"), ("device", str(device)), ("created_by", "ember.export")]
    meta += [("input", f"{n.name}: {type_text(n.meta['val'])}") for n in user_placeholders]
    meta += [("symbol", line) for line in _symbol_lines(ep, user_placeholders, example_inputs)]
    if device.type == "cuda":
        _hint_nvrtc()
    start = time.perf_counter()
    info = _C.export_package(str(path), ir, constants, meta, list(disable_passes), subgraphs)
    seconds["compile+write"] = time.perf_counter() - start
    info["seconds"] = seconds
    return info


def load(path, device="cpu", reduce_overhead=False):
    """Loads a package through the C++ loader; .run(list of tensors) -> list of tensors.
    reduce_overhead=True replays the model's CUDA work through CUDA graphs (CUDA devices only)."""
    import torch

    from . import _C

    device = torch.device(device)
    if device.type == "cuda":
        from .backend import _hint_nvrtc

        _hint_nvrtc()
    return _C.load_package(str(path), str(device), reduce_overhead=reduce_overhead)
