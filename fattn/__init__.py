"""fattn: FlashAttention in C and CUDA for any DLPack array (torch, CuPy, NumPy).

    import fattn
    o = fattn.attention(q, k, v, causal=True)          # q, k, v: (B, H, S, D)
    o, lse = fattn.attention(q, k, v, return_lse=True)
    dq, dk, dv = fattn.attention_backward(do, q, k, v, o, lse)   # any framework; torch autograd calls it itself
    o = fattn.attention_with_kvcache(q, k_cache, v_cache, k_new=k, v_new=v, cache_seqlens=lens)  # decode step
    fattn.variants("cuda")                              # ['v0', 'v1', ...]

See help(fattn.attention) for every argument.
"""
from ._api import attention, attention_backward, cuda_available, describe_variants, variants
from ._kvcache import attention_with_kvcache
from ._serving import attention_varlen, attention_varlen_backward

__version__ = "0.1.0"
__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "variants", "describe_variants", "cuda_available", "register_torch_ops", "__version__"]


def register_torch_ops():
    """Registers fattn's torch ops (torch.ops.fattn.*) now -- imports torch.  fattn registers them itself when the
    first torch tensor reaches it; call this first where something else needs them before that, e.g.
    torch.export.load of a program that calls fattn, in a fresh process."""
    from . import _args

    _args.torch_registered()
