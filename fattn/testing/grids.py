"""The benchmark grids (../shared/BENCH.md) as lists of points, and the FLOP count of a point.

A point's mode says what is timed: fwd (the forward), bwd (the backward alone, gradients of a forward done once) or
fwdbwd (both).  seeds: fp16, D=64, S=512, (B, H) in (1,8) (4,8) (4,16) (8,16).  fa3: 16384 tokens, hidden 2048, D in 64/128/256,
S 512..16384 (the FlashAttention-3 paper's grid).  decode: Sq=1, B=8, H=32, D=128, Sk 2048/8192/32768.  cpu: fp32,
B=1, H=4, D 64/128, S 512..2048, always on the CPU.  seeds, fa3 and cpu run causal and non-causal; decode
non-causal unless asked.
"""

POINT_KEYS = ("grid", "B", "H", "H_kv", "Sq", "Sk", "D", "causal", "dtype", "mode")
MODES = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}  # what is timed, and its FLOPs as a multiple of the forward's


def point(grid, B, H, Sq, D, *, Sk=None, H_kv=None, causal=False, dtype="fp16", device="cuda", mode="fwd"):
    return {"grid": grid, "B": B, "H": H, "H_kv": H if H_kv is None else H_kv, "Sq": Sq, "Sk": Sq if Sk is None else Sk,
            "D": D, "causal": causal, "dtype": dtype, "device": device, "mode": mode}


def seeds(mode, dtype, device, both=True):
    return [point("seeds", B, H, 512, 64, causal=c, dtype=dtype, device=device)
            for B, H in ((1, 8), (4, 8), (4, 16), (8, 16)) for c in (False, mode)]


def fa3(mode, dtype, device, both=True):
    return [point("fa3", 16384 // S, 2048 // D, S, D, causal=c, dtype=dtype, device=device)
            for D in (64, 128, 256) for S in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, mode)]


def decode(mode, dtype, device, both=False):
    return [point("decode", 8, 32, 1, 128, Sk=sk, causal=c, dtype=dtype, device=device)
            for sk in (2048, 8192, 32768) for c in ((False, mode) if both else (False,))]


def cpu(mode, dtype, device, both=True):
    return [point("cpu", 1, 4, S, D, causal=c, dtype=dtype, device="cpu")
            for D in (64, 128) for S in (512, 1024, 2048) for c in (False, mode)]


GRIDS = {"seeds": seeds, "fa3": fa3, "decode": decode, "cpu": cpu}


def describe(p):
    h = f"H={p['H']}" + (f"/kv{p['H_kv']}" if p["H_kv"] != p["H"] else "")
    s = f"S={p['Sq']}" if p["Sq"] == p["Sk"] else f"Sq={p['Sq']} Sk={p['Sk']}"
    return f"B={p['B']} {h} {s} D={p['D']}"


def visible_pairs(sq, sk, causal, window=None):
    """The (query, key) pairs a call computes.  Without a window: Sq Sk, halved when causal with Sq = Sk (BENCH.md's
    count); causal with Sq != Sk, the pairs its alignment leaves (top-left for True / "top_left": query i sees keys
    j <= i; "bottom_right": j <= i + Sk - Sq).  With a window, counted row by row around each query's position (i
    when causal is top-left, else i + Sk - Sq: fattn.testing.reference.visible's rule), causal forcing right = 0."""
    if not window:
        if not causal:
            return sq * sk
        if sq == sk:
            return sq * sk / 2
        if causal == "bottom_right":  # query i sees keys up to i + Sk - Sq
            return sq * (sk - sq) + sq * (sq + 1) // 2 if sq <= sk else sk * (sk + 1) // 2
        return sq * (sq + 1) // 2 if sq <= sk else sk * (sk + 1) // 2 + (sq - sk) * sk
    left, right = window
    right = 0 if causal else right
    shift = 0 if causal in (True, "top_left") else sk - sq
    total = 0
    for i in range(sq):
        lo = max(i + shift - left, 0) if left >= 0 else 0
        hi = min(i + shift + right, sk - 1) if right >= 0 else sk - 1
        total += max(hi - lo + 1, 0)
    return total


def flops(p):
    """Forward FLOPs 4 B H D times the visible pairs (visible_pairs: Sq Sk, halved when causal with Sq = Sk);
    backward 2.5x that, forward + backward 3.5x (BENCH.md's count)."""
    return 4 * p["B"] * p["H"] * p["D"] * visible_pairs(p["Sq"], p["Sk"], p["causal"]) * MODES[p.get("mode", "fwd")]


def key(p):
    """The identity of a point in result rows (rows from before modes existed are forward rows)."""
    return tuple(str(p.get(k, "fwd")) if k == "mode" else str(p[k]) for k in POINT_KEYS)
