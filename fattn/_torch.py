"""fattn as torch custom operators, so that autograd, torch.compile, torch.export and FakeTensor see it.

    torch.ops.fattn.attention(q, k, v, causal, scale, layout, window_left, window_right, variant, deterministic)
        -> (out, lse)
    torch.ops.fattn.attention_backward(dout, q, k, v, out, lse, causal, scale, layout, window_left, window_right,
                                       variant, deterministic) -> (dq, dk, dv)

The forward's autograd formula saves q, k, v, out and lse and calls the backward op; lse is not differentiable.
Both have fake (meta) implementations that only give shapes.  Imported, and torch's types registered with the C
side (the lean call path), by fattn.attention the first time a torch tensor arrives; `import fattn` never imports
torch.
"""
import torch

from . import _C, _frameworks
from ._frameworks import current_stream

_frameworks.register_torch(_C)

_LIB = "fattn"


def _stream(t):
    return current_stream("torch", t.get_device()) if t.is_cuda else None


def _window(left, right):
    return None if left < 0 and right < 0 else (left, right)


def _lse_shape(q, layout):
    b, x, y = q.shape[0], q.shape[1], q.shape[2]
    return (b, x, y) if layout == 0 else (b, y, x)


@torch.library.custom_op(f"{_LIB}::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: int, scale: float | None, layout: int,
              window_left: int, window_right: int, variant: str | None,
              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty(_lse_shape(q, layout), dtype=torch.float32)
    _C.forward(q, k, v, out, lse, causal=causal, scale=scale, layout=layout, window=_window(window_left, window_right),
               variant=variant, stream=_stream(q))
    return out, lse


@attention.register_fake
def _(q, k, v, causal, scale, layout, window_left, window_right, variant, deterministic):
    return torch.empty_like(q), q.new_empty(_lse_shape(q, layout), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: int, scale: float | None, layout: int, window_left: int,
                       window_right: int, variant: str | None,
                       deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    workspace = None
    if q.is_cuda:
        b, x, y, d = q.shape
        h, sq = (x, y) if layout == 0 else (y, x)
        workspace = q.new_empty((_C.backward_workspace_bytes(b, h, sq, d),), dtype=torch.uint8)
    if dout.dim() == 4 and dout.stride(-1) != 1:  # e.g. the expanded gradient of a sum()
        dout = dout.contiguous()
    _C.backward(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, scale=scale, layout=layout,
                window=_window(window_left, window_right), variant=variant, stream=_stream(q),
                deterministic=deterministic or torch.are_deterministic_algorithms_enabled(), workspace=workspace)
    return dq, dk, dv


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, layout, window_left, window_right, variant, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        return (None,) * (3 + len(ctx.params))
    dq, dk, dv = torch.ops.fattn.attention_backward(dout, q, k, v, out, lse, *ctx.params)
    return (dq, dk, dv) + (None,) * len(ctx.params)


attention.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("fattn: double backward (a gradient of fattn's gradients, create_graph=True) is not "
                              "supported")


def _setup_nothing(ctx, inputs, output):
    pass


attention_backward.register_autograd(_no_double_backward, setup_context=_setup_nothing)
