"""Run-time compilation of kernel configurations (issue: tuning).

The kernels/ sources are compiled by NVRTC (through fattn._C, which opens the library with dlopen on first use) with
one configuration given as macros; the cubin is loaded by the CUDA driver API.  Compiled images are cached on disk:

    key   = sha256(kernel sources, NVRTC options, GPU arch, NVRTC version)
    path  = $FATTN_CACHE_DIR (default ~/.cache/fattn/kernels) / <key>.cubin, written atomically (temp file + rename)

so a second run compiles nothing.  Environment: FATTN_NVRTC (path of libnvrtc.so), FATTN_CUDA_INCLUDE (the CUDA
headers, for cuda_fp16.h), FATTN_CACHE_DIR.
"""
import glob
import hashlib
import os
import sys
import tempfile
import threading

from . import _C

PKG = os.path.dirname(os.path.abspath(__file__))
DTYPE_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16"}
_lock = threading.Lock()
_loaded = {}   # (family, config tuple, dtype, arch) -> table index in this process


class RTCError(RuntimeError):
    """Run-time compilation is unavailable (no NVRTC, no sources) or a configuration failed to compile."""


def source_root():
    """Directory holding kernels/ and csrc/: the source tree (editable installs) or the copy packaged in fattn/_src."""
    for root in (os.path.dirname(PKG), os.path.join(PKG, "_src")):
        if os.path.isfile(os.path.join(root, "kernels", "sm80", "v2_fwd.cu")) and \
                os.path.isfile(os.path.join(root, "csrc", "fattn.h")):
            return root
    raise RTCError("run-time compilation needs fattn's kernels/ sources, which this installation lacks")


def _site_dirs():
    out = []
    for p in sys.path:
        for sub in ("nvidia/cu13", "nvidia/cuda_nvrtc", "nvidia/cuda_runtime"):
            d = os.path.join(p, sub)
            if os.path.isdir(d):
                out.append(d)
    return out


def _cuda_roots():
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return [r for r in roots if r and os.path.isdir(r)]


def nvrtc_path():
    """The libnvrtc.so to open: $FATTN_NVRTC, a CUDA toolkit's, a pip wheel's; "" lets the loader search."""
    if os.environ.get("FATTN_NVRTC"):
        return os.environ["FATTN_NVRTC"]
    for d in [os.path.join(r, sub) for r in _cuda_roots() for sub in ("lib64", "lib")] + \
             [os.path.join(d, "lib") for d in _site_dirs()]:
        hits = sorted(glob.glob(os.path.join(d, "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return ""


def _preload_builtins(lib):
    """NVRTC dlopens libnvrtc-builtins by soname; a pip wheel's copy sits beside libnvrtc.so but off the loader's
    path, so it is loaded first (once it is loaded, its soname resolves)."""
    if not lib or not os.path.isabs(lib):
        return
    for path in sorted(glob.glob(os.path.join(os.path.dirname(lib), "libnvrtc-builtins.so*"))):
        if ".alt." not in path:
            try:
                import ctypes

                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
            return


def cuda_include():
    """Directory with cuda_fp16.h for NVRTC."""
    cands = [os.environ.get("FATTN_CUDA_INCLUDE")] + [os.path.join(r, "include") for r in _cuda_roots()] + \
            [os.path.join(d, "include") for d in _site_dirs()]
    for d in cands:
        if d and os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            return d
    raise RTCError("cuda_fp16.h not found for run-time compilation; set FATTN_CUDA_INCLUDE to the CUDA include dir")


def cache_dir():
    d = os.environ.get("FATTN_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "fattn", "kernels")
    return d


KERNEL_SOURCES = ("kernels/*.cuh", "kernels/*/*.cu", "kernels/*/*.cuh", "kernels/*/*.h", "csrc/*.h")
ALL_SOURCES = KERNEL_SOURCES + ("csrc/*.c", "kernels/*/*.c")


def source_hash(root=None, patterns=KERNEL_SOURCES):
    """sha256 over the files matching `patterns` under the source root (names and contents): by default what a
    run-time compiled kernel is built from."""
    root = root or source_root()
    h = hashlib.sha256()
    files = sorted(f for pat in patterns for f in glob.glob(os.path.join(root, pat)))
    for f in files:
        h.update(os.path.relpath(f, root).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(fh.read() + b"\0")
    return h.hexdigest()


V2_FIELDS = ("dp", "warps", "mt", "bc", "stages")


def v2_options(cfg, dtype, arch):
    """NVRTC options for one v2 configuration (a dict with dp, warps, mt, bc, stages)."""
    root = source_root()
    return ["-std=c++17", f"-arch=sm_{arch}", "-DFATTN_V2_RTC", f"-DV2_T={DTYPE_TYPES[dtype]}",
            f"-DV2_DP={cfg['dp']}", f"-DV2_WARPS={cfg['warps']}", f"-DV2_MT={cfg['mt']}", f"-DV2_BC={cfg['bc']}",
            f"-DV2_STAGES={cfg['stages']}", f"-I{os.path.join(root, 'kernels', 'sm80')}",
            f"-I{os.path.join(root, 'kernels')}", f"-I{os.path.join(root, 'csrc')}", f"-I{cuda_include()}"]


def _atomic_write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def compile_cubin(source_file, options, name):
    """(cubin bytes, from_cache) for `source_file` (relative to the source root) compiled with `options`."""
    root = source_root()
    lib = nvrtc_path()
    _preload_builtins(lib)
    try:
        version = _C._dev.rtc_version(lib)
    except RuntimeError as e:
        raise RTCError(str(e)) from None
    # options carry absolute include paths; the key must not depend on where the tree lives
    key = hashlib.sha256("\n".join([source_hash(root), source_file,
                                    *[o for o in options if not o.startswith("-I")], f"nvrtc {version}"]).encode()
                         ).hexdigest()
    path = os.path.join(cache_dir(), key + ".cubin")
    try:
        with open(path, "rb") as f:
            data = f.read()
        if data[:4] == b"\x7fELF":
            return data, True
    except OSError:
        pass
    with open(os.path.join(root, source_file)) as f:
        src = f.read()
    try:
        cubin, _log = _C._dev.rtc_compile(lib, src, os.path.join(root, source_file), list(options))
    except RuntimeError as e:
        raise RTCError(f"{name}: {e}") from None
    try:
        _atomic_write(path, cubin)
    except OSError as e:  # a read-only cache is not fatal: the image is still used
        print(f"fattn: could not cache {name} in {path}: {e}", file=sys.stderr)
    return cubin, False


def v2_index(cfg, dtype, arch):
    """The v2 config index of `cfg` for `dtype`: an ahead-of-time entry if one matches, else the configuration
    compiled at run time (from the disk cache when it is there) and registered once per process."""
    t = tuple(cfg[f] for f in V2_FIELDS)
    for c in _C._dev.configs("v2"):
        if c["role"] != "runtime" and tuple(c[f] for f in V2_FIELDS) == t and dtype in c["dtypes"]:
            return c["index"]
    key = ("v2", t, dtype, arch)
    with _lock:
        if key not in _loaded:
            cubin, _ = compile_cubin("kernels/sm80/v2_fwd.cu", v2_options(cfg, dtype, arch), f"v2 {t} {dtype}")
            _loaded[key] = _C._dev.add_rtc("v2", t, dtype, cubin, "fattn_v2_rtc")
        return _loaded[key]
