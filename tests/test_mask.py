"""The mask block (csrc/mask.h): causal alignments and sliding windows, through every kernel, against the float64
reference with fattn.testing.reference.visible -- the one Python statement of the rule.  Windows reach the kernels
through fattn._C._dev.forward here, and through fattn.attention(window=...) (and its autograd) in the last test."""
import os
import subprocess
import sysconfig

import numpy as np
import pytest

from conftest import check_close, dev_forward, randn, require, targets, torch

import fattn
from fattn.testing import reference

WINDOWS = [None, (16, -1), (-1, 7), (5, 3), (0, 0), (300, 300), (-1, 0)]
WIDS = ["none", "left16", "right7", "both5_3", "diag", "wider", "right0"]
SHAPES = [(17, 113), (113, 17), (97, 97), (1, 257), (130, 65)]


def brute_visible(sq, sk, causal, window):
    left, right = window or (-1, -1)
    right = 0 if causal else right
    off = 0 if causal in (True, "top_left") else sk - sq
    return np.array([[(left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)
                      for j in range(sk)] for i in range(sq)], dtype=bool).reshape(sq, sk)


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("window", WINDOWS, ids=WIDS)
def test_visible_is_the_rule(causal, window):
    for sq, sk in SHAPES + [(0, 5), (4, 0)]:
        assert np.array_equal(reference.visible(sq, sk, causal, window), brute_visible(sq, sk, causal, window))


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"], ids=["full", "tl", "br"])
@pytest.mark.parametrize("window", WINDOWS, ids=WIDS)
def test_windows_every_kernel(device, variant, causal, window, seed, request):
    require(device)
    dt = torch.float32 if device == "cpu" else torch.float16
    split = variant.endswith("-split")
    for n, (sq, sk) in enumerate(SHAPES):
        q = randn((1, 4, sq, 64), dt, device, seed + n)
        k = randn((1, 2, sk, 64), dt, device, seed + n + 100)
        v = randn((1, 2, sk, 64), dt, device, seed + n + 200)
        lse = torch.empty(1, 4, sq, device=device, dtype=torch.float32)
        kw = {"splits": 3} if split else {}
        o, lse, plan = dev_forward(q, k, v, causal=causal, window=window, lse=lse,
                                   variant=variant.removesuffix("-split"), **kw)
        check_close(o, q, k, v, causal, None, lse=lse, request=request, window=window)


def test_window_arguments_are_checked():
    q = torch.randn(1, 1, 4, 8)
    for bad, exc in [((-2, 0), ValueError), ((1,), TypeError), ("4", TypeError), ((1.5, 2), TypeError)]:
        with pytest.raises(exc, match="window"):
            dev_forward(q, q, q, window=bad)


def test_window_through_the_public_api_and_autograd(seed):
    """fattn.attention(window=...) (plain, through the torch op with gradients, and attention_backward) equals the
    dev hook's result and the reference; bad windows raise naming the argument."""
    from fattn.testing import accuracy

    q = randn((1, 4, 70, 32), torch.float32, "cpu", seed)
    k = randn((1, 2, 90, 32), torch.float32, "cpu", seed + 1)
    v = randn((1, 2, 90, 32), torch.float32, "cpu", seed + 2)
    dout = randn((1, 4, 70, 32), torch.float32, "cpu", seed + 3)
    for causal, window in ((False, (8, 3)), ("top_left", (5, -1)), ("bottom_right", (-1, -1)), (False, (-1, 0))):
        want, _, _ = dev_forward(q, k, v, causal=causal, window=window)
        got = fattn.attention(q, k, v, causal=causal, window=window)
        assert torch.equal(got, want)
        leafs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fattn.attention(*leafs, causal=causal, window=window)
        assert torch.equal(out.detach(), want)
        out.backward(dout)
        why, _ = accuracy.check_gradients([x.grad for x in leafs], q, k, v, dout, causal, window=window)
        assert why is None, why
        o, lse = fattn.attention(q, k, v, causal=causal, window=window, return_lse=True)
        g = fattn.attention_backward(dout, q, k, v, o, lse, causal=causal, window=window)
        for a, b in zip(g, leafs):
            assert torch.equal(a, b.grad)
    for bad, exc in [((-2, 0), ValueError), ((1,), TypeError), ("ab", TypeError), ((1.5, 2), TypeError), (3, TypeError)]:
        with pytest.raises(exc, match="window"):
            fattn.attention(q, k, v, window=bad)


@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("window", WINDOWS, ids=WIDS)
def test_key_blocks_seen_by_a_query_block_are_contiguous(causal, window):
    """What v3's deterministic backward counts on (kernels/sm90/v3_bwd_kernel.cuh): the key blocks some row of a query block
    sees are one range [first, last] -- so the block for key block kb adds its dQ tile as turn kb - first, and the
    blocks before it in the range are exactly those that add first -- for every mask and window, with the query
    and key blocks of both backward tilings (64 or 128 rows against 128 keys)."""
    for sq, sk in SHAPES + [(300, 1000), (1000, 300), (129, 129)]:
        vis = reference.visible(sq, sk, causal, window)
        for br, bc in ((64, 128), (128, 128)):
            for i0 in range(0, sq, br):
                cols = np.flatnonzero(vis[i0:i0 + br].any(axis=0))
                blocks = np.unique(cols // bc)
                assert blocks.size == 0 or np.array_equal(blocks, np.arange(blocks[0], blocks[-1] + 1)), \
                    (sq, sk, i0, br, blocks)


def test_rows_seeing_closed_form_matches_the_rule(tmp_path):
    """csrc/mask.h's fattn_rows_seeing (the query rows that see a key block: where every backward block starts its
    walk) is a closed form; tests/mask_rows_check.c checks it against a row-by-row scan of fattn_row_keys over every
    alignment, windows bounded or not on either side, lengths 1..257 both ways and key blocks of 1..128 keys."""
    here = os.path.dirname(os.path.abspath(__file__))
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    exe = str(tmp_path / "mask_rows_check")
    subprocess.run(cc + ["-O2", "-std=gnu11", "-I", os.path.join(here, "..", "csrc"), "-o", exe,
                         os.path.join(here, "mask_rows_check.c")], check=True)
    run = subprocess.run([exe], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    assert int(run.stdout.split()[0]) > 1_000_000, run.stdout

