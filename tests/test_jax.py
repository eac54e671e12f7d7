"""fattn.jax: the custom VJP over fattn's kernels, against the float64 reference (skips where JAX is not
installed; the GPU case needs JAX with CUDA and CuPy)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fattn.jax  # noqa: E402
from fattn.testing import reference  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def jax_devices(kind):
    try:
        return jax.devices(kind)
    except RuntimeError:
        return []


def device_and_dtype(device):
    """JAX's first device of this kind and the dtype the tests give it (float32 on the CPU, float16 on the GPU, which
    also needs CuPy); skips where there is none."""
    devs = jax_devices(device)
    if not devs:
        pytest.skip(f"JAX has no {device} device here")
    if device == "gpu":
        pytest.importorskip("cupy")
    return devs[0], jnp.float32 if device == "cpu" else jnp.float16


def device_params():
    out = [pytest.param("cpu", id="cpu")]
    out.append(pytest.param("gpu", id="gpu", marks=pytest.mark.gpu))
    return out


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_jax_forward_and_grad(device, causal):
    dev, dt = device_and_dtype(device)
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 45, 64), (2, 2, 60, 64), (2, 2, 60, 64))]
    q, k, v = (jax.device_put(jnp.asarray(x, dt), dev) for x in host)
    w = jax.device_put(jnp.asarray(rng.standard_normal((2, 4, 45, 64)), jnp.float32), dev)

    def loss(q, k, v):
        return (fattn.jax.attention(q, k, v, causal=causal).astype(jnp.float32) * w).sum()

    out = fattn.jax.attention(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    qn, kn, vn = (np.asarray(x.astype(jnp.float32)) for x in (q, k, v))
    ref, _ = reference.attention(qn, kn, vn, causal)
    tol = 1e-5 if device == "cpu" else 5e-3
    assert np.abs(np.asarray(out.astype(jnp.float32)) - ref).max() < tol
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    refs = reference.gradients(qn, kn, vn, np.asarray(w), causal)
    for g, r, x in zip(grads, refs, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert np.abs(np.asarray(g.astype(jnp.float32)) - r).max() < (1e-4 if device == "cpu" else 5e-2) * max(
            1.0, np.abs(r).max())
    # the inputs are untouched (nothing is written into a JAX array)
    for x, h in zip((q, k, v), host):
        assert np.array_equal(np.asarray(x), np.asarray(jnp.asarray(h, dt)))


def test_jax_under_jit_is_a_clear_error():
    q = jnp.zeros((1, 1, 4, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"q: fattn.jax.attention runs eagerly, outside JAX's transformations \(jax.jit"):
        jax.jit(lambda q: fattn.jax.attention(q, q, q))(q)
    with pytest.raises(TypeError, match="q: expected a jax.Array, got numpy.ndarray"):
        fattn.jax.attention(np.zeros((1, 1, 4, 8), np.float32), q, q)
    with pytest.raises(TypeError, match="k: expected a jax.Array, got numpy.ndarray"):
        fattn.jax.attention(q, np.zeros((1, 1, 4, 8), np.float32), q)


def test_jax_transforms_and_bad_arguments_are_named():
    """What fattn.jax does not take yet raises naming the argument or the transformation: grad of grad and jacrev
    (batched cotangents), jax.checkpoint, a traced scale or softcap, a dtype the device does not take, a torch
    tensor; first-order grad works."""
    q = jnp.ones((1, 2, 8, 16), jnp.float32)

    def loss(q):
        return fattn.jax.attention(q, q, q).sum()
    with pytest.raises(NotImplementedError, match="batched or higher-order differentiation"):
        jax.jacrev(lambda q: fattn.jax.attention(q, q, q))(q)
    for transformed in (lambda: jax.grad(lambda q: jax.grad(loss)(q).sum())(q), lambda: jax.hessian(loss)(q),
                        lambda: jax.grad(jax.checkpoint(loss))(q)):
        with pytest.raises(TypeError, match="q: fattn.jax.attention runs eagerly.*checkpoint.*grad of grad"):
            transformed()
    for name in ("scale", "softcap"):
        with pytest.raises(TypeError, match=f"{name}: a traced value; fattn reads {name} as a constant"):
            jax.grad(lambda s: fattn.jax.attention(q, q, q, **{name: s}).sum())(0.5)
    with pytest.raises(TypeError, match=r"q: dtype float8_e4m3fn is not supported on (cpu; use float16 or float32|"
                       r"cuda; use float16, bfloat16 or float32)"):
        fattn.jax.attention(q.astype(jnp.float8_e4m3fn), q, q)
    with pytest.raises(TypeError, match="v: expected a jax.Array, got torch.Tensor"):
        fattn.jax.attention(q, q, torch.zeros(1, 2, 8, 16))
    assert jax.grad(loss)(q).shape == q.shape


_TWO_CPU_DEVICES = r"""
import jax, jax.numpy as jnp, numpy as np, fattn.jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
cpus = jax.devices("cpu")
assert len(cpus) == 2
q1 = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 8, 16)), jnp.float32), cpus[1])
out = fattn.jax.attention(q1, q1, q1)  # every array on cpu:1
assert out.devices() == {cpus[1]}
ref = fattn.jax.attention(jax.device_put(q1, cpus[0]), jax.device_put(q1, cpus[0]), jax.device_put(q1, cpus[0]))
assert np.array_equal(np.asarray(out), np.asarray(ref))
g = jax.grad(lambda q: fattn.jax.attention(q, q, q).sum())(q1)
assert g.devices() == {cpus[1]}
def refused(fn, match):
    try:
        fn()
    except ValueError as e:
        assert match in str(e), str(e)
    else:
        raise AssertionError("accepted: " + match)
refused(lambda: fattn.jax.attention(q1, jax.device_put(q1, cpus[0]), q1), "k: on cpu:0 but q is on cpu:1")
sharded = jax.device_put(q1, NamedSharding(Mesh(np.array(cpus), ("b",)), P("b")))
refused(lambda: fattn.jax.attention(sharded, sharded, sharded), "q: a jax.Array spread over 2 devices")
print("ok")
"""


def test_jax_second_cpu_device_and_sharded_arrays():
    """JAX's virtual CPU devices (XLA's host device count): arrays on cpu:1 run there, results and gradients stay
    there; arrays on two devices, or one array sharded over both, are refused naming the argument."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _TWO_CPU_DEVICES], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_jax_arrays_in_fattn_attention_name_the_missing_result():
    """fattn's array functions given JAX arrays cannot allocate their results like them (JAX arrays are immutable):
    the error names the result and, where the call takes it as a keyword, says to pass it."""
    q = jax.device_put(jnp.zeros((1, 1, 4, 8), jnp.float32), jax.devices("cpu")[0])
    with pytest.raises(TypeError, match=r"out: JAX arrays are immutable.*pass a writable .* as out="):
        fattn.attention(q, q, q)
    with pytest.raises(TypeError, match=r"lse: JAX arrays are immutable.*pass a writable .* as lse="):
        fattn.attention(q, q, q, out=np.empty((1, 1, 4, 8), np.float32), return_lse=True)
    with pytest.raises(TypeError, match=r"dq: JAX arrays are immutable.*pass a writable .* as dq="):
        fattn.attention_backward(q, q, q, q, q, jnp.zeros((1, 1, 4), jnp.float32))
    p = jax.device_put(jnp.zeros((6, 1, 8), jnp.float32), jax.devices("cpu")[0])
    cu = np.array([0, 2, 6], np.int32)
    with pytest.raises(TypeError, match=r"lse: JAX arrays are immutable.*takes no lse= to write into"):
        fattn.attention_varlen(p, p, p, cu, cu, out=np.empty((6, 1, 8), np.float32), return_lse=True)


def test_jax_bfloat16_on_the_cpu_is_a_clear_error():
    """bfloat16 on the CPU is refused naming the argument (NumPy, through which JAX's CPU buffers are read, has no
    bfloat16 in DLPack); before, it failed inside NumPy with "Unsupported dtype in DLTensor"."""
    q = jax.device_put(jnp.zeros((1, 1, 4, 8), jnp.bfloat16), jax.devices("cpu")[0])
    with pytest.raises(TypeError, match="q: bfloat16 is not taken on the CPU"):
        fattn.jax.attention(q, q, q)


@pytest.mark.parametrize("window,softcap,alibi", [((20, 5), 0.0, False), ((-1, -1), 3.0, False),
                                                 ((-1, -1), 0.0, True), ((30, -1), 2.0, True)],
                         ids=["window", "softcap", "alibi", "all"])
def test_jax_window_softcap_alibi(window, softcap, alibi):
    """The keywords reach the kernels forward and backward (CPU), against the float64 reference; ALiBi's slopes get
    a zero gradient."""
    devs = jax_devices("cpu")
    rng = np.random.default_rng(1)
    host = [rng.standard_normal(s).astype(np.float32) * 2 for s in ((2, 4, 45, 64), (2, 2, 60, 64), (2, 2, 60, 64))]
    q, k, v = (jax.device_put(jnp.asarray(x), devs[0]) for x in host)
    # every array on the CPU device (on a GPU machine JAX's default device is the GPU)
    w = jax.device_put(jnp.asarray(rng.standard_normal((2, 4, 45, 64)), jnp.float32), devs[0])
    al = jax.device_put(jnp.asarray(rng.uniform(0.05, 0.5, (2, 4)), jnp.float32), devs[0]) if alibi else None
    kw = dict(causal="bottom_right", window=window, softcap=softcap, alibi_slopes=al)

    def loss(q, k, v, al):
        return (fattn.jax.attention(q, k, v, **{**kw, "alibi_slopes": al}) * w).sum()

    out = fattn.jax.attention(q, k, v, **kw)
    aln = None if al is None else np.asarray(al)
    ref, _ = reference.attention(*host, "bottom_right", None, window, softcap=softcap, alibi=aln)
    assert np.abs(np.asarray(out) - ref).max() < 1e-5
    grads = jax.grad(loss, argnums=(0, 1, 2, 3) if alibi else (0, 1, 2))(q, k, v, al)
    refs = reference.gradients(*host, np.asarray(w), "bottom_right", None, window, softcap, aln)
    for g, r in zip(grads, refs):
        assert np.abs(np.asarray(g) - r).max() < 1e-4 * max(1.0, np.abs(r).max())
    if alibi:
        assert not np.asarray(grads[3]).any()


def _sink_reference(q, k, v, sinks, causal):
    """Attention with sinks in plain jax.numpy (float32): the sink one more score column whose value row is zero;
    GQA by repeating kv heads; causal bottom-right."""
    h, hk = q.shape[1], k.shape[1]
    k, v = jnp.repeat(k, h // hk, axis=1), jnp.repeat(v, h // hk, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        keep = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
        s = jnp.where(keep, s, -jnp.inf)
    col = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, col], -1), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p[..., :-1], v)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("causal", [False, True])
def test_jax_sinks_forward_and_grad(device, causal):
    """sinks reach the kernels forward and backward (on the CPU in float32; on the GPU in float16, sinks float32),
    against the same attention written in jax.numpy (on JAX's CPU, in float32, from the inputs as given), dsinks
    included; rows that see no key (Sq > Sk, bottom-right) get O' = 0."""
    (dev, dt), cpu = device_and_dtype(device), jax_devices("cpu")
    rng = np.random.default_rng(2)
    q, k, v = (jax.device_put(jnp.asarray(rng.standard_normal(s), dt), dev)
               for s in ((2, 4, 37, 32), (2, 2, 29, 32), (2, 2, 29, 32)))
    w = jax.device_put(jnp.asarray(rng.standard_normal((2, 4, 37, 32)), jnp.float32), dev)
    sinks = jax.device_put(jnp.asarray(rng.standard_normal(4) * 2, jnp.float32), dev)
    mode = "bottom_right" if causal else False

    def loss(fn):
        return lambda q, k, v, s: (fn(q, k, v, s).astype(jnp.float32) * w).sum()

    mine = lambda q, k, v, s: fattn.jax.attention(q, k, v, causal=mode, sinks=s)  # noqa: E731
    # the reference: the same values in float32 on the CPU
    qr, kr, vr, wr, sr = (jax.device_put(x.astype(jnp.float32), cpu[0]) for x in (q, k, v, w, sinks))
    out, want = mine(q, k, v, sinks), _sink_reference(qr, kr, vr, sr, causal)
    assert out.dtype == dt
    out = np.asarray(out.astype(jnp.float32))
    if causal:  # rows 0 .. 7 see no key: the reference's softmax puts all weight on the sink, O = 0
        assert not out[:, :, :8].any()
    assert np.abs(out - np.asarray(want)).max() < (1e-5 if device == "cpu" else 5e-3)
    got = jax.grad(loss(mine), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    exp = jax.grad(lambda q, k, v, s: (_sink_reference(q, k, v, s, causal) * wr).sum(),
                   argnums=(0, 1, 2, 3))(qr, kr, vr, sr)
    for name, g, r, x in zip(("dq", "dk", "dv", "dsinks"), got, exp, (q, k, v, sinks)):
        r = np.asarray(r)
        assert g.shape == r.shape and g.dtype == x.dtype, name
        rel = 1e-4 if device == "cpu" else 5e-2
        assert np.abs(np.asarray(g.astype(jnp.float32)) - r).max() < rel * max(1.0, np.abs(r).max()), name

