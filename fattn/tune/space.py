"""Config spaces of fattn's tunable kernel families, each with a keep() rule that prunes configurations that cannot
launch before anything is compiled or run.  The rules are the C side's (fattn._C._dev.check_config) and the default
is what the C planner chooses for the problem (fattn._C._dev.plan): nothing here restates them.

A configuration is a plain dict; `Problem` is the attention call it is tuned for.
"""
import dataclasses
import itertools
import os

from .. import _C
from .._api import CAUSAL
from ..testing import grids

SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on sm_90 (sm_80: 163 KB; keep() is told the device's)


@dataclasses.dataclass(frozen=True)
class Problem:
    b: int
    h: int
    sq: int
    sk: int
    d: int
    causal: object = False       # False, "top_left", "bottom_right"
    dtype: str = "fp16"
    device: str = "cuda"         # "cuda" or "cpu"
    h_kv: int = 0                # 0: same as h

    @property
    def kv_heads(self):
        return self.h_kv or self.h

    def flops(self):
        return 4 * self.b * self.h * self.d * grids.visible_pairs(self.sq, self.sk, self.causal)

    def label(self):
        c = {False: "", True: "-causal", "top_left": "-causal", "bottom_right": "-causal_br"}[self.causal]
        return f"{self.device}-{self.dtype}-b{self.b}h{self.h}sq{self.sq}sk{self.sk}d{self.d}{c}"

    def arrays(self, rng=None):
        """(q, k, v, out) of this problem's shapes with random values: NumPy on the CPU, torch on CUDA."""
        import numpy as np

        rng = rng or np.random.default_rng(0)
        shapes = [(self.b, self.h, self.sq, self.d), (self.b, self.kv_heads, self.sk, self.d)]
        arrays = [rng.standard_normal(s).astype(np.float32) for s in (shapes[0], shapes[1], shapes[1])]
        if self.device == "cpu":
            dt = {"fp32": np.float32, "fp16": np.float16}.get(self.dtype)
            if dt is None:
                raise ValueError("dtype: the CPU family tunes fp32 or fp16 (NumPy has no bfloat16)")
            q, k, v = (a.astype(dt) for a in arrays)
            return q, k, v, np.empty_like(q)
        import torch

        dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]
        q, k, v = (torch.from_numpy(a).to(device="cuda", dtype=dt) for a in arrays)
        return q, k, v, torch.empty_like(q)


def stream_of(arrays):
    """The current CUDA stream handle for torch arrays, None for NumPy."""
    if type(arrays[0]).__module__.split(".")[0] != "torch":
        return None
    from .. import _frameworks

    if not _frameworks.torch_ready:
        _frameworks.register_torch(_C)
    return _frameworks.current_stream("torch", arrays[0].get_device())


class Space:
    """params: name -> candidate values (in order, so that a mutation can step to a neighbour)."""
    family = None
    params = {}

    def keep(self, cfg, problem):
        """(True, "") if cfg can launch for problem, else (False, reason)."""
        raise NotImplementedError

    def from_plan(self, plan):
        """The space's config dict of a plan dict (fattn._C._dev.plan)."""
        raise NotImplementedError

    def default(self, problem, arrays=None):
        """The configuration fattn's planner chooses for problem (arrays: its inputs, made if not given)."""
        q, k, v, out = arrays or problem.arrays()
        plan = _C._dev.plan(q, k, v, out, causal=CAUSAL[problem.causal], variant=self.family, stream=stream_of((q,)))
        return self.from_plan(plan)

    def key(self, cfg):
        return tuple(cfg[p] for p in self.params)

    def all(self, problem):
        """Every configuration of the space as (cfg, kept, reason)."""
        for values in itertools.product(*self.params.values()):
            cfg = dict(zip(self.params, values))
            ok, why = self.keep(cfg, problem)
            yield cfg, ok, why


class V2Space(Space):
    """v2 (kernels/sm80): warps per block, 16-row tiles per warp (Br = 16 * mt * warps), keys per block (Bc), K/V
    pipeline stages.  The head-dim bucket DP follows from the problem."""
    family = "v2"
    params = {"warps": [2, 4, 8], "mt": [1, 2, 4], "bc": [16, 32, 48, 64, 96, 128], "stages": [1, 2]}
    FIELDS = ("dp", "warps", "mt", "bc", "stages")

    def __init__(self, smem_limit=SMEM_LIMIT):
        self.smem_limit = smem_limit

    def full(self, cfg, problem):
        return dict(cfg, dp=_C._dev.head_dim_bucket(problem.d))

    def keep(self, cfg, problem):
        full = self.full(cfg, problem)
        why = _C._dev.check_config("v2", tuple(full[f] for f in self.FIELDS), problem.d, problem.dtype,
                                   self.smem_limit)
        return why is None, why or ""

    def from_plan(self, plan):
        c = _C._dev.configs("v2")[plan["config"]]
        return {p: c[p] for p in self.params}


class CPUSpace(Space):
    """The CPU backend (csrc/cpu_attn.c): query rows per task (Br), keys per block (Bc), OpenMP threads (0: all)."""
    family = "cpu"

    def __init__(self):
        n = os.cpu_count() or 1
        self.params = {"br": [16, 32, 48, 64, 96, 128, 192, 256], "bc": [32, 64, 128, 256, 512],
                       "threads": sorted({0, 1, n} | ({n // 2} if n > 2 else set()))}

    def keep(self, cfg, problem):
        why = _C._dev.check_config("cpu", (cfg["br"], cfg["bc"], cfg["threads"]), problem.d, problem.dtype, 0)
        if why:
            return False, why
        if cfg["threads"] > (os.cpu_count() or 1):
            return False, "more threads than CPUs"
        if cfg["br"] * cfg["bc"] * 4 > (8 << 20):
            return False, "score block over 8 MB of scratch"
        if cfg["br"] > 4 * max(problem.sq, 16):
            return False, "Br far above the query length"
        return True, ""

    def from_plan(self, plan):
        br, bc, threads = plan["config"]
        return {"br": br, "bc": bc, "threads": threads}


def space_for(problem, family=None):
    family = family or ("cpu" if problem.device == "cpu" else "v2")
    if family == "cpu":
        if problem.device != "cpu":
            raise ValueError("family: the cpu family runs on the CPU (--device cpu)")
        return CPUSpace()
    if family == "v2":
        if problem.device != "cuda":
            raise ValueError("family: v2 runs on a CUDA GPU (--device cuda)")
        return V2Space()
    raise ValueError(f"family: unknown kernel family {family!r}; choose v2 or cpu")
