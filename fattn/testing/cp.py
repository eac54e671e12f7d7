"""fattn.testing.cp -- the cp grid: context parallelism (fattn.distributed) against one GPU and against torch's own
context parallelism.  Run under torchrun, through fattn.bench:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 -m fattn.bench --grid cp --causal --json cp.json --plot cp.png
    torchrun --nproc-per-node=2 -m fattn.bench --grid cp --device cpu --tokens 512 --heads 4 --dim 32 --dtype fp32

The defaults are the context-parallelism grid: causal tokens 128k, 256k, 512k; B=1, H=16, H_kv 16 and 4, D=128,
bf16; modes fwd and fwdbwd.

For each point (tokens, kv heads, mode) it times, with the same inputs (batch --batch, layout bshd):

- single: fattn alone on rank 0's GPU over the whole sequence, when it fits in memory; and torch's
  scaled_dot_product_attention likewise (impl torch-sdpa) on rank 1's GPU at the same time (on rank 0 after fattn
  when there is one rank): each single run has a GPU to itself, and the two overlap to save the session's time;
- fattn.distributed.attention with each --strategies (ring, allgather) over all ranks;
- torch's context parallelism (torch.distributed.tensor.experimental.context_parallel around
  F.scaled_dot_product_attention) with each --torch-rotate K/V rotation (allgather, torch's default; alltoall),
  where it runs; where it does not (on the CPU, for one), the row carries the reason.

Mode fwd times the forward; fwdbwd the forward and the backward (torch autograd).  Each distributed repeat starts
after a device sync and a barrier, is timed on every rank (CUDA events; the monotonic clock on the CPU) and counts
as the slowest rank's time; p50 over --reps after --warmup.  efficiency = T_1 / (gpus * T), T_1 the same library's
single-GPU p50 (fattn's for fattn rows, torch SDPA's for torch's; 1.0 for those rows; empty when it did not fit).
max_abs_err: the distributed output, unsharded, against fattn's single-GPU output.  Rank 0 prints a table and
writes --json: {"meta": {...}, "rows": [...]}, meta stamped with the device, torch version, FATTN_GIT_SHA (from the
environment) and the date.  With --plot-from a.json b.json --plot p.png it runs nothing (no torchrun) and plots the
files' rows together: one line per GPU count (fattn.plot.plot_cp_efficiency).
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fattn
import fattn.distributed as fd
from fattn.plot import FORMATS, output_path, plot_cp_efficiency
from fattn.testing.report import check_writable
from fattn.testing import timer

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fattn.bench --grid cp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="131072,262144,524288", help="global sequence lengths, comma-separated")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", help="kv head counts, comma-separated (default: --heads and --heads / 4)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal (default)")
    ap.add_argument("--modes", default="fwd,fwdbwd", help="fwd and / or fwdbwd")
    ap.add_argument("--strategies", default="ring,allgather")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-single", action="store_true", help="skip the single-GPU runs")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's SDPA and context parallelism")
    ap.add_argument("--torch-rotate", default="allgather,alltoall",
                    help="K/V rotations of torch's context parallelism to time (allgather is its default)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--plot", metavar="PATH", help="PNG: efficiency against tokens (needs matplotlib)")
    ap.add_argument("--plot-from", metavar="JSON", nargs="+",
                    help="no run: plot the rows of these --json files (several GPU counts in one plot) to --plot")
    args = ap.parse_args(argv)

    def ints(flag, text):
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            ap.error(f"{flag}: expected comma-separated integers, got {text!r}")
        if min(values) < 1:
            ap.error(f"{flag}: every value must be >= 1, got {text!r}")
        return values
    args.tokens = ints("--tokens", args.tokens)
    args.kv_heads = (ints("--kv-heads", args.kv_heads) if args.kv_heads else
                     [args.heads] + ([args.heads // 4] if args.heads % 4 == 0 and args.heads >= 4 else []))
    for flag in ("heads", "dim", "batch", "reps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.dim % 8:
        ap.error(f"--dim {args.dim}: fattn takes head dims that are multiples of 8")
    if args.plot:
        check_writable(output_path(args.plot), "--plot", ap.error, FORMATS)
    if args.plot_from:
        return args
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        ap.error("the cp grid runs one process per device under torchrun: NCCL_NVLS_ENABLE=0 torchrun "
                 "--nproc-per-node=N -m fattn.bench --grid cp ... (--device cpu: gloo processes)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda (the default): no usable CUDA GPU here; --device cpu runs the grid on gloo processes")
    if args.json:
        check_writable(args.json, "--json", ap.error)
    args.modes = args.modes.split(",")
    args.strategies = args.strategies.split(",")
    args.torch_rotate = [x for x in args.torch_rotate.split(",") if x]
    for m in args.modes:
        if m not in ("fwd", "fwdbwd"):
            ap.error(f"--modes: unknown mode {m!r}")
    for s in args.strategies:
        if s not in ("ring", "allgather", "auto"):
            ap.error(f"--strategies: unknown strategy {s!r}")
    for hk in args.kv_heads:
        if hk <= 0 or args.heads % hk:
            ap.error(f"--kv-heads: {hk} does not divide --heads {args.heads}")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Process group and timing


def init(args):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before the communicator exists
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=30), device_id=torch.device("cuda", local))
        return torch.device("cuda", local)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return torch.device("cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device):
    sync(device)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def time_once(fn, device):
    """Microseconds of one call of fn on this rank."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def time_local(fn, device, args):
    """p50 microseconds of fn on this rank alone."""
    for _ in range(args.warmup):
        fn()
    sync(device)
    return timer.percentile([time_once(fn, device) for _ in range(args.reps)], 0.5)


def time_distributed(fn, device, args):
    """p50 over repeats of the slowest rank's time; every repeat starts together (sync + barrier)."""
    for _ in range(args.warmup):
        fn()
    samples = []
    for _ in range(args.reps):
        barrier(device)
        samples.append(time_once(fn, device))
    mine = torch.tensor(samples, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    slowest = torch.stack(every).max(dim=0).values.tolist()
    return timer.percentile(slowest, 0.5)


# ----------------------------------------------------------------------------------------------------------------
# What is timed


def make_inputs(args, tokens, kv_heads, device):
    """Full q, k, v, dout (B, S, H, D), the same on every rank (seeded)."""
    g = torch.Generator(device=device).manual_seed(1234 + tokens + kv_heads)
    dtype = DTYPES[args.dtype]

    def randn(heads):
        return torch.randn((args.batch, tokens, heads, args.dim), generator=g, device=device).to(dtype)

    return randn(args.heads), randn(kv_heads), randn(kv_heads), randn(args.heads)


def call(fn_forward, inputs, dout, mode):
    """A closure running fn_forward(*inputs) (and, for fwdbwd, the gradients of its output for dout)."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn_forward(*inputs)
        return run
    leaves = [x.detach().requires_grad_() for x in inputs]

    def run_fwdbwd():
        out = fn_forward(*leaves)
        torch.autograd.grad(out, leaves, dout)
        return out
    return run_fwdbwd


def single_runs(args, mode, causal, q, k, v, dout, device):
    """The single-GPU runs, job j on rank j % world (each on its own GPU, at the same time): on every rank
    [(impl, p50 or None, note)] of every job; and fattn's output on rank 0 (None elsewhere, or if it did not fit)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    impls = [("fattn", lambda a, b, c: fattn.attention(a, b, c, causal=causal, layout="bshd"))]
    if not args.no_torch:
        gqa = k.shape[2] != q.shape[2]
        impls.append(("torch-sdpa", lambda a, b, c: F.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), is_causal=causal,
            enable_gqa=gqa).transpose(1, 2)))
    mine, out = [], None
    for j, (impl, fwd) in enumerate(impls):
        if j % world != rank:
            continue
        try:
            run = call(fwd, (q, k, v), dout, mode)
            if impl == "fattn":
                with torch.no_grad():
                    out = fwd(q, k, v)
            mine.append((j, impl, time_local(run, device, args), ""))
        except torch.OutOfMemoryError:
            mine.append((j, impl, None, "out of memory on one GPU"))
        except Exception as e:  # noqa: BLE001  torch's SDPA may refuse a shape; fattn's failures show here too
            mine.append((j, impl, None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    every = [None] * world
    dist.all_gather_object(every, mine)
    return [row[1:] for row in sorted(r for part in every for r in part)], out


def fattn_distributed(args, mode, causal, strategy, local, dout_local, device):
    """(p50, unsharded output) of fattn.distributed.attention."""
    def fwd(a, b, c):
        return fd.attention(a, b, c, causal=causal, layout="bshd", strategy=strategy)

    us = time_distributed(call(fwd, local, dout_local, mode), device, args)
    with torch.no_grad():
        out = fwd(*local)
    return us, fd.unshard(out, causal=causal)


def torch_context_parallel(args, mode, causal, rotate, q, k, v, dout, device):
    """(p50, unsharded output, note) of torch's context parallelism with K/V rotation `rotate` ("allgather", its
    default, or "alltoall"), or (None, None, why not)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method
    except ImportError as e:
        return None, None, f"unavailable: {e}"
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    gqa = k.shape[2] != q.shape[2]
    bufs = [x.transpose(1, 2).contiguous() for x in (q, k, v, dout)]  # (B, H, S, D), sharded in place below
    try:
        set_rotate_method(rotate)
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            def fwd(a, b, c):
                return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=gqa)

            us = time_distributed(call(fwd, bufs[:3], bufs[3], mode), device, args)
            with torch.no_grad():
                out = fwd(*bufs[:3])
        whole = context_parallel_unshard(mesh, [out], [2])[0].transpose(1, 2)
        return us, whole, ""
    except Exception as e:  # noqa: BLE001  experimental API: record why it did not run
        return None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        set_rotate_method("allgather")  # torch's default
        del bufs
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# The grid


def run_point(args, tokens, kv_heads, mode, device):
    world, rank = dist.get_world_size(), dist.get_rank()
    causal = args.causal
    base = {"grid": "cp", "tokens": tokens, "heads": args.heads, "kv_heads": kv_heads, "dim": args.dim,
            "batch": args.batch, "dtype": args.dtype, "causal": causal, "mode": mode}
    pieces = 2 * world if causal else world
    if tokens % pieces:
        return [dict(base, gpus=world, strategy="-", impl="fattn", p50_us=None, efficiency=None, max_abs_err=None,
                     note=f"tokens do not divide into {pieces} chunks")]
    q, k, v, dout = make_inputs(args, tokens, kv_heads, device)
    rows = []
    single_out = None
    if not args.no_single:
        singles, single_out = single_runs(args, mode, causal, q, k, v, dout, device)
        if rank == 0:
            for impl, us, note in singles:
                rows.append(dict(base, gpus=1, strategy="single", impl=impl, p50_us=us, note=note))
        barrier(device)
    local = [fd.shard(x, causal=causal) for x in (q, k, v)]
    dout_local = fd.shard(dout, causal=causal)
    if rank != 0:
        del q, k, v, dout
        q = k = v = dout = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def err(whole):
        if rank != 0 or single_out is None or whole is None:
            return None
        return (whole.float() - single_out.float()).abs().max().item()

    for strategy in args.strategies:
        us, whole = fattn_distributed(args, mode, causal, strategy, local, dout_local, device)
        rows.append(dict(base, gpus=world, strategy=strategy, impl="fattn", p50_us=us, max_abs_err=err(whole),
                         note=f"auto -> {fd.choose_strategy(args.heads, kv_heads, world)}" if strategy == "auto"
                         else ""))
        del whole
    if not args.no_torch:
        full = (q, k, v, dout) if rank == 0 else make_inputs(args, tokens, kv_heads, device)
        for rotate in args.torch_rotate:
            us, whole, note = torch_context_parallel(args, mode, causal, rotate, *full, device)
            rows.append(dict(base, gpus=world, strategy=rotate, impl="torch-cp", p50_us=us, max_abs_err=err(whole),
                             note=note))
            del whole
        del full
    for row in rows:
        row.setdefault("max_abs_err", None)
    return with_own_efficiency(rows)  # rank 0's rows hold the single runs


def meta(args, device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "gpus": dist.get_world_size(), "backend": dist.get_backend(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "fattn": fattn.__version__,
            "fattn_git_sha": os.environ.get("FATTN_GIT_SHA", "unknown"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(args).items()}}


def print_table(rows, header=True):
    head = f"{'tokens':>8} {'kv':>3} {'mode':>6} {'gpus':>4} {'strategy':>9} {'impl':>10} {'p50 ms':>10} " \
           f"{'eff':>5} {'max err':>9}  note"
    if header:
        print(head)
    for r in rows:
        ms = f"{r['p50_us'] / 1e3:10.3f}" if r["p50_us"] else f"{'-':>10}"
        eff = f"{r['efficiency']:5.2f}" if r["efficiency"] else f"{'-':>5}"
        e = f"{r['max_abs_err']:9.2e}" if r["max_abs_err"] is not None else f"{'-':>9}"
        print(f"{r['tokens']:>8} {r['kv_heads']:>3} {r['mode']:>6} {r['gpus']:>4} {r['strategy']:>9} "
              f"{r['impl']:>10} {ms} {eff} {e}  {r.get('note', '')}", flush=True)


def with_own_efficiency(rows):
    """rows with efficiency recomputed against the same library's single-GPU row of the same point (fattn's T_1 for
    fattn, torch SDPA's for torch): files written before run_point did so carry fattn's T_1 on torch's rows."""
    def point(r):
        return r["tokens"], r["kv_heads"], r["mode"], r["causal"]

    t1 = {(point(r), r["impl"]): r["p50_us"] for r in rows if r["gpus"] == 1 and r["p50_us"]}
    out = []
    for r in rows:
        own = t1.get((point(r), "torch-sdpa" if r["impl"].startswith("torch") else "fattn"))
        out.append(dict(r, efficiency=own / (r["gpus"] * r["p50_us"]) if own and r["p50_us"] else None))
    return out


def plot_from(paths, out):
    """One efficiency plot of the rows of several --json files (say, a 2-GPU and a 4-GPU run)."""
    rows, metas = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        rows += with_own_efficiency(data["rows"])
    devices = sorted({m["device"] for m in metas})
    out = plot_cp_efficiency(rows, {"device": " / ".join(devices), "torch": metas[0]["torch"],
                                    "shas": [m["fattn_git_sha"] for m in metas]}, out)
    print(f"wrote {out} ({len(rows)} rows from {len(paths)} files)", flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.plot_from:
        if not args.plot:
            raise SystemExit("--plot-from needs --plot PATH")
        plot_from(args.plot_from, args.plot)
        return 0
    device = init(args)
    rows = []
    try:
        for tokens in args.tokens:
            for kv_heads in args.kv_heads:
                for mode in args.modes:
                    point = run_point(args, tokens, kv_heads, mode, device)
                    if dist.get_rank() == 0:
                        print_table(point, header=not rows)
                    rows += point
        if dist.get_rank() == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta(args, device), "rows": rows}, f, indent=1)
            print(f"wrote {args.json} ({len(rows)} rows)", flush=True)
        if dist.get_rank() == 0 and args.plot:
            print(f"wrote {plot_cp_efficiency(rows, meta(args, device), args.plot)}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
