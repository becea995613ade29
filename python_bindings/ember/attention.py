"""Attention on CUDA runs in a fused kernel (flash or memory-efficient), chosen before AOTAutograd traces.

F.scaled_dot_product_attention is a CompositeImplicitAutograd op: AOTAutograd traces through it and keeps
whichever implementation the dispatcher picks under fake tensors. For BertModel (transformers, which passes
an attention mask when it is being compiled) on the H100 that was the math fallback: the graph held two bmm,
the softmax and a masked-row fix-up (eq / any / where) where eager runs one memory-efficient kernel. A
decomposition-table entry cannot steer it (the op is decomposed above the table), so ember rewrites the
Dynamo graph: each CUDA attention call becomes `fused_attention`, which calls ATen's flash or
memory-efficient kernel directly when their constraints hold (both have autograd formulas, so training
graphs differentiate through them), and the original op otherwise.

On Hopper, 16-bit attention goes to cuDNN's kernel first, as eager's dispatcher does there (torch 2.11,
H100): GPT-2 bf16 b16 s512 (transformers' causal mask reaching SDPA as a boolean mask under compile) took
155 us per layer in the memory-efficient kernel with the mask as a bias, 68 us in cuDNN's (inductor's
choice), 32 us in eager's cuDNN call without a mask. ember.config.cudnn_attention = False keeps it to flash / efficient.

Before that, on every device, masks computed from constants alone are read at compile time
(`simplify_masks`): one that masks nothing is dropped, one that is exactly the causal mask becomes
is_causal=True. transformers 5.17 under torch.compile builds BertModel's "no padding" mask in the graph
(arange, `>= 0`, expand: all True) and GPT-2's causal one (arange, `<=`, a packed-sequence check), where
eager passes none and is_causal; a mask costs the kernel its mask-free path (H100, bf16 b32 s512: cuDNN's
attention 131 us per layer with BERT's mask as a bias, 71 without). Under dynamic shapes the same masks are built
from the length's symbol, and no single run says what they are at every length: mask_algebra.py proves it over
index expressions instead (without it, BERT-base's symbolic graph on the H100 ran the math path: two bmm, the
softmax and the masked-row fix-up, 17 ms of its 90 ms GPU time at length 384 against 8 ms in the static graph's
memory-efficient kernel).
"""

import math
import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import config

_SDPA = torch._C._nn.scaled_dot_product_attention

# What a mask's constant subgraph may call to be evaluated at compile time: deterministic, no memory left
# uninitialized, no reads outside the subgraph.
_CONSTANT_FUNCTIONS = {
    torch.arange, torch.ones, torch.zeros, torch.full, torch.ones_like, torch.zeros_like, torch.full_like,
    torch.tensor, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.where, torch.logical_and,
    torch.logical_or, torch.logical_not, torch.bitwise_and, torch.bitwise_or, torch.masked_fill, torch.add,
    torch.sub, torch.mul, torch.unsqueeze, torch.reshape, torch.broadcast_to, torch.cumsum, torch.diff,
    torch.tril, torch.triu,
    operator.add, operator.sub, operator.mul, operator.neg, operator.invert, operator.and_, operator.or_,
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.getitem,
}
_CONSTANT_METHODS = {
    "expand", "expand_as", "view", "reshape", "unsqueeze", "squeeze", "to", "bool", "float", "half", "bfloat16",
    "type", "masked_fill", "transpose", "permute", "contiguous", "repeat", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "__and__", "__or__", "__invert__", "add", "sub", "mul",
    "new_ones", "new_zeros", "new_full", "cumsum", "tril", "triu",
    # the operators as methods: torch 2.11's Dynamo records `a == b` on tensors as call_method __eq__ (2.13 as
    # operator.eq), which is how transformers 5.17 compares GPT-2's packed-sequence ids in its causal mask
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__mul__", "__rmul__", "__neg__", "__rand__", "__ror__", "__xor__", "__rxor__", "__getitem__",
}
# Calls a mask built from sizes may make beyond the constant ones (mask_algebra): removed with it when unused.
_SIZE_FUNCTIONS = {torch.diff, operator.invert, operator.neg, torch.bitwise_not, torch.logical_not}
_MAX_CONSTANT_ELEMENTS = 1 << 24  # a mask larger than this is left to the kernel


def _argument(node, index, name, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _set_argument(node, index, name, value):
    if len(node.args) > index:
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _constant_subgraph(mask):
    """The nodes `mask` is computed from, in graph order, if they read nothing but constants through the
    calls listed above; else None."""
    seen, stack = set(), [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function":
            if n.target not in _CONSTANT_FUNCTIONS:
                return None
        elif n.op != "call_method" or n.target not in _CONSTANT_METHODS:
            return None  # a placeholder, a parameter, a submodule: not known before the call
        value = n.meta.get("example_value")
        # A symbolic size is no constant (mask_algebra reads such masks); comparing it would add a guard.
        if isinstance(value, torch.Tensor) and (any(isinstance(d, torch.SymInt) for d in value.shape)
                                                or value.numel() > _MAX_CONSTANT_ELEMENTS):
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _evaluate(nodes):
    values = {}
    with torch.no_grad():
        for n in nodes:
            args = torch.fx.node.map_arg(n.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(n.kwargs, values.__getitem__)
            if n.op == "call_function":
                values[n] = n.target(*args, **kwargs)
            else:
                values[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    return values[nodes[-1]]


def _shape_of(arg):
    value = getattr(arg, "meta", {}).get("example_value")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _what_mask_is(mask, scores):
    """'none' where the mask masks nothing (all True, or an additive mask of zeros), 'causal' where it is
    exactly is_causal's (True, or 0, on and below the diagonal; False, or -inf, above it; square scores),
    else None."""
    try:
        if torch.broadcast_shapes(tuple(mask.shape), scores) != scores:
            return None  # eager broadcasts the scores to the mask's shape, or raises
    except RuntimeError:
        return None
    if mask.dtype == torch.bool:
        kept = mask
    elif mask.is_floating_point():
        if not bool(((mask == 0) | (mask == float("-inf"))).all()):
            return None
        kept = mask == 0
    else:
        return None
    if bool(kept.all()):
        return "none"
    rows, cols = scores[-2], scores[-1]
    if rows != cols or tuple(kept.shape[-2:]) != (rows, cols):
        return None
    causal = torch.ones(rows, cols, dtype=torch.bool, device=kept.device).tril()
    return "causal" if bool((kept == causal).all()) else None


def simplify_masks(gm):
    """Attention masks of a Dynamo graph computed from constants alone: dropped where they mask nothing,
    replaced by is_causal=True where they are exactly the causal mask. The attention is the same either way;
    its kernels run their mask-free (or causal) paths. Returns (masks dropped, masks made is_causal).
    ember.config.keep_masks = True leaves them."""
    if config.keep_masks:
        return 0, 0
    dropped = causal = 0
    proven = {}  # (mask node, scores' sizes) -> what_mask_is: a decoder's layers share one mask
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        mask = _argument(node, 3, "attn_mask")
        if not isinstance(mask, torch.fx.Node) or _argument(node, 5, "is_causal", False) is not False:
            continue  # is_causal with a mask is an error eager must still raise
        q_shape, k_shape = _shape_of(_argument(node, 0, "query")), _shape_of(_argument(node, 1, "key"))
        if q_shape is None or k_shape is None or len(q_shape) < 2 or len(k_shape) < 2:
            continue
        scores = q_shape[:-1] + k_shape[-2:-1]
        nodes = _constant_subgraph(mask)
        if nodes is None:  # built from a size Dynamo made symbolic: proven for every size, or left
            from .mask_algebra import what_mask_is

            key = (mask, tuple(str(s) for s in scores))
            if key not in proven:  # sympy's proof takes 0.2 s for LLaMA's causal mask
                proven[key] = what_mask_is(mask, scores)
            what = proven[key]
        else:
            try:
                value = _evaluate(nodes)
            except Exception:  # noqa: BLE001 - the mask then stays, and eager's semantics with it
                continue
            if not isinstance(value, torch.Tensor):
                continue
            what = _what_mask_is(value, scores)
        if what is None:
            continue
        _set_argument(node, 3, "attn_mask", None)
        if what == "causal":
            _set_argument(node, 5, "is_causal", True)
            causal += 1
        else:
            dropped += 1
    if dropped or causal:
        for n in reversed(list(gm.graph.nodes)):  # what only computed the masks
            if n.op in ("call_function", "call_method") and not n.users and (
                    n.target in _CONSTANT_FUNCTIONS or n.target in _CONSTANT_METHODS or n.target in _SIZE_FUNCTIONS):
                gm.graph.erase_node(n)
        gm.recompile()
    return dropped, causal


def route_attention(gm):
    """Points the CUDA attention calls of a Dynamo graph at fused_attention; returns how many."""
    routed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        query = node.args[0] if node.args else node.kwargs.get("query")
        value = getattr(query, "meta", {}).get("example_value")
        if isinstance(value, torch.Tensor) and value.is_cuda:
            node.target = fused_attention
            routed += 1
    if routed:
        gm.recompile()
    return routed


def _kernels_for(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """The kernels of 'cudnn', 'flash', 'efficient' that take these operands, from what ATen's kernels accept, in
    the default mode's order of preference (max-autotune times them all: attention_tuning.py)."""
    tensors = (query, key, value)
    if enable_gqa or not isinstance(dropout_p, float) or dropout_p != 0.0:
        return []
    if any(t.dim() != 4 or not t.is_cuda or t.dtype != query.dtype or t.stride(-1) != 1 for t in tensors):
        return []
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return []
    head, value_head = query.shape[-1], value.shape[-1]
    if key.shape[-1] != head or head % 8 != 0 or value_head % 8 != 0 or head > 256 or value_head > 256:
        return []
    if query.shape[0] != key.shape[0] or query.shape[1] != key.shape[1] or key.shape[:3] != value.shape[:3]:
        return []
    if is_causal and (attn_mask is not None or query.shape[2] != key.shape[2]):
        return []
    kernels = []
    if _cudnn_usable(query, head, value_head, attn_mask):
        kernels.append("cudnn")
    if attn_mask is None and query.dtype != torch.float32 and head == value_head:
        if torch.cuda.get_device_capability(query.device) >= (8, 0):
            kernels.append("flash")
    if attn_mask is not None:
        # A symbolic key length (a KV cache under dynamic shapes) is not known to be a multiple of 16: the op
        # stays as it is rather than guarding on it (a recompile each time the length crosses a multiple).
        if (attn_mask.dtype not in (torch.bool, query.dtype) or attn_mask.dim() > 4
                or not statically_known_true(key.shape[2] % 16 == 0)):
            return kernels
        if attn_mask.device != query.device:
            return kernels
    if head > 128 or value_head > 128:
        return kernels
    return kernels + ["efficient"]


def _cudnn_usable(query, head, value_head, attn_mask):
    """Whether cuDNN's attention takes these operands (16-bit, Hopper, head <= 128, a 4-D mask at most)."""
    if not config.cudnn_attention or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or head != value_head or head > 128:
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if attn_mask is not None and (attn_mask.dim() > 4 or attn_mask.dtype not in (torch.bool, query.dtype)
                                  or attn_mask.device != query.device):
        return False
    return torch.cuda.get_device_capability(query.device) == (9, 0)


def _aligned_bias(bias):
    """The bias as ATen's memory-efficient and cuDNN kernels read it: rows contiguous, every other stride and
    the offset a multiple of 16 elements (broadcast strides of 0 included); else a copy, as SDPA itself makes
    one (T5's position bias, a permuted embedding, has a last-dimension stride of the head count)."""
    if bias.stride(-1) == 1 and bias.storage_offset() % 16 == 0 and all(s % 16 == 0 for s in bias.stride()[:-1]):
        return bias
    return bias.clone(memory_format=torch.contiguous_format)


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    kernel=None):
    """F.scaled_dot_product_attention through ATen's cuDNN / flash / memory-efficient kernel where they apply.
    `kernel`: the one max-autotune timed fastest (attention_tuning.py), or "math" (two matmuls and a softmax);
    where it does not take these operands, the default's."""
    kernels = _kernels_for(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if kernel == "math" and kernels:
        return torch.ops.aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                                 scale=scale)[0]
    kernel = kernel if kernel in kernels else (kernels[0] if kernels else None)
    if kernel is None:
        return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    aten = torch.ops.aten
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False, scale=scale)[0]
    bias = None
    if attn_mask is not None:
        bias = attn_mask
        if bias.dtype == torch.bool:  # what SDPA itself does with a boolean mask: 0 where kept, -inf elsewhere
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
                bias.logical_not(), float("-inf"))
        bias = _aligned_bias(bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2]))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias))
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(query, key, value, bias, needs_grad, 0.0, is_causal, False,
                                                        scale=scale)[0]
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, needs_grad, 0.0, is_causal,
                                                        scale=scale)[0]


# ---- flex_attention (torch.nn.attention.flex_attention) ---------------------------------------------------------
#
# Dynamo keeps a flex_attention call whole, as the higher-order op with its score_mod and mask_mod graphs, for
# inductor to turn into one kernel. ember's own kernel (flex.py: 16-bit CUDA inference with mods it can write as
# CUDA) takes the calls it can; each other call becomes `dense_flex_attention` in the Dynamo graph, which
# AOTAutograd then traces into ATen ops (forward and backward): the scores materialized as eager's
# flex_attention does outside torch.compile, score_mod and mask_mod applied over every (batch, head,
# query, key) position through torch.vmap, fully masked rows giving zeros. The pointwise score_mod, the mask and
# the softmax land in ember's fused kernels; the two matmuls stay library calls. Block sparsity is not used: the
# mask_mod is evaluated everywhere, which gives the same result for every BlockMask made by create_block_mask.


def _flex_hop():
    return getattr(torch.ops.higher_order, "flex_attention", None)


def _over_bhmn(fn, leading, trailing):
    """fn(*leading_args, b, h, m, n, *trailing_args) mapped over every (b, h, m, n) index: one vmap per index,
    the innermost over n. `leading` / `trailing`: the vmap in_dims of the other arguments (0: mapped with the
    indices, as the scores are; None: passed whole, as captured buffers are)."""
    for axis in (3, 2, 1, 0):
        indices = tuple(0 if i == axis else None for i in range(4))
        fn = torch.vmap(fn, in_dims=(*leading, *indices, *trailing))
    return fn


def _like_strides(out, like):
    """`out` ([B, H, L, E], contiguous) laid out in memory in the dimension order of `like`'s strides, as
    flex_attention returns it: a query made by transposing [B, L, H, E] gives an output whose transpose back
    is a view."""
    order = sorted(range(out.dim()), key=lambda d: -like.stride(d))
    if order == list(range(out.dim())):
        return out
    inverse = [order.index(d) for d in range(out.dim())]
    return out.permute(order).contiguous().permute(inverse)


def dense_flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                         score_mod_other_buffers=(), mask_mod_other_buffers=(), outputs=3):
    """The flex_attention higher-order op's results from ATen ops: (output, logsumexp / ln 2[, max / ln 2]) (the
    op reports base-2 statistics, which its Python wrapper scales back)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    groups = query.size(1) // key.size(1)
    if groups > 1:  # grouped-query attention: each key / value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    key = key.expand(query.size(0), *key.shape[1:])
    value = value.expand(query.size(0), *value.shape[1:])
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(work) @ key.to(work).transpose(-2, -1)) * scale
    b, h, m, n = (torch.arange(size, device=scores.device) for size in scores.shape)
    mask_mod = block_mask[-1]
    with TransformGetItemToIndex():  # score_mod's bias[h] indexing with a batched index
        keep = _over_bhmn(mask_mod, (), (None,) * len(mask_mod_other_buffers))(b, h, m, n, *mask_mod_other_buffers)
        modded = _over_bhmn(score_mod, (0,), (None,) * len(score_mod_other_buffers))(
            scores, b, h, m, n, *score_mod_other_buffers)
    scores = torch.where(keep, modded, torch.tensor(float("-inf"), dtype=work, device=scores.device))
    # Rows the mask removes whole: zeros out, -inf statistics. Told apart by their maximum, a row reduction that
    # joins the softmax's kernel (torch._safe_softmax's any() over the scores and its where() ran as two more
    # ATen passes over them: bench/hops.py's flex on the 2-core host 1.11 -> 0.91 ms per call).
    row_max = scores.amax(dim=-1, keepdim=True)
    live = row_max != float("-inf")
    lse = torch.where(live.squeeze(-1), scores.logsumexp(dim=-1), float("-inf"))
    probs = torch.where(live, torch.softmax(scores, dim=-1), 0.0)
    out = probs.to(query.dtype) @ value.to(query.dtype)
    results = (_like_strides(out, query), lse / math.log(2))
    if outputs > 2:
        results += (row_max.squeeze(-1) / math.log(2),)
    return results


def densify_flex_attention(gm, fused=True):
    """Replaces each flex_attention call of a graph by ember::flex_attention (flex.py) where the kernel runs it
    (with `fused`), else by dense_flex_attention; returns how many became dense."""
    hop = _flex_hop()
    nodes = [n for n in gm.graph.nodes if hop is not None and n.op == "call_function" and n.target is hop]
    if nodes and fused and config.flex_kernel:
        from .flex import fuse_flex_attention

        left = fuse_flex_attention(gm, nodes)  # the CUDA kernel where it runs (flex.py)
        if len(left) < len(nodes):
            gm.recompile()
        nodes = left
    replaced = 0
    for node in nodes:
        value = node.meta.get("example_value")
        outputs = len(value) if isinstance(value, (tuple, list)) else 3
        with gm.graph.inserting_before(node):
            dense = gm.graph.call_function(dense_flex_attention, node.args, {**node.kwargs, "outputs": outputs})
        dense.meta = dict(node.meta)
        node.replace_all_uses_with(dense)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
