"""The reference: which keys a query sees (the rule of csrc/mask.h, restated once here for Python) and attention in
float64 from the same low-precision inputs, for NumPy arrays or torch tensors (computed where they live).

    visible(sq, sk, causal=False, window=None)     -> bool array (sq, sk)
    attention(q, k, v, causal=False, scale=None, window=None, softcap=0, alibi=None) -> (out, lse) in float64
    gradients(q, k, v, dout, causal=False, scale=None, window=None, softcap=0, alibi=None) -> (dq, dk, dv)
    alibi_bias(alibi, sq, sk, rows=None)           -> float64 NumPy array (B or 1, H, rows, sk)

A softcap c > 0 maps each score s (after the scale) to c tanh(s / c); ALiBi's slopes (H,) or (B, H) then add
-slope * |i + sk - sq - j| (flash-attention's ALiBi, bottom-right positions whatever the mask's alignment).

Tensors are (B, H, S, D) with H a multiple of H_kv (grouped-query attention).  A row that sees no key gives out 0
and LSE -inf.
"""
import math

REF_CHUNK = 2 ** 24  # elements of one float64 score block (bounds the reference's memory)


def alignment(causal):
    """True when the call is bottom-right aligned: 'bottom_right', or no causal mask (a window alone is
    flash-attention's bottom-right); False for True / 'top_left' (torch SDPA's is_causal)."""
    if causal not in (False, None, True, "top_left", "bottom_right"):
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}")
    return causal not in (True, "top_left")


def visible(sq, sk, causal=False, window=None, rows=None):
    """Boolean NumPy array (rows, sk): query row i sees key j iff pos(i) - left <= j <= pos(i) + right, with
    pos(i) = i + (sk - sq if bottom-right aligned else 0), left / right < 0 unbounded, right = 0 when causal.
    rows: (first, end) query rows (default all)."""
    import numpy as np

    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    i0, i1 = rows or (0, sq)
    pos = np.arange(i0, i1)[:, None] + (sk - sq if alignment(causal) else 0)
    j = np.arange(sk)[None, :]
    ok = np.ones((i1 - i0, sk), dtype=bool)
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    return ok


def alibi_bias(alibi, sq, sk, rows=None):
    """-slope |pos(i) - j| with pos(i) = i + sk - sq, float64 NumPy (B or 1, H, rows, sk), for slopes (H,) or (B, H)
    (NumPy or torch, any device).  rows: (first, end) query rows (default all)."""
    import numpy as np

    slopes = np.asarray(alibi.detach().cpu() if hasattr(alibi, "detach") else alibi, dtype=np.float64)
    slopes = slopes.reshape((1,) * (2 - slopes.ndim) + slopes.shape)
    i0, i1 = rows or (0, sq)
    dist = np.abs(np.arange(i0, i1)[:, None] + (sk - sq) - np.arange(sk)[None, :]).astype(np.float64)
    return -slopes[:, :, None, None] * dist


class _Ops:
    """The few array operations the reference needs, for NumPy or torch."""

    def __init__(self, like):
        self.torch = type(like).__module__.split(".")[0] == "torch"
        if self.torch:
            import torch

            self.lib, self.device = torch, like.device
        else:
            import numpy as np

            self.lib, self.device = np, None

    def f64(self, x):
        return x.double() if self.torch else self.lib.asarray(x, dtype=self.lib.float64)

    def repeat_heads(self, x, n):
        return x.repeat_interleave(n, dim=1) if self.torch else self.lib.repeat(x, n, axis=1)

    def t(self, x):
        return x.transpose(-1, -2) if self.torch else self.lib.swapaxes(x, -1, -2)

    def mask(self, m):
        return self.lib.from_numpy(m).to(self.device) if self.torch else m

    def zeros(self, shape, fill=0.0):
        if self.torch:
            return self.lib.full(shape, fill, dtype=self.lib.float64, device=self.device)
        return self.lib.full(shape, fill, dtype=self.lib.float64)

    def amax(self, x):
        return x.amax(dim=-1, keepdim=True) if self.torch else x.max(axis=-1, keepdims=True)

    def sum(self, x):
        return x.sum(dim=-1, keepdim=True) if self.torch else x.sum(axis=-1, keepdims=True)

    def tanh(self, x):
        return x.tanh() if self.torch else self.lib.tanh(x)

    def bias(self, alibi, nb, nh, sq, sk, rows):
        """ALiBi's bias for batches [:nb] and heads [:nh], float64 where the scores live."""
        x = alibi_bias(alibi, sq, sk, rows)[:nb, :nh]
        return self.lib.from_numpy(x).to(self.device) if self.torch else x


def attention(q, k, v, causal=False, scale=None, window=None, batches=None, heads=None, softcap=0.0, alibi=None):
    """(out, lse) in float64 for batches [:batches] and heads [:heads] (default all), in blocks of query rows."""
    ops = _Ops(q)
    lib = ops.lib
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    nb, nh = batches or b, heads or h
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q64 = ops.f64(q[:nb, :nh])
    k64 = ops.repeat_heads(ops.f64(k[:nb]), h // hk)[:, :nh]
    v64 = ops.repeat_heads(ops.f64(v[:nb]), h // hk)[:, :nh]
    out = ops.zeros((nb, nh, sq, d))
    lse = ops.zeros((nb, nh, sq), -math.inf)
    step = max(1, REF_CHUNK // max(1, nb * nh * sk))
    for i0 in range(0, sq, step):
        i1 = min(sq, i0 + step)
        if sk == 0:
            continue
        s = (q64[:, :, i0:i1] @ ops.t(k64)) * scale
        if softcap:
            s = softcap * ops.tanh(s / softcap)
        if alibi is not None:
            s = s + ops.bias(alibi, nb, nh, sq, sk, (i0, i1))
        s = lib.where(ops.mask(visible(sq, sk, causal, window, (i0, i1))), s, -math.inf)
        m = ops.amax(s)
        m = lib.where(m == -math.inf, 0.0, m)  # a row that sees nothing: exp(-inf) = 0, not NaN
        p = lib.exp(s - m)
        den = ops.sum(p)
        live = den > 0
        out[:, :, i0:i1] = lib.where(live, (p @ v64) / lib.where(live, den, 1.0), 0.0)
        lse[:, :, i0:i1] = lib.where(live, m + lib.log(lib.where(live, den, 1.0)), -math.inf)[..., 0]
    return out, lse


def gradients(q, k, v, dout, causal=False, scale=None, window=None, softcap=0.0, alibi=None):
    """(dq, dk, dv) in float64 of attention(q, k, v) for the output gradient dout, from the formulas (P recomputed
    exactly; dk and dv summed over each group's query heads); rows that see no key get zero gradients."""
    ops = _Ops(q)
    lib = ops.lib
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q64, g64 = ops.f64(q), ops.f64(dout)
    k64 = ops.repeat_heads(ops.f64(k), h // hk)
    v64 = ops.repeat_heads(ops.f64(v), h // hk)
    dq = ops.zeros((b, h, sq, d))
    dk = ops.zeros((b, h, sk, d))
    dv = ops.zeros((b, h, sk, d))
    step = max(1, REF_CHUNK // max(1, b * h * sk))
    for i0 in range(0, sq if sk else 0, step):
        i1 = min(sq, i0 + step)
        s = (q64[:, :, i0:i1] @ ops.t(k64)) * scale
        t = ops.tanh(s / softcap) if softcap else None
        if softcap:
            s = softcap * t
        if alibi is not None:
            s = s + ops.bias(alibi, b, h, sq, sk, (i0, i1))
        s = lib.where(ops.mask(visible(sq, sk, causal, window, (i0, i1))), s, -math.inf)
        m = ops.amax(s)
        m = lib.where(m == -math.inf, 0.0, m)
        p = lib.exp(s - m)
        den = ops.sum(p)
        p = p / lib.where(den > 0, den, 1.0)
        g = g64[:, :, i0:i1]
        o = p @ v64
        dp = g @ ops.t(v64)
        ds = p * (dp - ops.sum(g * o))
        if softcap:
            ds = ds * (1.0 - t * t)
        dq[:, :, i0:i1] = scale * (ds @ k64)
        dk = dk + scale * (ops.t(ds) @ q64[:, :, i0:i1])
        dv = dv + ops.t(p) @ g
    if hk != h:
        dk = dk.reshape(b, hk, h // hk, sk, d).sum(2) if ops.torch else dk.reshape(b, hk, h // hk, sk, d).sum(axis=2)
        dv = dv.reshape(b, hk, h // hk, sk, d).sum(2) if ops.torch else dv.reshape(b, hk, h // hk, sk, d).sum(axis=2)
    return dq, dk, dv
