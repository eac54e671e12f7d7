"""fattn for JAX: ``fattn.jax.attention(q, k, v, ...)``, differentiable through ``jax.custom_vjp`` with fattn's own
forward and backward kernels.

    import fattn.jax
    out = fattn.jax.attention(q, k, v, causal=True)                    # q, k, v: jax.Array (B, H, S, D)
    dq, dk, dv = jax.grad(lambda q, k, v: fattn.jax.attention(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)

The kernels read JAX's buffers in place through DLPack (as NumPy arrays on the CPU, CuPy arrays on a GPU) and write
fresh buffers that become the results: nothing is ever written into a JAX array.  Runs eagerly, outside jax.jit and
jax.vmap and JAX's other transformations for now (a call under a trace raises; jit support goes through XLA's FFI,
a later step); one device per call (a sharded array is refused).
"""
import functools
import sys

import jax
import numpy as np

from . import _api, _args

__all__ = ["attention"]


_TRANSFORMS = ("jax.jit, jax.vmap, jax.checkpoint / remat, jax.lax.scan and grad of grad (jax.hessian, "
               "jax.jacrev)")
_DTYPES = {"cpu": ("float16", "float32"), "gpu": ("float16", "bfloat16", "float32")}


def _type_name(x):
    kind = type(x)
    return f"{kind.__module__.split('.')[0]}.{kind.__name__}" if kind.__module__ != "builtins" else kind.__name__


def _device(x, name):
    """The one device of a concrete jax.Array (or a clear error naming the argument)."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name}: fattn.jax.attention runs eagerly, outside JAX's transformations ({_TRANSFORMS}) "
                        "for now (got a traced value); call it outside the transformation")
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name}: expected a jax.Array, got {_type_name(x)}")
    devices = x.devices()
    if len(devices) != 1:
        raise ValueError(f"{name}: a jax.Array spread over {len(devices)} devices; fattn.jax.attention takes arrays "
                         "on one device (jax.device_put it onto one)")
    return next(iter(devices))


def _platform_name(platform):
    """JAX's platform in the user's words (JAX says gpu where fattn and torch say cuda)."""
    return "cuda" if platform == "gpu" else platform


def _device_name(d):
    return f"{_platform_name(d.platform)}:{d.id}"


def _host(x, name):
    """A NumPy (CPU) or CuPy (GPU) view of a concrete jax.Array, read in place."""
    platform = _device(x, name).platform
    if platform not in _DTYPES:
        raise ValueError(f"{name}: fattn runs on cpu or cuda devices, not {platform}")
    if str(x.dtype) not in _DTYPES[platform]:
        if platform == "cpu" and x.dtype == jax.numpy.bfloat16:
            raise TypeError(f"{name}: bfloat16 is not taken on the CPU (fattn.jax reads JAX's CPU buffers as NumPy "
                            "arrays, which DLPack cannot give in bfloat16); use float32 or float16 there, or a GPU")
        raise TypeError(f"{name}: dtype {x.dtype} is not supported on {_platform_name(platform)}; use "
                        f"{', '.join(_DTYPES[platform][:-1])} or {_DTYPES[platform][-1]}")
    try:
        x.block_until_ready()  # fattn runs on its own stream: the producer must be done
    except Exception:
        if x.is_deleted():
            raise ValueError(f"{name}: the array was deleted or donated") from None
        raise
    if platform == "cpu":
        return np.from_dlpack(x)
    try:
        import cupy
    except ImportError:
        raise RuntimeError("fattn.jax on a GPU reads JAX's buffers through CuPy; install cupy") from None
    return cupy.from_dlpack(x)


def _jax(x, like):
    """A fattn result (NumPy or CuPy, freshly allocated) as a jax.Array on the device of the input `like`."""
    if type(x).__module__.split(".")[0] == "cupy":
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
        return jax.device_put(jax.dlpack.from_dlpack(x), next(iter(like.devices())))
    return jax.device_put(x, next(iter(like.devices())))


def _optional(x, name):
    return None if x is None else _host(x, name)


def _forward(q, k, v, alibi, sinks, opts):
    qh, kh, vh = _host(q, "q"), _host(k, "k"), _host(v, "v")
    out, lse = _api.attention(qh, kh, vh, return_lse=True, alibi_slopes=_optional(alibi, "alibi_slopes"),
                              sinks=_optional(sinks, "sinks"), **dict(opts))
    return out, lse


# opts: the keyword arguments that are not arrays (causal, scale, layout, window, softcap) as a hashable tuple of
# pairs; alibi_slopes is an array argument whose cotangent is zero (the slopes are constants); sinks' cotangent is
# dsinks (csrc/sinks.h), from the same backward call.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, alibi, sinks, opts):
    return _jax(_forward(q, k, v, alibi, sinks, opts)[0], q)


def _attention_fwd(q, k, v, alibi, sinks, opts):
    out, lse = _forward(q, k, v, alibi, sinks, opts)
    out_j, lse_j = _jax(out, q), _jax(lse, q)
    return out_j, (q, k, v, alibi, sinks, out_j, lse_j)


def _attention_bwd(opts, saved, g):
    if isinstance(g, jax.core.Tracer):
        raise NotImplementedError("fattn.jax.attention: its gradient runs eagerly, so batched or higher-order "
                                  "differentiation (jax.jacrev, jax.hessian, grad of grad) is not supported for now")
    q, k, v, alibi, sinks, out, lse = saved
    grads = _api.attention_backward(_host(g, "dout"), _host(q, "q"), _host(k, "k"), _host(v, "v"), _host(out, "out"),
                                    _host(lse, "lse"), alibi_slopes=_optional(alibi, "alibi_slopes"),
                                    sinks=_optional(sinks, "sinks"), **dict(opts))
    dalibi = None if alibi is None else jax.numpy.zeros_like(alibi)
    dsinks = None if sinks is None else _jax(grads[3], sinks)
    return tuple(_jax(g, x) for g, x in zip(grads[:3], (q, k, v))) + (dalibi, dsinks)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal=False, scale=None, layout="bhsd", window=(-1, -1), softcap=0.0, alibi_slopes=None,
              sinks=None):
    """Scaled dot-product attention of jax.Arrays, differentiable in q, k, v and sinks (jax.grad / jax.vjp).
    Arguments as for :func:`fattn.attention` (alibi_slopes a float32 jax.Array, whose gradient is zero: the slopes
    are constants; sinks a float32 (H,) jax.Array of attention-sink logits); float16 or float32 on the CPU (not
    bfloat16: a TypeError says so), float16 or bfloat16 on a GPU."""
    for name, value in (("scale", scale), ("softcap", softcap)):
        if isinstance(value, jax.core.Tracer):
            raise TypeError(f"{name}: a traced value; fattn reads {name} as a constant (no gradient reaches it): "
                            "pass a Python float")
    _, scale, window, softcap, _ = _args.call_options(causal, scale, window, softcap, None)
    _args.layout_code(layout)
    # every array on one device, named in the user's words (JAX's own errors name none)
    first = None
    for name, x in (("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is None or isinstance(x, jax.core.Tracer):  # (traced: the kernels' intake raises, naming it)
            continue
        d = _device(x, name)
        if first is None:
            first = (name, d)
        elif d != first[1]:
            raise ValueError(f"{name}: on {_device_name(d)} but {first[0]} is on {_device_name(first[1])}; all "
                             "arrays must be on one device")
    opts = (("causal", causal), ("scale", scale), ("layout", layout), ("window", window), ("softcap", softcap))
    return _attention(q, k, v, alibi_slopes, sinks, opts)
