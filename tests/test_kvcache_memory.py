"""A KV cache's memory: out= inside any page of a paged pool is refused, and the append advances the cache tensors'
version counters as a torch write would.  `pytest -k kvcache`."""
import pytest

from conftest import torch
from test_kvcache import _assert_refused, _call, _paged

import fattn


def test_kvcache_out_in_a_later_page_refused():
    """out= inside any page of the pool is refused (the overlap test covers the whole pool, not the block table's
    view of it), and no page is written."""
    args = _paged()
    for page in (0, 4):  # a page of the block table, and one outside it
        out = args["k_cache"][page, :4].reshape(2, 1, 4, 32)
        _assert_refused(dict(args, out=out), ValueError, r"out: shares memory with k_cache")


def test_kvcache_append_advances_versions():
    """The append writes the cache in place as a torch write would: its version counter advances, so autograd
    refuses a backward that saved the cache before (it used to read the new values silently)."""
    args = _call()
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    w = torch.ones_like(kc, requires_grad=True)
    y = (kc * w).sum()
    before = kc._version, vc._version
    with torch.no_grad():
        fattn.attention_with_kvcache(q, kc, vc, **args)
    assert kc._version > before[0] and vc._version > before[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_kvcache_append_into_memory_it_reads_is_refused():
    """An append (k_new, v_new) that would write what the call still reads is refused naming the argument, and
    nothing is written: k_cache = v_cache (the new key was lost), q inside a cache slot being written (q changed
    under the call), k_new inside its own destination (copied over itself), a cache broadcast over the batch with
    a stride of 0 (two sequences writing one slot).  Slices of one fused (B, S, 2, H_kv, D) buffer are fine."""
    args = _call()
    kc = args["k_cache"]
    _assert_refused(dict(args, v_cache=kc), ValueError, r"v_cache: shares elements with k_cache")
    fused = torch.zeros(2, 64, 2 + 2, 32)  # the caches' 2 + 2 heads in one buffer
    qv = fused[:, 3:4]  # 4 heads: the slot k_new and v_new land in at cache_seqlens 3
    _assert_refused(dict(args, q=qv, k_cache=fused[:, :, :2], v_cache=fused[:, :, 2:],
                         cache_seqlens=torch.tensor([3, 3], dtype=torch.int32)), ValueError,
                    r"q: shares memory with k_cache / v_cache, which k_new and v_new are written into")
    _assert_refused(dict(args, k_new=kc[:, 2:3].clone(), v_new=args["v_cache"][:, 3:4]), ValueError,
                    r"v_new: shares memory with k_cache / v_cache")
    shared = torch.zeros(1, 64, 2, 32).expand(2, 64, 2, 32)
    for which in ("k_cache", "v_cache"):
        _assert_refused(dict(args, **{which: shared}), ValueError, rf"{which}: its elements overlap one another")
    kv = torch.zeros(2, 64, 2, 2, 32)
    q, kn, vn, cs = args["q"], args["k_new"], args["v_new"], args["cache_seqlens"]
    out = fattn.attention_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], k_new=kn, v_new=vn, cache_seqlens=cs)
    assert out.shape == q.shape and torch.equal(kv[0, 3, 0], kn[0, 0]) and torch.equal(kv[1, 10, 1], vn[1, 0])


SCRATCH_REFUSED = r"""
import resource, numpy as np, fattn
D = 256
kc = np.zeros((2, 16, 1, D), np.float32); vc = kc.copy(); q = np.ones((1, 1, 1, D), np.float32)
fattn.attention_with_kvcache(q, kc.copy(), vc.copy(), block_table=np.zeros((1, 1), np.int32))  # OpenMP warmed up
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 29), resource.RLIM_INFINITY))
kn = np.full((1, 1, 1, D), 5, np.float32)
table = np.zeros((1, 1 << 17), np.int32)  # 2M slots, every one on page 0
try:  # the sequence uses 2M keys: the CPU backend's scratch for them (2 GB) cannot be had under the limit
    fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=kn, cache_seqlens=np.array([(1 << 21) - 1], np.int32),
                                 block_table=table)
    print("ran")
except RuntimeError as e:
    print("refused:", e)
print("written:", bool(kc.any() or vc.any()))
ok = fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=kn, cache_seqlens=np.array([3], np.int32),
                                  block_table=table)  # 4 keys used: the scratch follows them, not the 2M capacity
print("small:", float(kc[0, 3, 0, 0]), bool(np.isfinite(ok).all()))
"""


def test_kvcache_refused_for_memory_writes_nothing():
    """The CPU backend's scratch is allocated before the append (and sized by the keys the sequences use, not the
    cache's capacity): a call refused for memory leaves the cache as it was; a small call on a large pool runs."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SCRATCH_REFUSED], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused:") and "out of memory for scratch buffers" in lines[0], r.stdout
    assert lines[1] == "written: False"
    assert lines[2] == "small: 5.0 True"
