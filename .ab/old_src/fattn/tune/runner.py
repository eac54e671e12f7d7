"""Running one configuration: inputs, the correctness gate and timing, through fattn.testing's reference, accuracy
rule and timer.  The CPU family runs on NumPy arrays; the GPU families on torch CUDA tensors (torch is needed to tune
on the GPU, as for the benchmarks; fattn itself never imports it)."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .. import _C, _frameworks, _rtc
from .._api import CAUSAL
from ..testing import accuracy, reference, timer
from .space import stream_of


class Runner:
    """Runs configurations of `space` on `problem`: gate() then time().  reps/warmup: the timer's."""

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
            if not _frameworks.torch_ready:
                _frameworks.register_torch(_C)
        self.variant = space.family
        self.inputs = problem.arrays(self.rng)
        self.gate_cases = []
        for b, h, sq, sk, causal in self.GATE_SHAPES:
            hk = h if problem.kv_heads == problem.h else 1
            self.gate_cases.append((self._make((b, h, sq, problem.d), (b, hk, sk, problem.d)), causal))
        self._indices = {}
        self._baseline = {}   # gate case -> (float64 reference, max|default - ref|), computed once
        self._arrays = {}     # (q shape, kv shape) -> inputs, made once

    def arrays(self, qshape, kshape):
        """Inputs of these shapes, made once per runner."""
        key = (tuple(qshape), tuple(kshape))
        if key not in self._arrays:
            self._arrays[key] = self._make(qshape, kshape)
        return self._arrays[key]

    def _make(self, qshape, kshape):
        import dataclasses

        b, h, sq, d = qshape
        p = dataclasses.replace(self.problem, b=b, h=h, sq=sq, sk=kshape[2], d=d, h_kv=kshape[1])
        return p.arrays(self.rng)

    def default(self):
        return self.space.default(self.problem, self.inputs)

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
    def _forward(self, arrays, causal, arg):
        q, k, v, out = arrays
        _C._dev.forward(q, k, v, out, causal=CAUSAL[causal], variant=self.variant, stream=stream_of(arrays),
                        config=arg)
        if self.gpu:
            self.torch.cuda.synchronize()
        return out

    def _host64(self, x):
        return x.double().cpu().numpy() if self.gpu else x.astype(np.float64)

    def gate(self, cfg, default_cfg):
        """None if cfg passes the accuracy rule on every gate case (and the problem itself is run once), else why.
        The plain same-dtype implementation the rule compares against is the default config; its error is computed
        on the first call (default_cfg is the same for every call of a runner)."""
        arg = self.config_arg(cfg)
        for i, (arrays, causal) in enumerate(self.gate_cases):
            q, k, v, _ = arrays
            if i not in self._baseline:
                ref, _ = reference.attention(self._host64(q), self._host64(k), self._host64(v), causal)
                base = self._host64(self._forward(arrays, causal, self.config_arg(default_cfg)))
                self._baseline[i] = (ref, np.abs(base - ref).max())
            ref, err0 = self._baseline[i]
            got = self._host64(self._forward(arrays, causal, arg))
            if not np.isfinite(got).all():
                return f"non-finite output at {tuple(q.shape)} causal={causal}"
            why = accuracy.verdict(np.abs(got - ref).max(), err0, self.problem.dtype, np.abs(ref).max(), q.shape[-1])
            if why:
                return f"{why} at {tuple(q.shape)} causal={causal}"
        self._forward(self.inputs, self.problem.causal, arg)  # launches at the tuned shape too
        return None

    def call(self, cfg, arrays=None, causal=None):
        """fn() running cfg once on the problem (or on `arrays`)."""
        arrays = arrays or self.inputs
        causal = self.problem.causal if causal is None else causal
        arg = self.config_arg(cfg)
        q, k, v, out = arrays
        stream = stream_of(arrays)
        return lambda: _C._dev.forward(q, k, v, out, causal=CAUSAL[causal], variant=self.variant, stream=stream,
                                       config=arg)

    def samples(self, fn):
        """Microsecond samples of fn with the one timer (L2 flushed on the GPU)."""
        return (timer.cuda if self.gpu else timer.cpu)(fn, self.reps, self.warmup)

    def time(self, cfg, arrays=None, causal=None):
        """(p50, p90) microseconds of cfg on the problem (or on `arrays`)."""
        return timer.summarize(self.samples(self.call(cfg, arrays, causal)))
