"""Validate-then-time runs of fattn variants beside torch's SDPA backends (the engine of `python -m fattn.bench`).

Every implementation is validated first at each point -- its output against the float64 reference on the same
inputs (a slice of batch 0 and as many heads as fit for large points) under the accuracy rule, the plain same-dtype
implementation being torch SDPA's math backend on that slice -- then timed with the one timer (timer.py).  Needs
PyTorch (a benchmark dependency only).  Implementations: "fattn:<variant>", "torch:<backend>" (flash, efficient,
cudnn, math; cpu on the CPU), "cublas:gemm" (the two products as unfused cuBLAS GEMMs, not validated).
"""
import contextlib
import datetime
import os
import platform
import subprocess
import sys
import warnings

import fattn
import fattn._frameworks

from . import accuracy, grids, reference, timer

TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "math": "MATH"}
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
REF_LIMIT = 2 ** 28  # B*H*Sq*Sk above this: the reference covers batch 0 and as many heads as fit
FIXED_TOL = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}  # rows measured before the accuracy rule, or without torch math
COLUMNS = ["grid", "B", "H", "H_kv", "Sq", "Sk", "D", "causal", "dtype", "mode", "impl", "p50_us", "p90_us", "tflops",
           "max_abs_err", "tol", "ratio_vs_best_torch", "ratio_noise"]


class Skip(Exception):
    """An implementation that cannot run a point (reported as a note, never a row)."""


def make_inputs(p, seed=0):
    import torch

    g = torch.Generator(device=p["device"]).manual_seed(seed)
    dt = getattr(torch, DTYPES[p["dtype"]])

    def randn(h, s):
        return torch.randn((p["B"], h, s, p["D"]), generator=g, device=p["device"], dtype=torch.float32).to(dt)

    return randn(p["H"], p["Sq"]), randn(p["H_kv"], p["Sk"]), randn(p["H_kv"], p["Sk"])


def ref_slice(p):
    """(batches, heads) the float64 reference covers (whole GQA groups)."""
    if p["B"] * p["H"] * p["Sq"] * p["Sk"] <= REF_LIMIT:
        return p["B"], p["H"]
    group = p["H"] // p["H_kv"]
    return 1, group * max(1, min(p["H_kv"], REF_LIMIT // max(1, p["Sq"] * p["Sk"] * group)))


def _mask(sq, sk, causal, device):
    import torch

    return torch.from_numpy(reference.visible(sq, sk, causal)).to(device)


def torch_sdpa(q, k, v, causal):
    """torch SDPA with an explicit mask where its is_causal (top-left, square) does not say it; (fn, needs_mask)."""
    import torch.nn.functional as F

    sq, sk = q.shape[2], k.shape[2]
    need_mask = bool(causal) and sq != sk  # square: both alignments are torch's is_causal
    kw = {"attn_mask": _mask(sq, sk, causal, q.device) if need_mask else None,
          "is_causal": bool(causal) and not need_mask}
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    return (lambda: F.scaled_dot_product_attention(q, k, v, **kw)), need_mask


DET = "-det"


def make_impl(impl, q, k, v, causal, mode="fwd", dout=None):
    """(fn, context) for one implementation: fn() computes what the mode times -- the output (fwd), or the gradients
    (dq, dk, dv) for dout: of a forward done once here (bwd), or forward and backward (fwdbwd); context() wraps its
    calls."""
    kind, _, name = impl.partition(":")
    det = name.endswith(DET)  # "v3-det": the variant's backward in deterministic mode
    if det and mode != "bwd":
        raise Skip("a -det variant times the backward alone (--mode bwd)")
    if mode == "fwd":
        return make_forward(impl, q, k, v, causal)
    import torch

    if kind == "cublas":
        raise Skip("the gemm baseline has no backward")
    if kind == "fattn" and mode == "bwd":
        name = name.removesuffix(DET)
        out, lse = fattn.attention(q, k, v, causal=causal, variant=name, return_lse=True)
        return (lambda: fattn.attention_backward(dout, q, k, v, out, lse, causal=causal, variant=name,
                                                 deterministic=det)), contextlib.nullcontext
    leafs = [x.detach().requires_grad_() for x in (q, k, v)]
    fwd, ctx = make_forward(impl, *leafs, causal)
    if mode == "bwd":
        with ctx(), torch.enable_grad():
            out = fwd()

        def grads():
            return torch.autograd.grad(out, leafs, dout, retain_graph=True)
        return grads, ctx

    def both():
        with torch.enable_grad():
            return torch.autograd.grad(fwd(), leafs, dout)
    return both, ctx


def make_forward(impl, q, k, v, causal):
    """(fn, context): fn() computes impl's output."""
    kind, _, name = impl.partition(":")
    if kind == "fattn":
        return (lambda: fattn.attention(q, k, v, causal=causal, variant=name)), contextlib.nullcontext
    if kind == "cublas":
        return gemm_baseline(q, k, v), contextlib.nullcontext
    fn, need_mask = torch_sdpa(q, k, v, causal)
    if need_mask and name in ("flash", "cudnn"):
        raise Skip(f"needs an explicit attn_mask (causal {causal}, Sq != Sk), which {name} does not take")
    if name == "cpu":
        return fn, contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, TORCH_BACKENDS[name], None)
    if backend is None:
        raise Skip(f"this torch has no SDPBackend.{TORCH_BACKENDS[name]}")
    return fn, (lambda: sdpa_kernel([backend]))


def cublas_path():
    """The libcublas torch has loaded (after one matmul), read from this process's memory map."""
    import torch

    a = torch.ones(8, 8, device="cuda", dtype=torch.float16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return path
    raise Skip("no libcublas is loaded in this process")


def gemm_baseline(q, k, v):
    """fn() running S = Q K^T, O = S V as two cuBLAS batched GEMMs (no softmax): the production-GEMM baseline.
    Its output is not attention, so the row is not validated; its FLOPs are always the full (non-causal) count."""
    import torch

    if q.dtype == torch.float32 or q.shape[1] != k.shape[1]:
        raise Skip("the gemm baseline takes fp16/bf16 with as many kv heads as heads")
    path = cublas_path()
    s = q.new_empty(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    o = torch.empty_like(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dev = q.get_device()
    if not fattn._frameworks.torch_ready:  # torch tensors then take the lean path, as in attention()
        fattn._frameworks.register_torch(fattn._C)

    def fn():
        fattn._C._dev.gemm_baseline(q, k, v, s, o, fattn._frameworks.current_stream("torch", dev), path)
        return o
    return fn


def _sh(*cmd, cwd=None):
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def collect_meta(device, timer_name="events", command=None):
    """The stamp of a run: GPU (or CPU model), driver, CUDA, torch, cuDNN, git SHA, date, host, command."""
    import torch

    if device == "cuda":
        gpu = torch.cuda.get_device_name()
    else:
        model = platform.processor() or "unknown"
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        gpu = f"cpu: {model}"
    driver = _sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(fattn.__file__)))  # the checkout holding fattn/
    sha = _sh("git", "rev-parse", "HEAD", cwd=repo)
    if sha and _sh("git", "status", "--porcelain", cwd=repo):
        sha += "-dirty"
    # A copy of the tree sent to the GPU machine is stamped by whoever sent it: its .git, if any, may be stale.
    sha = os.environ.get("FATTN_GIT_SHA") or sha
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"gpu": gpu, "driver": driver.splitlines()[0] if driver else None, "cuda": torch.version.cuda,
            "torch": torch.__version__, "cudnn": cudnn, "git_sha": sha,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "fattn": fattn.__version__, "command": command or " ".join(sys.argv),
            "device": device, "timer": timer_name, "flush": timer.flush_mode() if device == "cuda" and timer_name == "events" else None,
            "cpu_threads": torch.get_num_threads(), "notes": []}


def validate(p, q, k, v, nb, nh, dout=None):
    """(ref, bound): the float64 reference on the slice, and the accuracy rule's bound there -- of the output, or in
    the gradient modes of (dq, dk, dv) (a tuple of bounds, 3x rule)."""
    import torch

    if p.get("mode", "fwd") != "fwd":
        return validate_grads(p, q, k, v, nb, nh, dout)
    ref, _ = reference.attention(q, k, v, p["causal"], batches=nb, heads=nh)
    qs, ks, vs = q[:nb, :nh], k[:nb], v[:nb]
    fn, _ = torch_sdpa(qs, ks, vs, p["causal"])
    with contextlib.suppress(Exception):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            lowp = fn()
        err_lowp = (lowp.double().nan_to_num(0.0) - ref).abs().max().item() if ref.numel() else 0.0
        return ref, accuracy.bound(err_lowp, p["dtype"], ref.abs().max().item() if ref.numel() else 0.0, p["D"])
    return ref, FIXED_TOL[p["dtype"]]  # no math backend here


def validate_grads(p, q, k, v, nb, nh, dout):
    """(refs, bounds) of (dq, dk, dv) on the slice (whole GQA groups: nh is a multiple of H / H_kv)."""
    nkv = nh * p["H_kv"] // p["H"]
    qs, ks, vs, gs = q[:nb, :nh], k[:nb, :nkv], v[:nb, :nkv], dout[:nb, :nh]
    refs = reference.gradients(qs, ks, vs, gs, p["causal"])
    try:
        lows = accuracy.sdpa_lowp_gradients(qs, ks, vs, gs, p["causal"])
    except Exception:  # noqa: BLE001  no same-dtype backward here
        return refs, tuple(FIXED_TOL[p["dtype"]] * max(1.0, r.abs().max().item()) for r in refs)
    bounds = tuple(accuracy.bound((lo.double() - r).abs().max().item() if r.numel() else 0.0, p["dtype"],
                                  r.abs().max().item() if r.numel() else 0.0, p["D"], 3.0) for lo, r in zip(lows, refs))
    return refs, bounds


def slice_error(out, ref, tol, nb, nh):
    """(max error, its bound) of an implementation's result on the reference slice; in the gradient modes the
    gradient furthest past (or nearest to) its bound decides."""
    if not isinstance(ref, tuple):
        return ((out[:nb, :nh].double() - ref).abs().max().item() if ref.numel() else 0.0), tol
    pairs = []
    for g, r, t in zip(out, ref, tol):
        e = (g[:nb, :r.shape[1]].double() - r).abs().max().item() if r.numel() else 0.0
        pairs.append((e, t))
    failing = [x for x in pairs if not x[0] <= x[1]]  # NaN fails
    return failing[0] if failing else max(pairs, key=lambda x: x[0] / max(x[1], 1e-30))


def bad(r):
    """'!' for a row that failed validation (the GEMM baseline computes no attention: nothing to validate)."""
    if r["impl"].startswith("cublas:"):
        return ""
    err, tol = r.get("max_abs_err"), r.get("tol") or FIXED_TOL[r["dtype"]]
    return "" if err is not None and err <= tol else "!"


def _prepare(impl, p, q, k, v, nb, nh, ref, tol, cuda, note, dout=None):
    """(fn, context, max error on the reference slice) of impl at point p after one call, or None when it cannot run
    there (noted, never a crash)."""
    import torch

    caught = []
    try:
        fn, ctx = make_impl(impl, q, k, v, p["causal"], p.get("mode", "fwd"), dout)
        with ctx(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
            if cuda:
                torch.cuda.synchronize()
    except Skip as e:
        note(f"{impl} skipped at {grids.describe(p)} causal={p['causal']}: {e}")
        return None
    except Exception as e:     # unsupported shape / dtype / out of memory
        why = "; ".join(str(w.message).splitlines()[0] for w in caught[:2])
        note(f"{impl} unavailable at {grids.describe(p)} causal={p['causal']} {p['dtype']}: "
             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" + (f" ({why})" if why else ""))
        if cuda:
            torch.cuda.empty_cache()
        return None
    if impl.startswith("cublas:"):
        return fn, ctx, None, tol
    err, bound = slice_error(out, ref, tol, nb, nh)
    return fn, ctx, err, bound


def _samples(prepared, time_fn, rounds, reps, warmup):
    """{impl: [microsecond samples of each round]}: `rounds` rounds of `reps` calls each, every impl once per round,
    the order reversed every other round, so that drift and what the one before leaves behind hit them alike."""
    out = {i: [] for i in prepared}
    names = list(prepared)
    for r in range(rounds):
        for i in names if r % 2 == 0 else names[::-1]:
            fn, ctx = prepared[i][:2]
            with ctx():
                out[i].append(time_fn(fn, reps, warmup if r == 0 else min(warmup, 1)))
    return out


def _ratio_noise(fattn_rounds, torch_rounds):
    """The spread of fattn's ratio to the best torch backend over rounds (interquartile range over the median), or
    None with fewer than 3 rounds: what a later comparison with these rows must allow for."""
    if len(fattn_rounds) < 3 or not torch_rounds:
        return None
    med = lambda xs: timer.percentile(xs, 0.5)  # noqa: E731
    ratios = [min(med(t[r]) for t in torch_rounds) / med(f) for r, f in enumerate(fattn_rounds)]
    return (timer.percentile(ratios, 0.75) - timer.percentile(ratios, 0.25)) / med(ratios)


def run(points, impls, *, reps=None, warmup=None, rounds=None, timer_name="events", seed=0, quiet=False,
        command=None):
    """Validate and time each implementation at each point -> (meta, rows).  Each point's implementations are timed
    in `rounds` interleaved rounds of `reps` calls (default 1 round on a GPU, 3 on the CPU, whose 2-core timings
    swing by tens of percent from one second to the next); p50 and p90 are over all samples."""
    import torch

    device = points[0]["device"] if points else "cpu"
    cuda = device == "cuda"
    reps = reps or (50 if cuda else 10)
    rounds = rounds or (1 if cuda else 3)
    warmup = (10 if cuda else 2) if warmup is None else warmup
    meta = collect_meta(device, timer_name if cuda else "perf_counter", command)
    meta.update(reps=reps, warmup=warmup, rounds=rounds)
    time_fn = timer.cpu if not cuda else timer.cuda_batch if timer_name == "batch" else timer.cuda
    rows = []

    def note(msg):
        meta["notes"].append(msg)
        if not quiet:
            print("note: " + msg, file=sys.stderr)

    with torch.no_grad():
        for n, p in enumerate(points, 1):
            if not quiet:
                print(f"[{n}/{len(points)}] {p['grid']} {grids.describe(p)} {p['dtype']} {p['causal'] or 'non-causal'}",
                      file=sys.stderr, flush=True)
            q, k, v = make_inputs(p, seed)
            dout = make_inputs(dict(p, H_kv=p["H"], Sk=p["Sq"]), seed + 1)[0] if p.get("mode", "fwd") != "fwd" else None
            nb, nh = ref_slice(p)
            if (nb, nh) != (p["B"], p["H"]):
                note(f"{grids.describe(p)}: reference on batch 0, heads 0..{nh - 1} only")
            ref, tol = validate(p, q, k, v, nb, nh, dout)
            prepared = {}
            for impl in impls:
                got = _prepare(impl, p, q, k, v, nb, nh, ref, tol, cuda, note, dout)
                if got:
                    prepared[impl] = got
            point_rows, by_round = [], _samples(prepared, time_fn, rounds, reps, warmup)
            for impl, per_round in by_round.items():
                p50, p90 = timer.summarize([x for xs in per_round for x in xs])
                err, bound = prepared[impl][2], prepared[impl][3]
                row = {key: p.get(key, "fwd") for key in grids.POINT_KEYS}
                work = grids.flops(dict(p, causal=False) if impl.startswith("cublas:") else p)
                row.update(impl=impl, p50_us=p50, p90_us=p90, tflops=work / (p50 * 1e-6) / 1e12,
                           max_abs_err=err, tol=bound, ratio_vs_best_torch=None, ratio_noise=None)
                if bad(row):
                    print(f"WARNING: {impl} fails validation at {grids.describe(p)} causal={p['causal']} {p['dtype']}: "
                          f"max_abs_err {err:.3g} > {bound:.3g}", file=sys.stderr)
                point_rows.append(row)
            good_torch = [r["impl"] for r in point_rows if r["impl"].startswith("torch:") and not bad(r)]
            torch_p50 = [r["p50_us"] for r in point_rows if r["impl"] in good_torch]
            for r in point_rows:
                if torch_p50 and r["impl"].startswith("fattn:"):
                    r["ratio_vs_best_torch"] = min(torch_p50) / r["p50_us"]
                    r["ratio_noise"] = _ratio_noise(by_round[r["impl"]], [by_round[t] for t in good_torch])
            rows += point_rows
            del q, k, v, dout, ref, prepared
            if cuda:
                torch.cuda.empty_cache()
    return meta, rows
