"""Running one configuration: inputs, the correctness gate, and timing through the C harness (fattn._C.time_forward).

The CPU family runs on NumPy arrays; the GPU families on torch CUDA tensors (torch is needed to tune on the GPU, as
for the benchmarks; fattn itself never imports it).  The reference is float64 NumPy.
"""
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _C, _frameworks, _rtc
from .._api import _CAUSAL

ROUNDING = {"fp32": 2.0 ** -23, "fp16": 2.0 ** -10, "bf16": 2.0 ** -7}


def reference(q, k, v, causal, scale=None):
    """float64 attention of (B, H, Sq, D) / (B, H_kv, Sk, D) arrays; rows that see no key give 0."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    sq, sk = s.shape[-2:]
    if causal:
        off = 0 if causal in (True, "top_left") else sk - sq
        visible = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + off
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return np.where(den > 0, (p @ v) / np.where(den > 0, den, 1.0), 0.0)


class Runner:
    """Runs configurations of `space` on `problem`: gate() then time().  reps/warmup: the timing harness's."""

    GATE_SHAPES = [(1, 2, 113, 257, "bottom_right"), (2, 1, 200, 77, "top_left"), (1, 3, 1, 300, False),
                   (1, 2, 130, 130, False)]

    def __init__(self, problem, space, reps=20, warmup=3, seed=0):
        self.problem, self.space, self.reps, self.warmup = problem, space, reps, warmup
        self.rng = np.random.default_rng(seed)
        self.gpu = problem.device == "cuda"
        if self.gpu:
            try:
                import torch
            except ImportError:
                raise RuntimeError("tuning on the GPU needs torch for the test arrays (pip install torch)") from None
            self.torch = torch
            self.arch = _C.device_info(0)[1]
            if _frameworks._torch_raw_stream is None:
                _frameworks.register_torch(_C)
        self.variant = "cpu" if not self.gpu else space.family
        p = problem
        self.inputs = self._make((p.b, p.h, p.sq, p.d), (p.b, p.kv_heads, p.sk, p.d))
        self.gate_cases = []
        for b, h, sq, sk, causal in self.GATE_SHAPES:
            hk = h if p.kv_heads == p.h else 1
            self.gate_cases.append((self._make((b, h, sq, p.d), (b, hk, sk, p.d)), causal))
        self._indices = {}
        self._baseline = {}   # gate case -> (float64 reference, max|default - ref|, eps), computed once
        self._arrays = {}     # (q shape, kv shape) -> inputs, made once

    def arrays(self, qshape, kshape):
        """Inputs of these shapes, made once per runner."""
        key = (tuple(qshape), tuple(kshape))
        if key not in self._arrays:
            self._arrays[key] = self._make(qshape, kshape)
        return self._arrays[key]

    def _make(self, qshape, kshape):
        arrays = [self.rng.standard_normal(s).astype(np.float32) for s in (qshape, kshape, kshape)]
        if not self.gpu:
            dt = {"fp32": np.float32, "fp16": np.float16}.get(self.problem.dtype)
            if dt is None:
                raise ValueError("dtype: the CPU family tunes fp32 or fp16 (NumPy has no bfloat16)")
            q, k, v = (a.astype(dt) for a in arrays)
            return q, k, v, np.empty_like(q)
        t = self.torch
        dt = {"fp16": t.float16, "bf16": t.bfloat16, "fp32": t.float32}[self.problem.dtype]
        q, k, v = (t.from_numpy(a).to(device="cuda", dtype=dt) for a in arrays)
        return q, k, v, t.empty_like(q)

    def _host64(self, x):
        if self.gpu:
            return x.double().cpu().numpy()
        return x.astype(np.float64)

    # ---- configurations -> what fattn._C takes ----
    def prepare(self, cfgs, jobs=8):
        """Compiles the run-time configurations among cfgs in parallel (GPU); returns {key: error or None}."""
        out = {}
        todo = [c for c in cfgs if self.space.key(c) not in self._indices]

        def one(cfg):
            try:
                return cfg, self.config_arg(cfg), None
            except Exception as e:  # a compile failure is a result, recorded by the caller
                return cfg, None, f"{type(e).__name__}: {e}"

        if self.gpu and todo:
            with ThreadPoolExecutor(jobs) as pool:
                results = list(pool.map(one, todo))
        else:
            results = [one(c) for c in todo]
        for cfg, _, err in results:
            out[self.space.key(cfg)] = err
        return out

    def config_arg(self, cfg):
        key = self.space.key(cfg)
        if key not in self._indices:
            if self.space.family == "cpu":
                self._indices[key] = (cfg["br"], cfg["bc"], cfg["threads"])
            else:
                self._indices[key] = _rtc.v2_index(self.space.full(cfg, self.problem), self.problem.dtype, self.arch)
        return self._indices[key]

    # ---- running ----
    def _stream(self):
        return _frameworks.current_stream("torch", 0) if self.gpu else None

    def _forward(self, arrays, causal, arg):
        q, k, v, out = arrays
        _C.forward(q, k, v, out, None, _CAUSAL[causal], None, 0, self.variant, self._stream(), arg)
        if self.gpu:
            self.torch.cuda.synchronize()
        return out

    def gate(self, cfg, default_cfg):
        """None if cfg passes the accuracy rule on every gate case (and the problem itself is run once), else why:
        max|out - ref| <= 2 * max|out_default - ref| + one rounding step at max|ref|.  The reference and the
        default's error are computed on the first call: default_cfg is the same for every call of a runner."""
        arg = self.config_arg(cfg)
        for i, (arrays, causal) in enumerate(self.gate_cases):
            q, k, v, _ = arrays
            if i not in self._baseline:
                ref = reference(self._host64(q), self._host64(k), self._host64(v), causal)
                base = self._host64(self._forward(arrays, causal, self.config_arg(default_cfg)))
                eps = ROUNDING[self.problem.dtype] * max(1.0, np.abs(ref).max())
                self._baseline[i] = (ref, np.abs(base - ref).max(), eps)
            ref, err0, eps = self._baseline[i]
            got = self._host64(self._forward(arrays, causal, arg))
            if not np.isfinite(got).all():
                return f"non-finite output at {tuple(q.shape)} causal={causal}"
            err = np.abs(got - ref).max()
            if err > 2 * err0 + eps:
                return f"max|err| {err:.3g} > 2 * {err0:.3g} + {eps:.3g} at {tuple(q.shape)} causal={causal}"
        self._forward(self.inputs, self.problem.causal, arg)  # launches at the tuned shape too
        return None

    def time(self, cfg, arrays=None, causal=None):
        """(p50, p90) microseconds of cfg on the problem (or on `arrays`), L2 flushed on the GPU."""
        q, k, v, out = arrays or self.inputs
        causal = self.problem.causal if causal is None else causal
        p50, p90, _ = _C.time_forward(q, k, v, out, None, _CAUSAL[causal], None, 0, self.variant, self._stream(),
                                      self.config_arg(cfg), self.reps, self.warmup, self.gpu)
        return p50, p90
