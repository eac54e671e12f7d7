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
