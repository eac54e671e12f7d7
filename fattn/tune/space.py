"""Config spaces of fattn's tunable kernel families, each with a keep() rule that prunes configurations that cannot
launch (shared memory, registers, divisibility) before anything is compiled or run.

A configuration is a plain dict; `Problem` is the attention call it is tuned for.
"""
import dataclasses
import itertools
import os

from .. import _C

SMEM_LIMIT = 227 * 1024          # opt-in shared memory per block on sm_90 (sm_80: 163 KB; keep() is told the device's)
V2_ACC_LIMIT = 192               # accumulator registers per thread above which ptxas spills in the loop (-Xptxas -v, sm_90: 192 keeps at most 16 bytes of stack)


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
        f = 4 * self.b * self.h * self.sq * self.sk * self.d
        return f / 2 if self.causal else f

    def label(self):
        c = {False: "", True: "-causal", "top_left": "-causal", "bottom_right": "-causal_br"}[self.causal]
        return f"{self.device}-{self.dtype}-b{self.b}h{self.h}sq{self.sq}sk{self.sk}d{self.d}{c}"


class Space:
    """params: name -> candidate values (in order, so that a mutation can step to a neighbour)."""
    family = None
    params = {}

    def keep(self, cfg, problem):
        """(True, "") if cfg can launch for problem, else (False, reason)."""
        raise NotImplementedError

    def default(self, problem):
        raise NotImplementedError

    def key(self, cfg):
        return tuple(cfg[p] for p in self.params)

    def all(self, problem):
        """Every configuration of the space as (cfg, kept, reason)."""
        for values in itertools.product(*self.params.values()):
            cfg = dict(zip(self.params, values))
            ok, why = self.keep(cfg, problem)
            yield cfg, ok, why


def v2_dp(d):
    return 64 if d <= 64 else 128 if d <= 128 else 256


class V2Space(Space):
    """v2 (kernels/v2_mma.cu): warps per block, 16-row tiles per warp (Br = 16 * mt * warps), keys per block (Bc),
    K/V pipeline stages.  The head-dim bucket DP follows from the problem."""
    family = "v2"
    params = {"warps": [2, 4, 8], "mt": [1, 2, 4], "bc": [16, 32, 48, 64, 96, 128], "stages": [1, 2]}

    def __init__(self, smem_limit=SMEM_LIMIT):
        self.smem_limit = smem_limit

    def full(self, cfg, problem):
        return dict(cfg, dp=v2_dp(problem.d))

    def keep(self, cfg, problem):
        dp = v2_dp(problem.d)
        if problem.dtype not in ("fp16", "bf16"):
            return False, "v2 runs fp16 and bf16 only"
        threads, chunks = cfg["warps"] * 32, dp // 8
        br = 16 * cfg["mt"] * cfg["warps"]
        if cfg["bc"] % 16:
            return False, "bc must be a multiple of 16"
        if threads % chunks or (br * chunks) % threads or (cfg["bc"] * chunks) % threads:
            return False, "tile rows do not split evenly over the threads"
        smem = (br + 2 * cfg["stages"] * cfg["bc"]) * dp * 2
        if smem > self.smem_limit:
            return False, f"shared memory {smem} B > {self.smem_limit} B"
        acc = cfg["mt"] * (dp // 8 * 4 + cfg["bc"] // 8 * 4)
        q_regs = cfg["mt"] * dp // 16 * 4  # Q's fragments, kept in registers when they fit (kernels/v2_mma.cu)
        if cfg["mt"] * dp <= 128 and acc + q_regs <= 200:
            acc += q_regs
        if acc > V2_ACC_LIMIT:
            return False, f"{acc} accumulator registers per thread would spill (> {V2_ACC_LIMIT})"
        return True, ""

    def default(self, problem):
        """The configuration v2 runs by default at this problem (the small-grid one where the launcher picks it)."""
        dp = v2_dp(problem.d)
        rows = {c[0]: c for c in _C.v2_configs()}
        bucket = {64: 0, 128: 1, 256: 2}[dp]
        c = rows[bucket]
        br = 16 * c[3] * c[2]
        sms = _C.device_info(0)[2] if problem.device == "cuda" else 132
        if -(-problem.sq // br) * problem.b * problem.h < sms or problem.sq <= 64:
            c = rows[3 + bucket]
        else:  # the launcher's V2_RULES, first match
            for dp_, warps, mt, bc, stages, causal, lo, hi in _C.v2_rules():
                if dp_ == dp and causal == bool(problem.causal) and lo <= problem.sk <= hi:
                    return {"warps": warps, "mt": mt, "bc": bc, "stages": stages}
        return {"warps": c[2], "mt": c[3], "bc": c[4], "stages": c[5]}


class CPUSpace(Space):
    """The CPU backend (csrc/cpu_attn.c): query rows per task (Br), keys per block (Bc), OpenMP threads (0: all)."""
    family = "cpu"

    def __init__(self):
        n = os.cpu_count() or 1
        self.params = {"br": [16, 32, 48, 64, 96, 128, 192, 256], "bc": [32, 64, 128, 256, 512],
                       "threads": sorted({0, 1, n} | ({n // 2} if n > 2 else set()))}

    def keep(self, cfg, problem):
        if cfg["bc"] % 16:
            return False, "bc must be a multiple of 16"
        if cfg["threads"] > (os.cpu_count() or 1):
            return False, "more threads than CPUs"
        if cfg["br"] * cfg["bc"] * 4 > (8 << 20):
            return False, "score block over 8 MB of scratch"
        if cfg["br"] > 4 * max(problem.sq, 16):
            return False, "Br far above the query length"
        return True, ""

    def default(self, problem):
        br, bc, threads = _C.cpu_config()
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
