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
choice), 32 us in eager's cuDNN call without a mask. EMBER_CUDNN_ATTENTION=0 keeps it to flash / efficient.
"""

import os

import torch

_SDPA = torch._C._nn.scaled_dot_product_attention


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


def _kernel_for(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """'cudnn', 'flash', 'efficient' or None (the op as it is), from what ATen's kernels accept."""
    tensors = (query, key, value)
    if enable_gqa or not isinstance(dropout_p, float) or dropout_p != 0.0:
        return None
    if any(t.dim() != 4 or not t.is_cuda or t.dtype != query.dtype or t.stride(-1) != 1 for t in tensors):
        return None
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    head, value_head = query.shape[-1], value.shape[-1]
    if key.shape[-1] != head or head % 8 != 0 or value_head % 8 != 0 or head > 256 or value_head > 256:
        return None
    if query.shape[0] != key.shape[0] or query.shape[1] != key.shape[1] or key.shape[:3] != value.shape[:3]:
        return None
    if is_causal and (attn_mask is not None or query.shape[2] != key.shape[2]):
        return None
    if _cudnn_usable(query, head, value_head, attn_mask):
        return "cudnn"
    if attn_mask is None and query.dtype != torch.float32 and head == value_head:
        if torch.cuda.get_device_capability(query.device) >= (8, 0):
            return "flash"
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, query.dtype) or attn_mask.dim() > 4 or key.shape[2] % 16 != 0:
            return None
        if attn_mask.device != query.device:
            return None
    if head > 128 or value_head > 128:
        return None
    return "efficient"


def _cudnn_usable(query, head, value_head, attn_mask):
    """Whether cuDNN's attention takes these operands (16-bit, Hopper, head <= 128, a 4-D mask at most)."""
    if os.environ.get("EMBER_CUDNN_ATTENTION", "1") == "0" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or head != value_head or head > 128:
        return False
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    if attn_mask is not None and (attn_mask.dim() > 4 or attn_mask.dtype not in (torch.bool, query.dtype)
                                  or attn_mask.device != query.device):
        return False
    return torch.cuda.get_device_capability(query.device) == (9, 0)


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention through ATen's cuDNN / flash / memory-efficient kernel where they apply."""
    kernel = _kernel_for(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
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
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, bias))
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(query, key, value, bias, needs_grad, 0.0, is_causal, False,
                                                        scale=scale)[0]
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, needs_grad, 0.0, is_causal,
                                                        scale=scale)[0]
