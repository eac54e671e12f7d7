"""The one timer.  On a GPU: CUDA events around each call with the L2 flushed before it (kernel time), or around
back-to-back batches (end-to-end time, what the host path costs); on the CPU: the monotonic clock.  Returns the
samples in microseconds; summarize() gives the median and p90.  CUDA timing uses torch's events and allocator.

The flush (FATTN_FLUSH): "write" (the default, what every timing in evidence/ before 2026-11-25 used) zeroes a
buffer larger than the L2, which leaves the L2 full of dirty lines: the timed call's first reads then evict them,
and the write-back (up to the L2's 50 MB on an H100, ~15 us of DRAM time) lands inside its events.  "read" reads
that buffer instead (an int32 max over it), leaving clean lines: no write-back in the timed call.  Short
memory-bound calls (decode) read differently under the two; report which one a number used.
"""
import os
import time

FLUSH_BYTES = 256 << 20  # larger than any GPU's L2 here (H100 50 MB, H200 60 MB)


def percentile(xs, q):
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples):
    """(p50, p90) of microsecond samples."""
    return percentile(samples, 0.5), percentile(samples, 0.9)


_flush = {}


def flush_buffer(device=None):
    """A FLUSH_BYTES buffer on the current (or given) CUDA device, made once."""
    import torch

    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    if dev not in _flush:
        _flush[dev] = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=dev)
    return _flush[dev]


def flush_mode():
    """FATTN_FLUSH: "write" (default) or "read" (see the module's docstring)."""
    mode = os.environ.get("FATTN_FLUSH", "write")
    if mode not in ("write", "read"):
        raise ValueError(f"FATTN_FLUSH: {mode!r} is neither 'write' nor 'read'")
    return mode


def flush_l2(device=None):
    """Evicts the L2 (on the current stream): the flush buffer zeroed, or read (FATTN_FLUSH=read)."""
    import torch

    buf = flush_buffer(device)
    if flush_mode() == "read":
        torch.amax(buf)
    else:
        buf.zero_()


def cuda(fn, reps=50, warmup=10):
    """Microseconds of each of `reps` calls: CUDA events around each, the L2 flushed (outside the events) before it."""
    import torch

    for _ in range(warmup):
        fn()
    flush_buffer()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        flush_l2()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def cuda_batch(fn, reps=50, warmup=10, batch=20):
    """Microseconds per call of back-to-back batches of `batch` calls (no flush): where the host path is slower than
    the kernel the GPU idles between launches, and this shows it."""
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
    return samples


def cpu(fn, reps=10, warmup=2):
    """Microseconds of wall time of each call."""
    for _ in range(warmup):
        fn()
    us = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        us.append((time.perf_counter_ns() - t0) / 1e3)
    return us


def interleaved(fns, rounds, time_one):
    """{name: [median of each round]} timing every fn of `fns` once per round with time_one(fn) -> samples, in turn,
    the order reversed every other round (A B C, C B A, ...): drift of clocks and temperature, and whatever the one
    before leaves behind (heat, power draw), then hit every candidate alike."""
    out = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(percentile(time_one(fns[name]), 0.5))
    return out
