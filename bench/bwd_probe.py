"""Where a v3 dK/dV block's time goes outside its steps, block by block, from a diagnostic build.

    python3 bench/bwd_probe.py --old DIR [--shapes 8,16,2048,128 4,16,4096,128] [--causal] [--json FILE]

DIR: a tree built by bench/old_tree.sh with FATTN_BWD_PROBE defined (v3_bwd_kernel.cuh), imported as fattn_old.
Each block of the dK/dV kernel (head dims 64 / 128) writes its SM and its SM's clock at its entry, once it has placed
itself (its key block and query blocks), once its consumers have their registers, when the producer issues its first
loads, once K and V have landed, once Q_0 has, after its last step, after each consumer's dK / dV stores and after
the dQ writer's last add has landed; this reads them back (ctypes: fattn_v3_bwd_probe) after one backward call, with
the L2 flushed first, and prints per phase the median and mean over blocks in us, and the gap on each SM between a
block's end and the next block's entry.  The clock's rate comes from the blocks' globaltimer readings.
"""
import argparse
import ctypes
import importlib
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROWS, SLOTS = 16384, 16
SM, ENTRY, ENTRY_NS, STEPS, KV, Q0, LOOP, STORED0, STORED1, WRITER, STORED0_NS, PLACED, REGS, ISSUE = range(14)


def probe_call(fattn, lib, shape, causal, dtype):
    b, h, s, d = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    out, lse = fattn.attention(q, k, v, causal=causal, return_lse=True)
    call = lambda: fattn.attention_backward(do, q, k, v, out, lse, causal=causal, variant="v3")  # noqa: E731
    for _ in range(3):
        call()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    if lib.fattn_v3_bwd_probe(None, 0, 1):
        raise RuntimeError("fattn_v3_bwd_probe: reset failed")
    flush.fill_(1)
    call()
    torch.cuda.synchronize()
    buf = np.zeros(ROWS * SLOTS, dtype=np.uint64)
    if lib.fattn_v3_bwd_probe(buf.ctypes.data_as(ctypes.c_void_p), buf.nbytes, 0):
        raise RuntimeError("fattn_v3_bwd_probe: copy failed")
    rows = buf.reshape(ROWS, SLOTS).astype(np.int64)
    return rows[rows[:, ENTRY] != 0]


def summarize(rows):
    # the SM clock in cycles per us, from blocks that stored (entry and store read both clocks)
    ok = rows[(rows[:, STORED0] > 0) & (rows[:, STORED0_NS] > rows[:, ENTRY_NS])]
    mhz = float(np.median((ok[:, STORED0] - ok[:, ENTRY]) / (ok[:, STORED0_NS] - ok[:, ENTRY_NS]) * 1e3))
    us = lambda x: x / mhz  # noqa: E731
    # a block's end: its last probe point (a block without steps stores nothing: its entry)
    block_end = rows[:, [STORED0, STORED1, WRITER, ENTRY]].max(axis=1)
    has_steps = rows[:, STEPS] > 0
    work, end = rows[has_steps], block_end[has_steps]
    phases = {
        "entry_to_placed": us(work[:, PLACED] - work[:, ENTRY]),
        "placed_to_regs": us(work[:, REGS] - work[:, PLACED]),
        "placed_to_issue": us(work[:, ISSUE] - work[:, PLACED]),
        "issue_to_kv": us(work[:, KV] - work[:, ISSUE]),
        "entry_to_kv": us(work[:, KV] - work[:, ENTRY]),
        "kv_to_q0": us(work[:, Q0] - work[:, KV]),
        "steps": us(work[:, LOOP] - work[:, Q0]),
        "per_step": us((work[:, LOOP] - work[:, Q0]) / work[:, STEPS]),
        "loop_to_stored0": us(work[:, STORED0] - work[:, LOOP]),
        "loop_to_writer": us(work[:, WRITER] - work[:, LOOP]),
        "loop_to_end": us(end - work[:, LOOP]),
        "life": us(end - work[:, ENTRY]),
    }
    # gaps on each SM: a block's end to the next block's entry (one SM's clock)
    gaps = []
    ends = {}
    for r, e in zip(rows, block_end):
        ends.setdefault(int(r[SM]), []).append((int(r[ENTRY]), int(e)))
    for lst in ends.values():
        lst.sort()
        gaps += [us(lst[i + 1][0] - lst[i][1]) for i in range(len(lst) - 1)]
    phases["gap_to_next_block"] = np.array(gaps) if gaps else np.zeros(1)
    span_us = (rows[:, STORED0_NS].max() - rows[:, ENTRY_NS].min()) / 1e3
    out = {"blocks": int(len(rows)), "blocks_with_steps": int(len(work)),
           "steps_median": float(np.median(work[:, STEPS])),
           "clock_mhz": mhz, "span_us": float(span_us), "sms": len(ends)}
    for k, x in phases.items():
        out[k] = {"median": float(np.median(x)), "mean": float(np.mean(x)), "p10": float(np.percentile(x, 10)),
                  "p90": float(np.percentile(x, 90))}
    life = out["life"]["mean"] + out["gap_to_next_block"]["mean"]
    steps_only = out["steps"]["mean"]
    out["outside_steps_share"] = 1.0 - steps_only / life
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the FATTN_BWD_PROBE tree built by bench/old_tree.sh")
    ap.add_argument("--shapes", nargs="+", default=["8,16,2048,128", "4,16,4096,128", "2,16,8192,128",
                                                    "16,32,1024,64", "4,32,4096,64"])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--json")
    a = ap.parse_args()
    sys.path.insert(0, a.old)
    fattn = importlib.import_module("fattn_old")
    lib = ctypes.CDLL(fattn._C.__file__)
    lib.fattn_v3_bwd_probe.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.fattn_v3_bwd_probe.restype = ctypes.c_int
    dtype = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    results = []
    for sh in a.shapes:
        shape = tuple(map(int, sh.split(",")))
        r = summarize(probe_call(fattn, lib, shape, a.causal, dtype))
        r.update(shape=sh, causal=a.causal, dtype=a.dtype)
        results.append(r)
        print(f"== {sh} causal={a.causal} {a.dtype}: {r['blocks']} blocks on {r['sms']} SMs, {r['steps_median']:.0f} "
              f"steps (median), clock {r['clock_mhz']:.0f} MHz, span {r['span_us']:.1f} us, outside the steps "
              f"{100 * r['outside_steps_share']:.1f}% of a block's period")
        for k in ("entry_to_placed", "placed_to_regs", "placed_to_issue", "issue_to_kv", "entry_to_kv", "kv_to_q0",
                  "per_step", "steps", "loop_to_stored0", "loop_to_writer", "loop_to_end",
                  "gap_to_next_block", "life"):
            x = r[k]
            print(f"   {k:20s} median {x['median']:9.2f}  mean {x['mean']:9.2f}  p10 {x['p10']:9.2f}  "
                  f"p90 {x['p90']:9.2f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
