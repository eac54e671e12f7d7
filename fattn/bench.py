"""Benchmark fattn's variants against torch's scaled_dot_product_attention backends.

Every point is validated first (max |error| against a float64 softmax reference on the same device), then timed:
on CUDA with CUDA events, L2 flushed (a 256 MB buffer zeroed) before each repeat, p50 and p90 of the repeats; on
the CPU with time.perf_counter_ns.  FLOPs are 4*B*H*Sq*Sk*D, halved when causal.  Needs PyTorch (a benchmark
dependency only; fattn itself never imports it).

    python -m fattn.bench                                        # 1,8,512,64 on the default device
    python -m fattn.bench --shape 4,16,2048,128 --causal --dtype bf16
    python -m fattn.bench --shape 1,4,64,64 --sk 200 --causal-mode bottom_right --causal
    python -m fattn.bench --shape 8,32,1,128 --sk 8192 --hkv 8    # GQA decode step
    python -m fattn.bench --grid fa3 --json fa3.json --md fa3.md --csv fa3.csv
    python -m fattn.bench --grid decode --both-causal --causal-mode bottom_right
    python -m fattn.bench --grid cpu --reps 3

Grids: seeds (fp16, D=64, S=512, (B,H) in (1,8) (4,8) (4,16) (8,16)); fa3 (16384 tokens, hidden 2048, D in
64/128/256, S 512..16384); decode (Sq=1, B=8, H=32, D=128, Sk 2048/8192/32768); cpu (fp32, B=1, H=4, D 64/128,
S 512..2048, always on the CPU).  seeds, fa3 and cpu run causal and non-causal; decode non-causal.
fattn:X / best torch = fastest torch p50 (of the backends that passed validation) / fattn:X's p50, >1 = fattn faster.
--shape, --sk and --hkv apply to --shape runs only.
Exit status: 0, or 1 when a fattn variant fails validation (or nothing could run), 2 for usage errors.
"""
import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings

import fattn
import fattn._frameworks

GRIDS = ("seeds", "fa3", "decode", "cpu")
TORCH_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "math": "MATH"}
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
TOL = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}   # max |err| above this fails validation
REF_LIMIT = 2 ** 28     # B*H*Sq*Sk above this: the reference covers batch 0 and as many heads as fit
REF_CHUNK = 2 ** 24     # elements of one float64 score block of the reference
FLUSH_BYTES = 256 << 20
COLUMNS = ["grid", "B", "H", "H_kv", "Sq", "Sk", "D", "causal", "dtype", "impl", "p50_us", "p90_us", "tflops",
           "max_abs_err", "ratio_vs_best_torch"]
POINT_KEYS = COLUMNS[:9]


class Skip(Exception):
    """An implementation that cannot run a point (reported as a note, never a row)."""


# ---- points and grids ----------------------------------------------------------------------------------------

def point(grid, B, H, Sq, D, *, Sk=None, H_kv=None, causal=False, dtype="fp16", device="cuda"):
    return {"grid": grid, "B": B, "H": H, "H_kv": H if H_kv is None else H_kv, "Sq": Sq, "Sk": Sq if Sk is None else Sk,
            "D": D, "causal": causal, "dtype": dtype, "device": device}


def grid_seeds(mode, dtype, device, both=True):
    return [point("seeds", B, H, 512, 64, causal=c, dtype=dtype, device=device)
            for B, H in ((1, 8), (4, 8), (4, 16), (8, 16)) for c in (False, mode)]


def grid_fa3(mode, dtype, device, both=True):
    return [point("fa3", 16384 // S, 2048 // D, S, D, causal=c, dtype=dtype, device=device)
            for D in (64, 128, 256) for S in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, mode)]


def grid_decode(mode, dtype, device, both=False):
    return [point("decode", 8, 32, 1, 128, Sk=sk, causal=c, dtype=dtype, device=device)
            for sk in (2048, 8192, 32768) for c in ((False, mode) if both else (False,))]


def grid_cpu(mode, dtype, device, both=True):
    return [point("cpu", 1, 4, S, D, causal=c, dtype=dtype, device="cpu")
            for D in (64, 128) for S in (512, 1024, 2048) for c in (False, mode)]


GRID_FUNCS = {"seeds": grid_seeds, "fa3": grid_fa3, "decode": grid_decode, "cpu": grid_cpu}


def describe(p):
    h = f"H={p['H']}" + (f"/kv{p['H_kv']}" if p["H_kv"] != p["H"] else "")
    s = f"S={p['Sq']}" if p["Sq"] == p["Sk"] else f"Sq={p['Sq']} Sk={p['Sk']}"
    return f"B={p['B']} {h} {s} D={p['D']}"


def flops(p):
    f = 4 * p["B"] * p["H"] * p["Sq"] * p["Sk"] * p["D"]
    return f / 2 if p["causal"] else f


# ---- inputs, reference, implementations -------------------------------------------------------------------------

def make_inputs(p, seed=0):
    import torch

    g = torch.Generator(device=p["device"]).manual_seed(seed)
    dt = getattr(torch, DTYPES[p["dtype"]])

    def randn(h, s):
        return torch.randn((p["B"], h, s, p["D"]), generator=g, device=p["device"], dtype=torch.float32).to(dt)

    return randn(p["H"], p["Sq"]), randn(p["H_kv"], p["Sk"]), randn(p["H_kv"], p["Sk"])


def causal_mask(sq, sk, causal, device, rows=None):
    """Boolean (rows, sk): query i sees key j iff j <= i + offset."""
    import torch

    offset = sk - sq if causal == "bottom_right" else 0
    i = torch.arange(*(rows or (0, sq)), device=device).unsqueeze(1)
    return torch.arange(sk, device=device).unsqueeze(0) <= i + offset


def ref_slice(p):
    """(batches, heads) the float64 reference covers."""
    if p["B"] * p["H"] * p["Sq"] * p["Sk"] <= REF_LIMIT:
        return p["B"], p["H"]
    return 1, max(1, min(p["H"], REF_LIMIT // max(1, p["Sq"] * p["Sk"])))


def reference(q, k, v, causal, nb, nh):
    """float64 softmax(q k^T / sqrt(D)) v for batches [:nb], heads [:nh], in blocks of query rows."""
    import torch

    sq, d, sk = q.shape[2], q.shape[3], k.shape[2]
    kv_head = torch.arange(nh, device=q.device) // (q.shape[1] // k.shape[1])
    q64 = q[:nb, :nh].double()
    k64, v64 = (x[:nb].index_select(1, kv_head).double() for x in (k, v))
    out = torch.zeros((nb, nh, sq, d), dtype=torch.float64, device=q.device)
    step = max(1, REF_CHUNK // max(1, nb * nh * sk))
    for i0 in range(0, sq, step):
        i1 = min(sq, i0 + step)
        s = (q64[:, :, i0:i1] @ k64.transpose(-1, -2)) / math.sqrt(d)
        if causal:
            s = s.masked_fill(~causal_mask(sq, sk, causal, q.device, (i0, i1)), float("-inf"))
        out[:, :, i0:i1] = torch.softmax(s, dim=-1).nan_to_num(0.0) @ v64   # fully masked rows -> 0
    return out


def make_impl(impl, q, k, v, causal):
    """(fn, context) for one implementation: fn() computes the output; context() wraps its calls."""
    import torch
    import torch.nn.functional as F

    kind, _, name = impl.partition(":")
    if kind == "fattn":
        return (lambda: fattn.attention(q, k, v, causal=causal, variant=name)), contextlib.nullcontext
    if kind == "cublas":
        return gemm_baseline(q, k, v), contextlib.nullcontext
    sq, sk = q.shape[2], k.shape[2]
    need_mask = bool(causal) and sq != sk          # torch's is_causal is top-left and square-only for some backends
    if need_mask and name in ("flash", "cudnn"):
        raise Skip(f"needs an explicit attn_mask (causal {causal}, Sq != Sk), which {name} does not take")
    kw = {"attn_mask": causal_mask(sq, sk, causal, q.device) if need_mask else None,
          "is_causal": bool(causal) and not need_mask}
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    fn = lambda: F.scaled_dot_product_attention(q, k, v, **kw)    # noqa: E731
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
    if fattn._frameworks._torch_raw_stream is None:  # torch tensors then take the lean path, as in attention()
        fattn._frameworks.register_torch(fattn._C)

    def fn():
        fattn._C.gemm_baseline(q, k, v, s, o, fattn._frameworks.current_stream("torch", dev), path)
        return o
    return fn


# ---- timing -------------------------------------------------------------------------------------------------

def percentile(xs, q):
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_cuda(fn, reps, warmup, flush):
    """(p50, p90) microseconds from CUDA events, the L2 flushed (outside the timed region) before each repeat."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    return percentile(us, 0.5), percentile(us, 0.9)


def time_batch(fn, reps, warmup, flush=None, batch=20):
    """(p50, p90) microseconds per call of back-to-back batches: CUDA events around `batch` calls, no L2 flush.
    The end-to-end cost of a call (Python to kernel done): where the host path is slower than the kernel, the
    GPU idles between launches and this shows it."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(3, reps // batch)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / batch)
    return percentile(samples, 0.5), percentile(samples, 0.9)


def time_triton(fn, reps, warmup, flush):
    """(p50, p90) microseconds from triton.testing.do_bench (its own L2 flush and repeat count)."""
    from triton.testing import do_bench

    p50, p90 = do_bench(fn, quantiles=[0.5, 0.9], return_mode="median")
    return p50 * 1e3, p90 * 1e3


def time_cpu(fn, reps, warmup, flush=None):
    """(p50, p90) microseconds of wall time per call."""
    for _ in range(warmup):
        fn()
    us = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        us.append((time.perf_counter_ns() - t0) / 1e3)
    return percentile(us, 0.5), percentile(us, 0.9)


# ---- the run ------------------------------------------------------------------------------------------------

def _sh(*cmd, cwd=None):
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def collect_meta(device, timer="events", command=None):
    import torch

    if device == "cuda":
        gpu = torch.cuda.get_device_name()
    else:
        model = platform.processor() or "unknown"
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        gpu = f"cpu: {model}"
    driver = _sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(fattn.__file__)))
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
            "device": device, "timer": timer, "cpu_threads": torch.get_num_threads(), "notes": []}


def run(points, impls, *, reps=None, warmup=None, timer="events", seed=0, quiet=False, command=None):
    """Validate and time each implementation (e.g. "fattn:v1", "torch:cudnn") at each point -> (meta, rows)."""
    import torch

    device = points[0]["device"] if points else "cpu"
    cuda = device == "cuda"
    reps = reps or (50 if cuda else 10)
    warmup = (10 if cuda else 2) if warmup is None else warmup
    meta = collect_meta(device, timer if cuda else "perf_counter", command)
    meta.update(reps=reps, warmup=warmup)
    timer_fn = time_cpu if not cuda else {"triton": time_triton, "batch": time_batch}.get(timer, time_cuda)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if cuda else None
    rows = []

    def note(msg):
        meta["notes"].append(msg)
        if not quiet:
            print("note: " + msg, file=sys.stderr)

    with torch.no_grad():
        for n, p in enumerate(points, 1):
            if not quiet:
                print(f"[{n}/{len(points)}] {p['grid']} {describe(p)} {p['dtype']} {p['causal'] or 'non-causal'}",
                      file=sys.stderr, flush=True)
            q, k, v = make_inputs(p, seed)
            nb, nh = ref_slice(p)
            if (nb, nh) != (p["B"], p["H"]):
                note(f"{describe(p)}: reference on batch 0, heads 0..{nh - 1} only")
            ref = reference(q, k, v, p["causal"], nb, nh)
            point_rows = []
            for impl in impls:
                caught = []
                try:
                    fn, ctx = make_impl(impl, q, k, v, p["causal"])
                    with ctx(), warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        out = fn()
                        if cuda:
                            torch.cuda.synchronize()
                except Skip as e:
                    note(f"{impl} skipped at {describe(p)} causal={p['causal']}: {e}")
                    continue
                except Exception as e:     # unsupported shape / dtype / out of memory: no row, never a crash
                    why = "; ".join(str(w.message).splitlines()[0] for w in caught[:2])
                    note(f"{impl} unavailable at {describe(p)} causal={p['causal']} {p['dtype']}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" + (f" ({why})" if why else ""))
                    if cuda:
                        torch.cuda.empty_cache()
                    continue
                gemm = impl.startswith("cublas:")
                err = None if gemm else (out[:nb, :nh].double() - ref).abs().max().item() if ref.numel() else 0.0
                del out
                with ctx():
                    p50, p90 = timer_fn(fn, reps, warmup, flush)
                row = {key: p[key] for key in POINT_KEYS}
                work = flops(dict(p, causal=False) if gemm else p)
                row.update(impl=impl, p50_us=p50, p90_us=p90, tflops=work / (p50 * 1e-6) / 1e12,
                           max_abs_err=err, ratio_vs_best_torch=None)
                if not gemm and not err <= TOL[p["dtype"]]:
                    print(f"WARNING: {impl} fails validation at {describe(p)} causal={p['causal']} {p['dtype']}: "
                          f"max_abs_err {err:.3g} > {TOL[p['dtype']]}", file=sys.stderr)
                point_rows.append(row)
            torch_p50 = [r["p50_us"] for r in point_rows if r["impl"].startswith("torch:") and not _bad(r)]
            for r in point_rows:
                if torch_p50 and r["impl"].startswith("fattn:"):
                    r["ratio_vs_best_torch"] = min(torch_p50) / r["p50_us"]
            rows += point_rows
            del q, k, v, ref
            if cuda:
                torch.cuda.empty_cache()
    return meta, rows


# ---- output -------------------------------------------------------------------------------------------------

def pivot(rows):
    """[(grid, [(point_row, {impl: row})])], impls in first-seen order, fattn impls."""
    impls, grids = [], {}
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
        pts = grids.setdefault(r["grid"], {})
        pts.setdefault(tuple(str(r[key]) for key in POINT_KEYS), (r, {}))[1][r["impl"]] = r
    return impls, [i for i in impls if i.startswith("fattn:")], [(g, list(p.values())) for g, p in grids.items()]


def _shape_cells(r):
    return [describe(r), str(r["causal"] or "-"), r["dtype"]]


def _bad(r):
    if r["impl"].startswith("cublas:"):  # the GEMM baseline computes no attention: nothing to validate
        return ""
    return "" if r["max_abs_err"] <= TOL[r["dtype"]] else "!"


def format_table(rows):
    """Aligned text: one line per point, p50 us / TFLOP/s per impl, each fattn impl's ratio to the best torch."""
    impls, fimpls, grids = pivot(rows)
    lines = []
    for grid, pts in grids:
        table = [["shape", "causal", "dtype"] + [f"{i} us/TF" for i in impls] + [f"{i}/torch" for i in fimpls]]
        for first, by in pts:
            cells = _shape_cells(first)
            cells += [f"{by[i]['p50_us']:.1f}/{by[i]['tflops']:.3g}{_bad(by[i])}" if i in by else "-" for i in impls]
            cells += [f"{by[i]['ratio_vs_best_torch']:.2f}x" if by.get(i, {}).get("ratio_vs_best_torch") else "-"
                      for i in fimpls]
            table.append(cells)
        widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
        lines.append(f"== {grid} ==")
        lines += ["  ".join(c.rjust(w) if j > 2 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
                  for row in table]
    if any(_bad(r) for r in rows):
        lines.append("! = failed validation (max_abs_err above tolerance)")
    return "\n".join(lines)


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [{c: _finite(r[c]) for c in COLUMNS} for r in rows]}, f, indent=1)
        f.write("\n")


def write_csv(path, meta, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(["false" if r[c] is False else "" if r[c] is None else r[c] for c in COLUMNS])


def write_md(path, meta, rows):
    impls, fimpls, grids = pivot(rows)
    out = ["# fattn benchmark", ""]
    out += [f"- **{k}**: {'`' + str(v) + '`' if k == 'command' else 'n/a' if v is None else v}"
            for k, v in meta.items() if k != "notes"]
    out += [""] + [f"> note: {n}" for n in meta["notes"]] + ([""] if meta["notes"] else [])
    for grid, pts in grids:
        head = ["shape", "causal", "dtype"]
        for i in impls:
            head += [f"{i} p50 us", f"{i} TFLOP/s"]
        head += [f"{i} / best torch" for i in fimpls]
        out += [f"## {grid}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for first, by in pts:
            cells = _shape_cells(first)
            for i in impls:
                cells += [f"{by[i]['p50_us']:.1f}{_bad(by[i])}", f"{by[i]['tflops']:.3g}"] if i in by else ["-", "-"]
            cells += [f"{by[i]['ratio_vs_best_torch']:.2f}x" if by.get(i, {}).get("ratio_vs_best_torch") else "-"
                      for i in fimpls]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))


# ---- command line -------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fattn.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1,8,512,64", help="B,H,S,D (default 1,8,512,64)")
    ap.add_argument("--sk", type=int, help="key length (default S)")
    ap.add_argument("--hkv", type=int, help="kv heads, dividing H (default H)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--causal-mode", choices=("top_left", "bottom_right"), help="alignment (default top_left)")
    ap.add_argument("--both-causal", action="store_true", help="run every point causal and non-causal")
    ap.add_argument("--dtype", choices=tuple(DTYPES), help="default fp16 on cuda, fp32 on cpu")
    ap.add_argument("--device", choices=("cpu", "cuda"), help="default cuda if fattn.cuda_available()")
    ap.add_argument("--variants", help="fattn variants, comma-separated (default all)")
    ap.add_argument("--torch-backends", help="flash,efficient,cudnn,math on cuda; cpu on cpu; 'none' for no torch")
    ap.add_argument("--grid", choices=GRIDS, help="run a named grid instead of --shape")
    for out in ("--json", "--csv", "--md"):
        ap.add_argument(out, metavar="PATH")
    ap.add_argument("--gemm", action="store_true",
                    help="add cublas:gemm, the two unfused batched GEMMs of the same shape through cuBLAS (cuda)")
    ap.add_argument("--plot", metavar="PATH", help="PNG: TFLOP/s vs sequence length, or latency bars (needs matplotlib)")
    ap.add_argument("--reps", type=int, help="timed repeats (default 50 on cuda, 10 on cpu)")
    ap.add_argument("--warmup", type=int, help="untimed calls first (default 10 on cuda, 2 on cpu)")
    ap.add_argument("--timer", choices=("events", "triton", "batch"), default="events",
                    help="cuda timer: events around each call with the L2 flushed (default), "
                         "triton.testing.do_bench, or batch: events around back-to-back calls (end-to-end latency)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress or notes on stderr")
    args = ap.parse_args(argv)
    try:
        args.shape = [int(x) for x in args.shape.split(",")]
        assert len(args.shape) == 4 and min(args.shape) > 0
    except (ValueError, AssertionError):
        ap.error(f"--shape: expected B,H,S,D positive integers, got {args.shape!r}")
    if args.hkv is not None and (args.hkv <= 0 or args.shape[1] % args.hkv):
        ap.error(f"--hkv {args.hkv} must divide H = {args.shape[1]}")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be >= 1")
    args.device = "cpu" if args.grid == "cpu" else args.device or ("cuda" if fattn.cuda_available() else "cpu")
    args.error = ap.error
    return args


def build_points(args):
    mode = args.causal_mode or "top_left"
    dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
    if args.grid:
        return GRID_FUNCS[args.grid](mode, dtype, args.device, args.both_causal or args.grid != "decode")
    B, H, S, D = args.shape
    causal = mode if (args.causal or args.causal_mode) else False
    return [point("shape", B, H, S, D, Sk=args.sk, H_kv=args.hkv, causal=c, dtype=dtype, device=args.device)
            for c in ((False, mode) if args.both_causal else (causal,))]


def build_impls(args):
    import torch

    if args.device == "cuda" and not (fattn.cuda_available() and torch.cuda.is_available()):
        args.error("--device cuda: fattn was built without CUDA, or torch / fattn see no GPU")
    avail = fattn.variants(args.device)
    chosen = args.variants.split(",") if args.variants else avail
    bad = [v for v in chosen if v not in avail]
    if bad:
        args.error(f"--variants: {bad} not among {avail} for {args.device}")
    names = ["cpu"] if args.device == "cpu" else list(TORCH_BACKENDS)
    if args.torch_backends:
        names = [] if args.torch_backends == "none" else args.torch_backends.split(",")
    ok = set(TORCH_BACKENDS) | ({"cpu"} if args.device == "cpu" else set())
    if set(names) - ok:
        args.error(f"--torch-backends: {sorted(set(names) - ok)} not among {sorted(ok)} for {args.device}")
    if args.gemm and args.device != "cuda":
        args.error("--gemm: the cuBLAS baseline runs on cuda only")
    return [f"fattn:{v}" for v in chosen] + [f"torch:{n}" for n in names] + (["cublas:gemm"] if args.gemm else [])


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("fattn.bench needs PyTorch (a benchmark dependency only): pip install torch", file=sys.stderr)
        return 2
    if args.timer == "triton" and args.device == "cuda":
        try:
            import triton.testing  # noqa: F401
        except ImportError:
            args.error("--timer triton: triton is not importable")
    meta, rows = run(build_points(args), build_impls(args), reps=args.reps, warmup=args.warmup, timer=args.timer,
                     seed=args.seed, quiet=args.quiet,
                     command=" ".join(["python", "-m", "fattn.bench"] + list(sys.argv[1:] if argv is None else argv)))
    if not rows:
        print("nothing could run (see the notes above)", file=sys.stderr)
        return 1
    print(format_table(rows))
    for path, writer in ((args.json, write_json), (args.csv, write_csv), (args.md, write_md)):
        if path:
            writer(path, meta, rows)
    if args.plot:
        from .plot import plot

        plot(rows, meta, args.plot)
    return 1 if any(_bad(r) and r["impl"].startswith("fattn:") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
