"""The tuned-config cache: configurations found by `python -m fattn.tune evo ... --save`, consulted by
fattn.attention by default.

File: $FATTN_TUNED_CACHE, default ~/.cache/fattn/tuned.json:

    {"format": "fattn-tuned/1",
     "entries": [{"family": "v2", "device": {"name": "NVIDIA H100 80GB HBM3", "arch": 90, "sms": 132},
                  "dtype": "fp16", "head_dim": 128, "causal": false, "seq_bucket": 2,
                  "config": {"warps": 4, "mt": 2, "bc": 64, "stages": 1},
                  "sources": "<sha256 of the kernel sources>", "fattn": "0.x", "p50_us": ..., "default_p50_us": ...,
                  "shape": [B, H, Sq, Sk, D]}, ...]}

Key: (family, device name, arch, SM count, dtype, head dim, causal, sequence bucket = fattn._C._dev.seq_bucket(Sq, Sk):
Sk in <= 512, <= 1k, ... <= 32k, more, times whether Sq fits one 64-row tile).  The CPU's device is its model
name and CPU count.  Entries are registered with the C extension on the first call to a device, so a call costs
one table lookup in C.  A corrupt file, or an entry that is stale (tuned against other kernel sources or another
fattn version) or that no longer passes keep(), is ignored with a warning: a call never fails because of the cache.
"""
import json
import os
import platform
import tempfile
import threading
import warnings

from . import _C, _frameworks

FORMAT = "fattn-tuned/1"
KEY_FIELDS = ("family", "device", "dtype", "head_dim", "causal", "seq_bucket")  # what identifies an entry
LOADED = set()       # (device_type, device_id) whose entries are registered
_loading = set()     # those being registered now (a registration that calls back in returns at once)
_lock = threading.RLock()  # one registration at a time: a thread's first call waits for another's to finish
_sources = None


def path():
    p = os.environ.get("FATTN_TUNED_CACHE")
    if p:
        return p
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fattn", "tuned.json")


def sources_id():
    """sha256 of the kernel and C sources when they are present (editable installs), else the fattn version."""
    global _sources
    if _sources is None:
        from . import __version__, _rtc

        try:
            _sources = _rtc.source_hash(patterns=_rtc.ALL_SOURCES)
        except Exception:
            _sources = "fattn-" + __version__
    return _sources


def cpu_device():
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"name": model, "cpus": os.cpu_count() or 1}


def gpu_device(device_id):
    name, arch, sms = _C.device_info(device_id)
    return {"name": name, "arch": arch, "sms": sms}


def _read(p):
    with open(p) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"not a {FORMAT} file")
    return data["entries"]


def entries(p=None):
    """The cache's entries; [] (with a warning) if the file is unreadable or corrupt, [] if absent."""
    p = p or path()
    if not os.path.exists(p):
        return []
    try:
        return _read(p)
    except (OSError, ValueError) as e:
        warnings.warn(f"fattn: ignoring the tuned-config cache {p}: {e}", RuntimeWarning, stacklevel=3)
        return []


def _register(e, dev_type, dev_id):
    """Registers one entry for the device if it matches it; returns a reason when it is skipped as stale/invalid."""
    from .tune.space import CPUSpace, Problem, V2Space

    family = e["family"]
    want = cpu_device() if dev_type == "cpu" else gpu_device(dev_id)
    if e["device"] != want:
        return None  # another machine's entry: not an error
    if e.get("sources") != sources_id():
        return "stale: tuned against other kernel sources"
    d, dtype, causal, bucket = int(e["head_dim"]), e["dtype"], bool(e["causal"]), int(e["seq_bucket"])
    cfg = dict(e["config"])
    shape = e.get("shape") or [1, 1, 1024, 1024, d]
    prob = Problem(shape[0], shape[1], shape[2], shape[3], d, causal, dtype, dev_type)
    if family == "cpu" and dev_type == "cpu":
        ok, why = CPUSpace().keep(cfg, prob)
        if not ok:
            return f"invalid: {why}"
        _C._dev.tuned_set("cpu", 0, dtype, d, causal, bucket, (cfg["br"], cfg["bc"], cfg["threads"]))
    elif family == "v2" and dev_type == "cuda":
        space = V2Space()
        ok, why = space.keep(cfg, prob)
        if not ok:
            return f"invalid: {why}"
        from . import _rtc

        idx = _rtc.v2_index(space.full(cfg, prob), dtype, want["arch"])
        _C._dev.tuned_set("v2", dev_id, dtype, d, causal, bucket, idx)
    else:
        return None
    return ""


def ensure(dev_type, dev_id):
    """Registers the cache's entries for one device, once per process.  Never raises."""
    key = (dev_type, dev_id)
    if key in LOADED:
        return
    with _lock:  # LOADED names a device only once its entries are registered: concurrent first calls wait here
        if key in LOADED or key in _loading:
            return
        _loading.add(key)
        try:
            kind = "cpu" if dev_type == _frameworks.CPU else "cuda"
            for e in entries():
                try:
                    why = _register(e, kind, dev_id)
                except Exception as exc:  # a malformed entry, a failed compile: warn and go on
                    why = f"{type(exc).__name__}: {exc}"
                if why:
                    warnings.warn(f"fattn: ignoring tuned-config entry {e.get('family')}/{e.get('dtype')}/"
                                  f"d{e.get('head_dim')} ({why})", RuntimeWarning, stacklevel=3)
        finally:
            _loading.discard(key)
            LOADED.add(key)


def reset():
    """Forgets every registered entry (the next call re-reads the file)."""
    with _lock:
        LOADED.clear()
        _C._dev.tuned_clear()


def save(new_entries, p=None):
    """Merges entries into the cache file (same key replaces), written atomically; returns the path."""
    p = p or path()
    try:
        old = _read(p) if os.path.exists(p) else []
    except (OSError, ValueError) as e:
        warnings.warn(f"fattn: replacing the unreadable tuned-config cache {p}: {e}", RuntimeWarning, stacklevel=2)
        old = []

    def key(e):
        return (e["family"], json.dumps(e["device"], sort_keys=True), e["dtype"], e["head_dim"], bool(e["causal"]),
                e["seq_bucket"])

    kept = [e for e in old if isinstance(e, dict) and all(k in e for k in KEY_FIELDS)]
    if len(kept) < len(old):
        warnings.warn(f"fattn: dropping {len(old) - len(kept)} malformed entries of the tuned-config cache {p}",
                      RuntimeWarning, stacklevel=2)
    merged = {key(e): e for e in kept}
    for e in new_entries:
        merged[key(e)] = e
    os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(p)), prefix=".tuned-")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "entries": list(merged.values())}, f, indent=1)
    os.replace(tmp, p)
    reset()
    return p
