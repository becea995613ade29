"""Convolutions in channels_last (CUDA; CPU inference and training), chosen on the Dynamo graph before AOTAutograd
traces it.

cuDNN runs 2-D convolutions in NHWC: given NCHW tensors it converts each input to NHWC and each result
back (torchvision resnet18 b8 f32 on the H100: 36 nchwToNhwc and 14 nhwcToNchw kernels, 204 of the 734 us
of GPU time per reduce-overhead call), where inductor converts the graph to channels_last and has none.
This rewrite does the same before tracing: each convolution reads its input and weight
`.contiguous(memory_format=torch.channels_last)`. AOTAutograd records a copy only where a tensor is not
already in that layout: the graph's first input and the weights (a small copy each, per call); a
convolution's result comes out channels_last, and the pointwise ops after it keep that layout (ember's
CUDA kernels iterate in memory order, passes/batchnorm_pointwise.cpp fuses the batch norms), so the next
convolution's input needs none. Graph outputs that were 4-D and NCHW go back to NCHW, so callers see
eager's strides; so do the inputs of `view` and `as_strided`, which read strides.

Only where a graph has at least two CUDA 2-D convolutions over floating NCHW tensors (a conv-heavy
model, as inductor decides), and not where an in-place write would show that a `contiguous()` or
`reshape` which shared memory in the trace now copies; ember.config.conv_channels_last = False turns it off.

On the CPU the same holds for inference and training graphs, with the weights left as they are. In inference
graphs ember's convolution kernel (kernels/cpu/conv_kernel.cpp) reorders a parameter's weights once into oneDNN's
blocked layout for a channels-last source whatever their own layout, where a channels_last copy in the graph would
be made per call and would hide the parameter from that packing and from batch-norm folding; in training graphs
the convolutions are ATen's, and oneDNN reorders the weights per call. oneDNN's convolutions
are faster on channels-last activations (torchvision resnet18 b2 on the 2-core host: eager 60 ms in NCHW,
33-41 ms in channels_last). In training graphs the eval-mode batch norms and ReLUs between the convolutions then
fuse forward and backward (decompositions.py, passes/batchnorm_pointwise.cpp); timm regnetx_002's training step,
2-core host: 27.2 ms NCHW, 22.1 ms channels-last with ATen's norms, whose channels-last backward is slow, 21.6 ms
fused. Not where that loses (pays_in_cpu_training): where concatenations along the channels are frequent
(densenet121's training step was 0.93-0.99x eager so against 1.05-1.08x in NCHW: a channels-last concatenation
copies strided rows, and ember writes no input in place into it), or where the weights outweigh the activations
(each weight is reordered per call).

With the rewrite on, a 1x1 average pool is traced as the mean it is (global_pools_as_means): channels-last, ATen
restrides that mean, and a training graph's backward paid for the restride.

With a symbolic size, a CUDA eval-mode batch norm is traced as the op it runs (direct_eval_batch_norms): ATen's
batch_norm routes it to cuDNN's kernel through `input.contiguous(input.suggest_memory_format())`, which for a
channels_last input of symbolic sizes is a copy (bench/dynamic.py's convnet on an H100: four more traced nodes
than with this rewrite, a clone before each batch norm). fold_batchnorm folds past such a copy; a batch norm it does
not fold would read it.
"""

import torch


def _tensor(node):
    value = getattr(node, "meta", {}).get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _arg(node, position, name):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name)


def _nchw(value, force):
    return (
        value is not None
        and value.dim() == 4
        and value.dtype.is_floating_point
        and (value.is_cuda or force)
        and value.is_contiguous()
        and not (value.shape[1] == 1 or value.shape[2] * value.shape[3] == 1)  # layouts coincide there
    )


# Ops whose result may share its first argument's memory: a write into either shows in the other.
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "contiguous", "as_strided", "transpose",
          "swapaxes", "permute", "movedim", "t", "expand", "expand_as", "squeeze", "unsqueeze", "narrow", "select",
          "split", "chunk", "unbind", "detach", "alias", "diagonal", "unfold", "getitem", "__getitem__"}
# Of those, the ones that share memory with an NCHW-contiguous tensor and copy a channels_last one (view and
# as_strided get a copy of their input first, below).
_SHARES_BY_LAYOUT = {"contiguous", "reshape", "reshape_as", "flatten", "view", "as_strided"}
_IN_PLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                       "ilshift", "irshift"}


def _name(node):
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return ""


def _writes_in_place(node):
    name = _name(node)
    return (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE_OPERATORS or (
        node.op == "call_function" and node.kwargs.get("inplace") is True)


def _sharing_changes_show(graph, force):
    """Whether the rewrite would change what a program computes: `x.contiguous()` (reshape, flatten) of a
    tensor NCHW-contiguous in the trace is x's own memory, of its channels_last rewrite a copy, so an
    in-place write after it into either side (or a view of one) no longer reaches the other (fuzz seed
    65959: `v0.contiguous().mul_(2)` left a convolution's result v0 undoubled)."""
    nodes = list(graph.nodes)
    root = {n: n for n in nodes}

    def find(n):
        while root[n] is not n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for n in nodes:
        if _name(n) in _VIEWS and n.args and isinstance(n.args[0], torch.fx.Node):
            root[find(n)] = find(n.args[0])
    changed = [(i, find(n)) for i, n in enumerate(nodes) if _name(n) in _SHARES_BY_LAYOUT and n.args
               and isinstance(n.args[0], torch.fx.Node) and _nchw(_tensor(n.args[0]), force)]
    for i, n in enumerate(nodes):
        if _writes_in_place(n) and n.args and isinstance(n.args[0], torch.fx.Node):
            written = find(n.args[0])
            if any(j < i and group is written for j, group in changed):
                return True
    return False


def pays_in_cpu_training(gm):
    """Whether a CPU training graph gains from channels-last convolutions (the module's docstring): not where at
    least one convolution in three reads a concatenation along dim 1 (densenet121: 62 concatenations, 120
    convolutions; shufflenet_v2 16 and 56, googlenet 9 and 57), nor where the convolutions' weights hold at least
    twice as many values as their inputs (oneDNN reorders each NCHW weight for a channels-last source per call, and
    its gradient back: timm resnet50d at batch 1, 23.5M weights against 10.4M, was 0.94-0.96x eager so against
    1.01-1.02x in NCHW; efficientnet_v2_s, 20.0M against 12.3M, gains).

    Nor where a 1x1 convolution with a stride reads fewer than 16 channels: torch's CPU convolution_backward over a
    channels_last input corrupts the heap there (torch 2.13, eager as well: Conv2d(5, 4, 1, stride=2) on a
    channels_last [2, 5, 8, 8], one thread: "free(): invalid size" within a few hundred steps; two threads: wrong
    weight gradients in 15 of 300 steps). On this project's AVX2 host input channels 2-6 failed, 7-16 and 64 did
    not, nor 3x3 kernels. oneDNN's issue 6035 describes it: its 1x1 backward-weights kernel writes past a
    workspace for nhwc sources with a stride when the input channels are fewer than its channel block (8 with
    AVX2, 16 with AVX-512), hence 16 here."""
    convs = cats = weights = inputs = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.conv2d:
            convs += 1
            x, w = _tensor(_arg(node, 0, "input")), _tensor(_arg(node, 1, "weight"))
            if x is None or w is None or not isinstance(x.numel(), int) or not isinstance(w.numel(), int):
                return False  # symbolic sizes: comparing them would guard on them (NCHW, as before)
            stride = _arg(node, 3, "stride")
            strided = any(s != 1 for s in (stride if isinstance(stride, (tuple, list)) else (stride or 1,)))
            if w.dim() == 4 and tuple(w.shape[2:]) == (1, 1) and strided and w.shape[1] < 16:
                return False
            weights += w.numel()
            inputs += x.numel()
        elif node.target in (torch.cat, torch.concat, torch.concatenate):
            value = _tensor(node)
            cats += int(value is not None and value.dim() == 4 and _arg(node, 1, "dim") in (1, -3))
    return convs > 0 and 3 * cats < convs and weights < 2 * inputs


def global_pools_as_means(gm):
    """Rewrites `adaptive_avg_pool2d(x, 1)` of a 4-D x in `gm` (a Dynamo graph) as `x.mean((-1, -2), keepdim=True)`;
    returns how many. They are the same op: ATen's adaptive_avg_pool2d is that mean, after which a channels_last x
    gives the [N, C, 1, 1] result channels_last strides with `as_strided_`, the same memory order, since H and W
    are 1. Traced for training, that `as_strided_` makes the mean's backward an `as_strided_scatter` into zeros,
    a copy and an `as_strided` view before the expand and divide, ATen calls the fuse pass cannot join (torchvision
    regnet_y_400mf's training step has 17 squeeze-excitation blocks, each such a pool). Pools whose result is a
    graph output keep eager's strides."""
    rewritten = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.nn.functional.adaptive_avg_pool2d,
                                                             torch._C._nn.adaptive_avg_pool2d):
            continue
        x, size = _arg(node, 0, "input"), _arg(node, 1, "output_size")
        value = _tensor(x)
        if value is None or value.dim() != 4 or size not in (1, (1, 1), [1, 1]):
            continue
        if any(user.op == "output" for user in node.users):
            continue
        node.target, node.args, node.kwargs = torch.mean, (x, (-1, -2)), {"keepdim": True}
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _views_past_views(graph, force):
    """Whether a `view` or `as_strided` reads, through other views (a permute), a tensor NCHW-contiguous in the
    trace: the rewrite gives that tensor channels_last strides, and the view then reads other ones than traced
    (`conv(x).permute(3, 2, 0, 1).view(3, 2, -1)` could not be viewed so: fuzz seed 813074). Giving the view
    its input's traced layout back (as below for views of the NCHW tensor itself) would need the whole chain
    replayed; the rewrite is left out instead."""
    for node in graph.nodes:
        if _name(node) not in ("view", "as_strided") or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        source = node.args[0]
        if _nchw(_tensor(source), force):
            continue  # made contiguous first, below
        while (_name(source) in _VIEWS and _name(source) not in _SHARES_BY_LAYOUT and source.args
               and isinstance(source.args[0], torch.fx.Node)):
            source = source.args[0]
            if _nchw(_tensor(source), force):
                return True
    return False


def channels_last_convolutions(gm, force=False, weights=True):
    """Rewrites `gm` (a Dynamo graph) in place; returns the number of convolutions now reading
    channels_last tensors. `force` applies it to CPU tensors too. `weights=False` leaves the weights as
    they are: only the activations change layout (the CPU rewrite, see the module's docstring)."""
    convs = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.conv2d:
            continue
        x, w = _arg(node, 0, "input"), _arg(node, 1, "weight")
        xv, wv = _tensor(x), _tensor(w)
        if xv is None or wv is None or xv.dim() != 4 or wv.dim() != 4 or not (xv.is_cuda or force):
            continue
        if not xv.dtype.is_floating_point:
            continue
        convs.append((node, x, w))
    if len(convs) < 2 or not any(_nchw(_tensor(x), force) for _, x, _ in convs):
        return 0
    if _sharing_changes_show(gm.graph, force) or _views_past_views(gm.graph, force):
        return 0
    graph = gm.graph
    for node, x, w in convs:
        with graph.inserting_before(node):
            x_cl = graph.call_method("contiguous", (x,), {"memory_format": torch.channels_last})
            w_cl = graph.call_method("contiguous", (w,), {"memory_format": torch.channels_last}) if weights else w
        args = list(node.args)
        kwargs = dict(node.kwargs)
        if len(args) > 0:
            args[0] = x_cl
        else:
            kwargs["input"] = x_cl
        if len(args) > 1:
            args[1] = w_cl
        else:
            kwargs["weight"] = w_cl
        node.args, node.kwargs = tuple(args), kwargs
    # A view or as_strided reads its input's strides: where the input was NCHW-contiguous in the trace, it gets
    # that layout back first (else `view` may fail on a channels_last tensor, and as_strided would read other
    # elements).
    for node in list(graph.nodes):
        reads_strides = (node.op == "call_method" and node.target in ("view", "as_strided")) or (
            node.op == "call_function" and node.target in (torch.Tensor.view, torch.as_strided))
        source = node.args[0] if reads_strides and node.args else None
        if isinstance(source, torch.fx.Node) and _nchw(_tensor(source), force):
            with graph.inserting_before(node):
                node.replace_input_with(source, graph.call_method("contiguous", (source,)))
    output = next(n for n in graph.nodes if n.op == "output")

    def restore(value):
        if isinstance(value, torch.fx.Node) and _nchw(_tensor(value), force):
            with graph.inserting_before(output):
                return graph.call_method("contiguous", (value,))
        return value

    output.args = torch.fx.node.map_aggregate(output.args, restore)
    gm.recompile()
    return len(convs)


def direct_eval_batch_norms(gm, force=False):
    """Rewrites each eval-mode `F.batch_norm` of a CUDA tensor (any tensor with `force`) with a symbolic size in
    `gm` (a Dynamo graph of an inference call) as `aten._native_batch_norm_legit_no_training`, the op its trace ends
    in anyway; returns how many. Traced through ATen's batch_norm, the cuDNN route first makes its input
    `contiguous(input.suggest_memory_format())`, and for a channels_last tensor of symbolic sizes that is a clone
    (see the module's docstring). Static sizes keep the traced route, which copies nothing."""
    import operator

    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.nn.functional.batch_norm:
            continue
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        defaults = (None, None, None, None, None, False, 0.1, 1e-5)
        x, mean, var, weight, bias, training, momentum, eps = (
            _arg(node, i, name) if len(node.args) > i or name in node.kwargs else default
            for i, (name, default) in enumerate(zip(names, defaults)))
        value = _tensor(x)
        if training is not False or mean is None or var is None or value is None or not (value.is_cuda or force):
            continue
        if all(isinstance(size, int) for size in value.shape):
            continue
        if not all(isinstance(a, (int, float)) for a in (momentum, eps)):
            continue
        with gm.graph.inserting_after(node):
            norm = gm.graph.call_function(torch.ops.aten._native_batch_norm_legit_no_training.default,
                                          (x, weight, bias, mean, var, momentum, eps))
        with gm.graph.inserting_after(norm):
            result = gm.graph.call_function(operator.getitem, (norm, 0))
        result.meta.update(node.meta)
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
