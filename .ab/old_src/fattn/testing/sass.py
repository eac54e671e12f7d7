"""The built extension's SASS, read with cuobjdump (which calls nvdisasm): per kernel, its tensor-core instructions
and warpgroup waits.  tests/test_kernel_sass.py checks v3's kernels with it.

    from fattn.testing import sass
    counts = sass.kernels(fattn._C.__file__)      # {mangled name: Counter}, sm_90a's kernels

Each Counter holds HGMMA (wgmma), HGMMA_RS (those whose A operand comes from registers), HGMMA_SS (both operands
from shared memory), HMMA (mma.sync) and DEPBAR (WARPGROUP.DEPBAR: a wait for this warpgroup's wgmma groups).  A
pipelined kernel waits a handful of times; where ptxas serialized the wgmmas (its C7512-C7520 notes: too few
registers, a wgmma under a condition, an accumulator touched while its group runs) it waits after about every one.
"""
import collections
import glob
import importlib.util
import os
import re
import shutil
import subprocess


def tools():
    """(cuobjdump, environment whose PATH has nvdisasm), or None: cuobjdump and nvdisasm on PATH, else from PyPI's
    nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels (nvidia/cuXX/bin)."""
    dirs = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            dirs += sorted(glob.glob(os.path.join(loc, "*", "bin")))
    path = os.pathsep.join(dirs + [os.environ.get("PATH", "")])
    cuobjdump, nvdisasm = shutil.which("cuobjdump", path=path), shutil.which("nvdisasm", path=path)
    if not cuobjdump or not nvdisasm:
        return None
    return cuobjdump, dict(os.environ, PATH=os.pathsep.join([os.path.dirname(nvdisasm), path]))


def parse(text):
    """cuobjdump -sass output -> {mangled kernel name: Counter}."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), collections.Counter())
            continue
        if cur is None:
            continue
        m = re.search(r"\bHGMMA\.\S+\s+R\d+, (\S+)", line)
        if m:
            cur["HGMMA"] += 1
            cur["HGMMA_RS" if re.fullmatch(r"R\d+,?", m.group(1)) else "HGMMA_SS"] += 1
        elif re.search(r"\bHMMA\.", line):
            cur["HMMA"] += 1
        elif "WARPGROUP.DEPBAR" in line:
            cur["DEPBAR"] += 1
    return out


def kernels(so, arch="sm_90a"):
    """The kernels of `so` compiled for `arch`, counted (see parse).  Needs tools()."""
    found = tools()
    if found is None:
        raise RuntimeError("cuobjdump and nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    exe, env = found
    res = subprocess.run([exe, "-sass", "-arch", arch, so], capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"cuobjdump -sass -arch {arch} {so} failed: {res.stderr.strip()[-500:]}")
    return parse(res.stdout)


def family(name):
    """The kernel function's own name from its mangled one ('_Z6v3_fwdI6__half...' -> 'v3_fwd'), or the name."""
    m = re.match(r"_Z(\d+)", name)
    return name[m.end():m.end() + int(m.group(1))] if m else name
