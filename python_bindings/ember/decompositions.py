"""ember's decomposition table: torch's core ATen decompositions, minus the ops ember keeps whole.

Kept whole, and why:
- Attention (scaled_dot_product_attention and its CPU flash kernel): the fused library kernels
  (flash / memory-efficient / cuDNN on the GPU, the flash CPU kernel) beat any decomposition.
- Matmul-like and conv ops are not decomposed by the core table anyway; they stay extern calls.
- Normalization backwards (layer/batch/group norm), softmax/log_softmax backwards, dropout backward,
  embedding backward, loss forwards/backwards and activation backwards (relu's threshold_backward, gelu,
  silu, hardswish, mish): while a node runs as one ATen kernel, one fused ATen kernel beats the 5-20
  pointwise and reduction nodes its decomposition produces. The fusion pass may lower these itself once
  it can generate kernels that beat ATen's. (threshold_backward decomposes to le + scalar_tensor + where,
  and ATen's CPU where is not vectorized: 245 vs 27 us for the 64x1024 ReLU gradient of the MLP step.)
- Activations (silu, hardswish, mish), logsumexp, var/std(_mean), upsampling and pooling: the same
  reason. silu, hardswish and the backwards of gelu and silu then fuse whole: the fuse pass lowers them into its
  kernels (kernels/program.cpp).
- _weight_norm_interface (weight_norm's forward; its backward is not in the table): the decomposition's norm
  over all dimensions but one is a strided reduction ATen runs slowly. For wav2vec2's positional convolution
  (weight [768, 48, 128], dim=2) on the 2-core host, forward and backward took 24.6 ms against eager's 12.1,
  and its training step 166 against 152 ms.
- alias_copy: the core table makes it an alias, and with detach (a no-op there) a scan's backward
  combine graph then returned an alias of its input, which torch's scan rejects ("scan might be aliasing
  the input or the output"; inductor fails the same way on torch 2.13). Kept, it is a copy through ATen.

Replaced: embedding_dense_backward becomes ember::embedding_grad (kernels/embedding_grad_op.cpp: a zero table
and one index_add_) without scale_grad_by_freq: on CUDA outside deterministic mode (its index_add_ adds with
atomics), on the CPU for float32 and float64 gradients (its zero table costs only the pages written);
ember.config.embedding_grad = "aten" keeps ATen's kernel.

Replaced on the CPU for channels-last float32 tensors (CPU training graphs run their convolutions so, layout.py):
threshold_backward and the eval-mode native_batch_norm_backward compute over the tensors' [N * H * W, C] rows,
the batch norm's as the pointwise ops and column sums ember fuses (threshold_backward_rows,
batch_norm_backward_rows). Elsewhere they stay whole.

Wrapped: the scatter ops functionalization writes for an in-place write into a view (select_scatter,
slice_scatter, diagonal_scatter, as_strided_scatter) return a tensor with their input's strides, and the core
table's decompositions (a `where`) a contiguous one where the input is not dense. A later reshape in the same
trace decides between a view and a copy from those strides: `x[0].copy_(x[1]); y = x.flatten(); x.add_(1)`
for an `x = t[1::2]` made `y` a view that saw the add (fuzz seed 402227). Where the strides differ, the wrapped
decomposition keeps the op whole (it runs through ATen; its unused decomposition is dead code the trace drops).
"""

import functools

from . import config

KEEP_WHOLE = (
    "scaled_dot_product_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
    "native_layer_norm_backward.default",
    "native_batch_norm_backward.default",
    "native_group_norm_backward.default",
    "_softmax_backward_data.default",
    "_log_softmax_backward_data.default",
    "native_dropout_backward.default",
    "embedding_dense_backward.default",
    "nll_loss_forward.default",
    "nll_loss_backward.default",
    "nll_loss2d_forward.default",
    "nll_loss2d_backward.default",
    "mse_loss.default",
    "mse_loss_backward.default",
    "binary_cross_entropy.default",
    "binary_cross_entropy_backward.default",
    "binary_cross_entropy_with_logits.default",
    "gelu_backward.default",
    "threshold_backward.default",
    "silu.default",
    "silu_backward.default",
    "hardswish.default",
    "hardswish_backward.default",
    "mish.default",
    "mish_backward.default",
    "logsumexp.default",
    "var_mean.correction",
    "var.correction",
    "std.correction",
    "std_mean.correction",
    "upsample_nearest2d.default",
    "upsample_nearest2d.vec",
    "upsample_bilinear2d.vec",
    "adaptive_avg_pool2d.default",
    "max_pool2d.default",
    "_fused_rms_norm.default",
    "_weight_norm_interface.default",
    "alias_copy.default",
)


# Nearest-neighbour upsamplings that torch's core table decomposes beyond its post-autograd part.
_UPSAMPLE_NEAREST = ("upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
                     "upsample_nearest3d", "_upsample_nearest_exact3d")


def _core_table():
    """torch's core ATen decompositions as tracing below autograd uses them. `core_aten_decompositions()` also
    lists every CompositeImplicitAutograd op (~500 entries that only call the op's own decomposition, which
    the dispatcher runs anyway when tracing below autograd) and took 170-190 ms to build on the 2-core host,
    once per process at the first compile; its post-autograd part takes 4 ms. The traced graphs are the same
    (compared node for node for the bench workloads, inference and training, forward and backward)."""
    import torch
    import torch._decomp as decomp

    post_autograd = getattr(decomp, "_core_aten_decompositions_post_autograd", None)
    if post_autograd is None:  # a torch without the split
        return dict(decomp.core_aten_decompositions())
    table = dict(post_autograd())
    for name in _UPSAMPLE_NEAREST:
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        if op is not None and op in decomp.decomposition_table:
            table[op] = decomp.decomposition_table[op]
    return table


def decomposition_table(for_export=False):
    """The table handed to AOTAutograd and to trace.py; built once (per embedding_grad setting), on first compile.
    `for_export`: the table for ember.export's `run_decompositions`, which may keep CompositeImplicitAutograd ops
    its table does not name, so it gets torch's whole core table."""
    return _table(for_export, config.embedding_grad)


@functools.lru_cache(maxsize=4)
def _table(for_export, embedding_grad_setting):
    import torch
    from torch._decomp import core_aten_decompositions

    keep = set()
    for name in KEEP_WHOLE:
        packet, _, overload = name.partition(".")
        op = getattr(torch.ops.aten, packet, None)
        if op is not None and hasattr(op, overload):
            keep.add(getattr(op, overload))
    core = dict(core_aten_decompositions()) if for_export else _core_table()
    table = {op: fn for op, fn in core.items() if op not in keep}
    if embedding_grad_setting != "aten":
        table[torch.ops.aten.embedding_dense_backward.default] = embedding_grad
    for name in _SCATTERS:
        op = getattr(getattr(torch.ops.aten, name, None), "default", None)
        if op in table:
            table[op] = _with_input_strides(table[op])
    table[torch.ops.aten.threshold_backward.default] = threshold_backward_rows
    table[torch.ops.aten.native_batch_norm_backward.default] = batch_norm_backward_rows
    return table


_SCATTERS = ("select_scatter", "slice_scatter", "diagonal_scatter", "as_strided_scatter")


def _with_input_strides(decomposition):
    """A scatter's decomposition where its result has the input's strides, as ATen's kernel's has; else
    NotImplemented, which keeps the op (module docstring)."""
    import torch

    @functools.wraps(decomposition)
    def run(self, *args, **kwargs):
        out = decomposition(self, *args, **kwargs)
        if isinstance(out, torch.Tensor) and out.stride() != self.stride():
            return NotImplemented
        return out

    return run


def embedding_grad(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    """aten.embedding_dense_backward as ember::embedding_grad on CUDA and on the CPU (module docstring);
    NotImplemented keeps the op."""
    import torch

    if scale_grad_by_freq:
        return NotImplemented
    if grad_output.is_cuda:
        if torch.are_deterministic_algorithms_enabled():
            return NotImplemented
    elif grad_output.device.type != "cpu" or grad_output.dtype not in (torch.float32, torch.float64):
        return NotImplemented
    from . import _C  # noqa: F401  (registers the ember:: ops)

    return torch.ops.ember.embedding_grad(grad_output, indices, num_weights, padding_idx)


def _cpu_channels_last(t):
    """A float32 CPU tensor [N, C, H, W] of static sizes laid out channels_last (and not also NCHW-contiguous):
    its memory is the row-major [N * H * W, C] matrix."""
    import torch

    return (t.dim() == 4 and t.device.type == "cpu" and t.dtype == torch.float32
            and all(isinstance(s, int) for s in t.shape) and all(isinstance(s, int) for s in t.stride())
            and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous())


def _rows(t):
    """[N, C, H, W] channels_last as the [N * H * W, C] matrix it is in memory (a view)."""
    n, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(n * h * w, c)


def _as_channels_last(rows, like):
    n, c, h, w = like.shape
    return rows.view(n, h, w, c).permute(0, 3, 1, 2)


def threshold_backward_rows(grad_output, self, threshold):
    """ReLU's backward over channels_last CPU tensors, computed over their [N * H * W, C] rows (the same
    elements in the same order, so the same result), where the eval-mode batch norm's backward below reads
    them: canonicalize drops the views between the two, and the fuse pass puts both in one column group.
    NotImplemented keeps the op for any other tensor."""
    import torch

    if not (_cpu_channels_last(grad_output) and _cpu_channels_last(self) and grad_output.shape == self.shape):
        return NotImplemented
    out = torch.ops.aten.threshold_backward.default(_rows(grad_output), _rows(self), threshold)
    return _as_channels_last(out, grad_output)


def batch_norm_backward_rows(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                             output_mask):
    """An eval-mode batch norm's backward over channels_last CPU tensors (CPU training graphs run their
    convolutions so, backend.py and layout.py) as ops ember fuses, where ATen's channels-last kernel is slow
    (timm regnetx_002's training step on the 2-core host: its 44 calls took 3.4 ms of 22). In the [N * H * W, C]
    rows, with invstd = rsqrt(running_var + eps):
        grad_input  = grad_out * (invstd * weight)              (per-channel scale along the rows)
        grad_weight = sum over rows of grad_out * (input - running_mean), times invstd
        grad_bias   = sum over rows of grad_out
    as ATen computes it in eval mode; the sums are column reductions. The saved statistics are not read, so
    the forward's batch norm no longer hands them on and becomes a multiply-add (passes/batchnorm_pointwise.cpp).
    NotImplemented keeps the op: training mode, other devices, dtypes or layouts."""
    import torch

    if train or running_mean is None or running_var is None:
        return NotImplemented
    if not (_cpu_channels_last(grad_out) and _cpu_channels_last(input) and grad_out.shape == input.shape):
        return NotImplemented
    params = [t for t in (weight, running_mean, running_var) if t is not None]
    if any(t.dtype != torch.float32 or t.dim() != 1 for t in params):
        return NotImplemented
    invstd = torch.rsqrt(running_var + eps)
    g = _rows(grad_out)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = _as_channels_last(g * (invstd if weight is None else invstd * weight), grad_out)
    if output_mask[1] and weight is not None:
        grad_weight = (g * (_rows(input) - running_mean)).sum(0) * invstd
    if output_mask[2]:
        grad_bias = g.sum(0)
    return grad_input, grad_weight, grad_bias
