"""attention_with_kvcache (issue 17): a KV cache, contiguous or paged (pages in random physical order), with new keys
appended in place, against the float64 reference on each sequence's keys gathered by hand; the cache unchanged
outside the written slots; argument errors, and nothing written when a call is refused.  `pytest -k kvcache`."""
import pytest

from conftest import randn, replay_captured, repro, require, torch

import fattn
from fattn.testing import accuracy

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def targets():
    """(device, variant): the CPU, the GPU's default, and each GPU variant that takes a cache."""
    return [pytest.param("cpu", None, id="cpu")] + [
        pytest.param("cuda", v, id=f"cuda-{v or 'default'}", marks=pytest.mark.gpu) for v in (None, "v1", "v2", "v3")]


def dtypes_for(device):
    return ["fp32"] if device == "cpu" else ["fp16", "bf16"]


def make_cache(b, capacity, hk, d, dt, device, seed, page_size=None):
    """(k_cache, v_cache, block_table or None): contiguous (B, capacity, H_kv, D), or a pool with two spare pages
    whose pages each sequence uses in a random physical order."""
    if page_size is None:
        shape = (b, capacity, hk, d)
        return randn(shape, dt, device, seed), randn(shape, dt, device, seed + 1), None
    per_seq = -(-capacity // page_size)
    pages = b * per_seq + 2
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(pages, generator=g)[: b * per_seq].reshape(b, per_seq).to(torch.int32).to(device)
    shape = (pages, page_size, hk, d)
    return randn(shape, dt, device, seed), randn(shape, dt, device, seed + 1), table


def keys_of(cache, table, b, n):
    """The first n keys of sequence b, (n, H_kv, D), gathered from the cache (through the table when paged)."""
    if table is None:
        return cache[b, :n]
    ps = cache.shape[1]
    rows = torch.arange(n, device=cache.device)
    return cache[table[b].long()[rows // ps], rows % ps]


def check_sequence(out, lse, q, k_cache, v_cache, table, b, n, causal, window, softcap, request):
    """Sequence b of the call against attention over its first n cached keys (bottom-right aligned)."""
    qb = q[b:b + 1].transpose(1, 2)
    kb = keys_of(k_cache, table, b, n).transpose(0, 1).unsqueeze(0)
    vb = keys_of(v_cache, table, b, n).transpose(0, 1).unsqueeze(0)
    mode = "bottom_right" if causal else False
    why, _, _ = accuracy.check_attention(out[b:b + 1].transpose(1, 2), qb, kb, vb, mode, None, lse[b:b + 1], window,
                                         softcap)
    assert why is None, f"sequence {b} ({n} keys): {why}. {repro(request)}"


CASES = {  # page_size, cache lengths before the call, S_new, Sq
    "contiguous-decode": (None, [0, 5, 63, 200], 1, 1),
    "contiguous-chunk": (None, [17, 0, 113], 7, 7),
    "contiguous-read": (None, [1, 64, 190], 0, 3),
    "paged16-decode": (16, [0, 15, 16, 129], 1, 1),
    "paged32-chunk": (32, [31, 100, 3], 5, 5),
    "paged64-more-q": (64, [10, 250], 3, 9),
    "paged48-chunk": (48, [47, 100, 0], 4, 4),  # a page size that neither divides nor is a multiple of the tiles
}


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_forward(device, variant, case, causal, seed, request):
    """The output and LSE per sequence; the new keys and values in their slots; every other slot of the cache (and
    every unused page) unchanged."""
    require(device)
    page_size, lens, s_new, sq = CASES[case]
    b, h, hk, d, capacity = len(lens), 4, 2, 64, 256
    for dname in dtypes_for(device):
        dt = DT[dname]
        k_cache, v_cache, table = make_cache(b, capacity, hk, d, dt, device, seed, page_size)
        k0, v0 = k_cache.clone(), v_cache.clone()
        q = randn((b, sq, h, d), dt, device, seed + 2)
        k_new = randn((b, s_new, hk, d), dt, device, seed + 3) if s_new else None
        v_new = randn((b, s_new, hk, d), dt, device, seed + 4) if s_new else None
        cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
        out, lse = fattn.attention_with_kvcache(q, k_cache, v_cache, k_new=k_new, v_new=v_new,
                                                cache_seqlens=cache_seqlens, block_table=table, causal=causal,
                                                return_lse=True, variant=variant)
        want_k, want_v = k0.clone(), v0.clone()
        for i, n in enumerate(lens):
            for t in range(s_new):
                j = n + t
                if table is None:
                    want_k[i, j], want_v[i, j] = k_new[i, t], v_new[i, t]
                else:
                    page, row = int(table[i, j // page_size]), j % page_size
                    want_k[page, row], want_v[page, row] = k_new[i, t], v_new[i, t]
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), f"{dname}: cache contents. {repro(request)}"
        for i, n in enumerate(lens):
            check_sequence(out, lse, q, k_cache, v_cache, table, i, n + s_new, causal, None, 0.0, request)


@pytest.mark.parametrize("device,variant", targets())
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window,softcap", [((32, 0), 0.0), ((-1, -1), 5.0), ((8, 3), 2.0)],
                         ids=["window", "softcap", "both"])
def test_kvcache_window_softcap(device, variant, paged, window, softcap, seed, request):
    require(device)
    lens, b, h, hk, d = [40, 0, 150], 3, 4, 1, 128
    for dname in dtypes_for(device):
        dt = DT[dname]
        k_cache, v_cache, table = make_cache(b, 192, hk, d, dt, device, seed, 32 if paged else None)
        q = randn((b, 2, h, d), dt, device, seed + 2, 4.0)
        k_new, v_new = randn((b, 2, hk, d), dt, device, seed + 3), randn((b, 2, hk, d), dt, device, seed + 4)
        cs = torch.tensor(lens, dtype=torch.int32, device=device)
        out, lse = fattn.attention_with_kvcache(q, k_cache, v_cache, k_new=k_new, v_new=v_new, cache_seqlens=cs,
                                                block_table=table, window=window, softcap=softcap, return_lse=True,
                                                variant=variant)
        for i, n in enumerate(lens):
            check_sequence(out, lse, q, k_cache, v_cache, table, i, n + 2, True, window, softcap, request)


@pytest.mark.parametrize("device,variant", targets())
def test_kvcache_whole_cache_and_strided_q(device, variant, seed, request):
    """No cache_seqlens: every sequence attends to its whole cache; q a strided view; out given."""
    require(device)
    dt = DT[dtypes_for(device)[0]]
    k_cache, v_cache, table = make_cache(2, 64, 2, 32, dt, device, seed, 16)
    big = randn((2, 3, 8, 64), dt, device, seed + 2)
    q = big[:, :, ::2, :32]  # (2, 3, 4, 32), strided
    out = torch.empty((2, 3, 4, 32), dtype=dt, device=device)
    got, lse = fattn.attention_with_kvcache(q, k_cache, v_cache, block_table=table, out=out, return_lse=True,
                                            variant=variant)
    assert got is out
    for i in range(2):
        check_sequence(out, lse, q, k_cache, v_cache, table, i, 64, True, None, 0.0, request)


def _call(**over):
    b, hk, d = 2, 2, 32
    args = dict(q=torch.randn(b, 1, 4, d), k_cache=torch.randn(b, 64, hk, d), v_cache=torch.randn(b, 64, hk, d),
                k_new=torch.randn(b, 1, hk, d), v_new=torch.randn(b, 1, hk, d),
                cache_seqlens=torch.tensor([3, 10], dtype=torch.int32))
    args.update(over)
    return args


@pytest.mark.parametrize("name,over,exc,match", [
    ("seqlens-int64", dict(cache_seqlens=torch.tensor([3, 10])), TypeError, r"cache_seqlens: dtype must be int32"),
    ("seqlens-negative", dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError,
     r"cache_seqlens: entry 0 is -1"),
    ("seqlens-full", dict(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), ValueError,
     r"cache_seqlens: entry 1 is 64: with the 1 new keys of k_new the sequence needs 65 slots, but the cache holds 64"),
    ("seqlens-length", dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), ValueError,
     r"cache_seqlens: expected 2 entries"),
    ("no-seqlens", dict(cache_seqlens=None), ValueError, r"cache_seqlens: needed with k_new"),
    ("v-new-alone", dict(k_new=None), ValueError, r"k_new: needed with v_new"),
    ("k-new-alone", dict(v_new=None), ValueError, r"v_new: needed with k_new"),
    ("k-new-shape", dict(k_new=torch.randn(2, 1, 3, 32)), ValueError, r"k_new: shape must be \(B=2, S_new, H_kv=2"),
    ("v-new-shape", dict(v_new=torch.randn(2, 2, 2, 32)), ValueError, r"v_new: shape differs from k_new's"),
    ("k-new-dtype", dict(k_new=torch.randn(2, 1, 2, 32).half()), TypeError, r"k_new: dtype float16 differs"),
    ("cache-dtype", dict(v_cache=torch.randn(2, 64, 2, 32).double()), TypeError, r"v_cache: dtype float64"),
    ("cache-3d", dict(k_cache=torch.randn(2, 64, 64)), ValueError, r"k_cache: expected a 4-D array"),
    ("cache-batch", dict(k_cache=torch.randn(1, 64, 2, 32), v_cache=torch.randn(1, 64, 2, 32)), ValueError,
     r"k_cache: batch 1 differs from q's 2"),
    ("cache-heads", dict(k_cache=torch.randn(2, 64, 3, 32), v_cache=torch.randn(2, 64, 3, 32)), ValueError,
     r"k_cache: 3 heads do not divide q's 4 heads"),
    ("cache-v-shape", dict(v_cache=torch.randn(2, 32, 2, 32)), ValueError,
     r"v_cache: shape \(2, 32, 2, 32\) differs from k_cache's \(2, 64, 2, 32\)"),
    ("cache-requires-grad", dict(k_cache=torch.randn(2, 64, 2, 32, requires_grad=True)), ValueError,
     r"k_cache: requires grad, but attention_with_kvcache is inference only"),
    ("sinks-requires-grad", dict(sinks=torch.zeros(4, requires_grad=True)), ValueError,
     r"sinks: requires grad"),
])
def test_kvcache_errors_contiguous(name, over, exc, match):
    """Each bad call raises naming the argument, and writes nothing into the cache."""
    _assert_refused(_call(**over), exc, match)


@pytest.mark.parametrize("over,exc,match", [
    (dict(k_cache=torch.randn(2, 64, 2, 32).double()), TypeError, r"k_cache: dtype float64"),
    (dict(v_cache=torch.randn(2, 64, 2, 16)), ValueError, r"v_cache: head dim 16 differs from q's 32"),
    (dict(k_cache=torch.randn(2, 64, 3, 32), v_cache=torch.randn(2, 64, 3, 32)), ValueError,
     r"k_cache: 3 heads do not divide q's 4 heads"),
])
def test_kvcache_errors_without_cache_arguments(over, exc, match):
    """A call with the cache alone (no cache_seqlens, block_table or new keys) still names k_cache and v_cache."""
    args = _call(**over)
    for key in ("k_new", "v_new", "cache_seqlens"):
        args.pop(key)
    _assert_refused(args, exc, match)


def _assert_refused(args, exc, match):
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    before = [kc.clone(), vc.clone()]
    with pytest.raises(exc, match=match):
        fattn.attention_with_kvcache(q, kc, vc, **args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def _paged(**over):
    pool = dict(k_cache=torch.randn(6, 16, 2, 32), v_cache=torch.randn(6, 16, 2, 32),
                block_table=torch.tensor([[0, 3], [5, 1]], dtype=torch.int32))
    pool.update(over)
    return _call(**pool)


@pytest.mark.parametrize("name,over,exc,match", [
    ("table-range", dict(block_table=torch.tensor([[0, 6], [5, 1]], dtype=torch.int32)), ValueError,
     r"block_table: entry \[0, 1\] is 6, not a page of the cache \(0 \.\. 5\)"),
    ("table-negative", dict(block_table=torch.tensor([[0, 3], [-1, 1]], dtype=torch.int32)), ValueError,
     r"block_table: entry \[1, 0\] is -1"),
    ("table-int64", dict(block_table=torch.tensor([[0, 3], [5, 1]])), TypeError, r"block_table: dtype must be int32"),
    ("table-rows", dict(block_table=torch.tensor([[0, 3]], dtype=torch.int32)), ValueError,
     r"block_table: 1 rows, but q has batch 2"),
    ("table-1d", dict(block_table=torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"block_table: expected a 2-D"),
    ("table-strided", dict(block_table=torch.tensor([[0, 9, 3, 9], [5, 9, 1, 9]], dtype=torch.int32)[:, ::2]),
     ValueError, r"block_table: must be contiguous"),
    ("page-size", dict(k_cache=torch.randn(6, 8, 2, 32), v_cache=torch.randn(6, 8, 2, 32)), ValueError,
     r"k_cache: page size 8 .* is not a multiple of 16"),
    ("pools-differ", dict(v_cache=torch.randn(5, 16, 2, 32)), ValueError, r"v_cache: 5 pages of 16 differ"),
    ("too-short", dict(cache_seqlens=torch.tensor([32, 3], dtype=torch.int32)), ValueError,
     r"cache_seqlens: entry 0 is 32: with the 1 new keys of k_new the sequence needs 33 slots, but the cache holds 32"),
])
def test_kvcache_errors_paged(name, over, exc, match):
    _assert_refused(_paged(**over), exc, match)


def test_kvcache_bad_sinks_write_nothing():
    """sinks are checked before the new keys go into the cache."""
    _assert_refused(_call(sinks=torch.zeros(3)), ValueError, r"sinks: expected a 1-D array of H=4 entries")
    # strided sinks pass Python's checks and are refused by _C.forward's, still before the append
    _assert_refused(_call(sinks=torch.zeros(8)[::2]), ValueError, r"sinks: must be contiguous")


def test_kvcache_refused_variant_writes_nothing():
    """A call refused at planning (a variant that cannot run here) leaves the cache as it was."""
    args = _call()
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    before = kc.clone()
    with pytest.raises(ValueError, match="variant"):
        fattn.attention_with_kvcache(q, kc, vc, variant="v1", **args)
    assert torch.equal(kc, before)


def test_kvcache_numpy_and_read_only():
    """NumPy arrays work; a read-only cache is refused when k_new would be written into it."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((1, 32, 1, 16), dtype=np.float32)
    vc = rng.standard_normal((1, 32, 1, 16), dtype=np.float32)
    q = rng.standard_normal((1, 1, 2, 16), dtype=np.float32)
    kn = rng.standard_normal((1, 1, 1, 16), dtype=np.float32)
    lens = np.array([5], dtype=np.int32)
    out = fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=kn, cache_seqlens=lens)
    assert np.array_equal(kc[0, 5], kn[0, 0]) and out.shape == q.shape
    kc.flags.writeable = False
    with pytest.raises(ValueError, match="k_cache: the array is read-only"):
        fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=kn, cache_seqlens=lens)


@pytest.mark.gpu
def test_kvcache_v2_split_decode(seed, request):
    """A small decode batch over long caches: v2 splits the keys (flash-decoding) and merges the splits per
    sequence; paged and not, against the reference."""
    require("cuda")
    lens, b, h, hk, d = [3000, 17, 1025], 3, 8, 2, 128
    for paged in (None, 16, 64):
        k_cache, v_cache, table = make_cache(b, 4096, hk, d, torch.float16, "cuda", seed, paged)
        q = randn((b, 1, h, d), torch.float16, "cuda", seed + 2)
        cs = torch.tensor(lens, dtype=torch.int32, device="cuda")
        plan = fattn._C._dev.plan(q, k_cache, v_cache, torch.empty_like(q), causal=2, layout=1, cache_seqlens=cs,
                                  block_table=table, variant="v2")
        assert plan["splits"] > 1 and plan["head_group"] == 4, plan  # split keys, GQA-packed rows
        out, lse = fattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cs, block_table=table,
                                                return_lse=True, variant="v2")
        for i, n in enumerate(lens):
            check_sequence(out, lse, q, k_cache, v_cache, table, i, n, True, None, 0.0, request)


@pytest.mark.gpu
def test_kvcache_small_pages_split_more():
    """Paged decode with pages smaller than v2's key block splits the keys for up to four blocks per SM (each split
    at least 32 key blocks long) where the contiguous rule gives fewer: the plans of one decode step on both caches."""
    require("cuda")
    b, h, hk, d, sk, ps = 8, 32, 8, 128, 8192, 16
    q = torch.empty((b, 1, h, d), dtype=torch.float16, device="cuda")
    kc = torch.empty((b, sk, hk, d), dtype=torch.float16, device="cuda")
    pool = torch.empty((b * sk // ps, ps, hk, d), dtype=torch.float16, device="cuda")
    table = torch.arange(b * sk // ps, dtype=torch.int32, device="cuda").reshape(b, -1)
    cs = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    plan = lambda kv, t: fattn._C._dev.plan(q, kv, kv, torch.empty_like(q), causal=2, layout=1, cache_seqlens=cs,
                                            block_table=t, variant="v2")
    contiguous, paged = plan(kc, None), plan(pool, table)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks, nkb = b * hk, sk // fattn._C._dev.configs("v2")[paged["config"]]["bc"]
    assert paged["config"] == contiguous["config"] and paged["grid"][0] == contiguous["grid"][0] == blocks
    n = max(min(sms * 4 // blocks, nkb // 32), contiguous["splits"])
    per = -(-nkb // n)
    assert paged["splits"] == -(-nkb // per), (paged, contiguous, sms)
    if sms * 4 // blocks > contiguous["splits"]:  # an H100: 8 splits for 4
        assert paged["splits"] > contiguous["splits"]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_v2_decode_gqa_packing(layout, causal, seed, request):
    """Sq = 1 with GQA: v2 packs each kv head's query heads as rows (head_group = H / H_kv) unless the mask makes the
    row see less than every key (top-left causal); the result and LSE are right either way, strided q included."""
    require("cuda")
    b, h, hk, sk, d = 3, 16, 4, 777, 128
    big = randn((b, h, 2, d) if layout == "bhsd" else (b, 2, h, d), torch.float16, "cuda", seed)
    q = big[:, :, :1] if layout == "bhsd" else big[:, :1]
    shape_kv = (b, hk, sk, d) if layout == "bhsd" else (b, sk, hk, d)
    k, v = randn(shape_kv, torch.float16, "cuda", seed + 1), randn(shape_kv, torch.float16, "cuda", seed + 2)
    out, lse = fattn.attention(q, k, v, causal=causal, layout=layout, return_lse=True, variant="v2")
    plan = fattn._C._dev.plan(q, k, v, out, lse, causal={False: 0, "top_left": 1, "bottom_right": 2}[causal],
                              layout=0 if layout == "bhsd" else 1, variant="v2")
    assert plan["head_group"] == (1 if causal == "top_left" else h // hk), plan
    t = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    why, _, _ = accuracy.check_attention(t(out), t(q), t(k), t(v), causal, None, lse)
    assert why is None, f"{why}. {repro(request)}"


def test_kvcache_check_indices_false_trusts_values():
    """check_indices=False: shapes and dtypes are still checked; the values are not read (a valid call gives the
    same result as the checked one)."""
    args = _paged()
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    kc2, vc2 = kc.clone(), vc.clone()
    a = fattn.attention_with_kvcache(q, kc, vc, **args)
    b = fattn.attention_with_kvcache(q, kc2, vc2, check_indices=False, **args)
    assert torch.equal(a, b) and torch.equal(kc, kc2)
    with pytest.raises(TypeError, match="block_table: dtype must be int32"):
        fattn.attention_with_kvcache(q, kc, vc, check_indices=False, **dict(args, block_table=args["block_table"].long()))


def test_kvcache_under_torch_compile_and_fake(seed):
    """Under torch.compile (aot_eager: functionalization sees the op's declared cache writes) the call gives the
    eager call's output and writes the same cache slots; fake tensors get shapes; opcheck passes."""
    b, hk, h, d = 2, 2, 4, 32
    kc, vc = randn((b, 64, hk, d), torch.float32, "cpu", seed), randn((b, 64, hk, d), torch.float32, "cpu", seed + 1)
    kn, vn = randn((b, 3, hk, d), torch.float32, "cpu", seed + 2), randn((b, 3, hk, d), torch.float32, "cpu", seed + 3)
    q = randn((b, 3, h, d), torch.float32, "cpu", seed + 4)
    lens = torch.tensor([5, 40], dtype=torch.int32)

    def step(q, kc, vc):
        return fattn.attention_with_kvcache(q, kc, vc, k_new=kn, v_new=vn, cache_seqlens=lens, softcap=4.0)

    ke, ve = kc.clone(), vc.clone()
    want = step(q, ke, ve)
    kg, vg = kc.clone(), vc.clone()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, kg, vg)
    assert torch.equal(got, want)
    assert torch.equal(kg, ke) and torch.equal(vg, ve)  # the compiled call wrote the same slots
    assert not torch.equal(kg, kc)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, kc, vc))
        assert fattn.attention_with_kvcache(fq, fk, fv, return_lse=True)[1].shape == (b, h, 3)
    torch.library.opcheck(torch.ops.fattn.attention_with_kvcache.default,
                          (q, kc.clone(), vc.clone(), kn, vn, lens, None, 2, -1, -1, 0.0, None, None, True, None,
                           None))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 128, 256])
def test_kvcache_v3_paged_chunked_prefill(d, page_size, seed, request):
    """v3 on a paged cache (chunked prefill: 200 new queries and keys a sequence, GQA), every page size: planned by
    v3 (each key block of 128 keys -- 64 at D=256 -- loaded in pieces, each from the page the block table names;
    pieces past a sequence's keys name no page; at D=96 the boxes' columns past D zero-filled); per sequence against
    the float64 reference, and equal to v3's call on the same keys in a contiguous cache (the same blocks in shared
    memory)."""
    require("cuda")
    lens, s_new, b, h, hk = [0, 300, 1000], 200, 3, 8, 2
    capacity = 1280
    for dname in ("fp16", "bf16"):
        dt = DT[dname]
        k_cache, v_cache, table = make_cache(b, capacity, hk, d, dt, "cuda", seed, page_size)
        q, k_new, v_new = (randn((b, s_new, n, d), dt, "cuda", seed + i) for i, n in ((2, h), (3, hk), (4, hk)))
        cache_seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        plan = fattn._C._dev.plan(q, k_cache, v_cache, torch.empty_like(q), layout=1, causal=2, variant="v3",
                                  cache_seqlens=cache_seqlens, block_table=table)
        assert plan["variant"] == "v3", f"pages of {page_size}: {plan}"
        out, lse = fattn.attention_with_kvcache(q, k_cache, v_cache, k_new=k_new, v_new=v_new,
                                                cache_seqlens=cache_seqlens, block_table=table, return_lse=True,
                                                variant="v3")
        for i, n in enumerate(lens):
            check_sequence(out, lse, q, k_cache, v_cache, table, i, n + s_new, True, None, 0.0, request)
        # the same keys in a contiguous cache (what the paged call attended to, its new keys included)
        kc = torch.stack([keys_of(k_cache, table, i, capacity) for i in range(b)])
        vc = torch.stack([keys_of(v_cache, table, i, capacity) for i in range(b)])
        lens_after = torch.tensor([n + s_new for n in lens], dtype=torch.int32, device="cuda")
        want, want_lse = fattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lens_after, return_lse=True,
                                                      variant="v3")
        err = (out.float() - want.float()).abs().max().item()
        assert err <= 1e-3 * max(1.0, want.float().abs().max().item()), f"{dname}: paged vs contiguous {err}. {repro(request)}"
        assert (lse - want_lse).abs().max().item() <= 1e-4, f"{dname}: LSE paged vs contiguous. {repro(request)}"
        # the static schedule's paged kernel: the call captured in a CUDA graph (no counter there), equal to it eager
        def paged(out=None):
            return fattn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens_after, block_table=table,
                                                variant="v3", check_indices=False, out=out)
        eager, got = paged(), torch.empty_like(q)
        replay_captured(lambda: paged(got), got)
        assert torch.equal(got, eager), f"{dname}: the captured paged call differs. {repro(request)}"
