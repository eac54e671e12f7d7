"""Per-instantiation resource report of the compiled kernels (v2's and v3's forward, v3's backward dK/dV kernels):
registers, stack (spill) bytes, shared memory, and the tensor-core instructions in the SASS (HGMMA: wgmma on Hopper;
HMMA: mma.sync) -- from cuobjdump on the built extension, no GPU needed.

    python3 bench/kernel_report.py [path/to/_C.so] > report.md

Dynamic shared memory per block comes from fattn._C.v3_configs() for v3 and from v2's formula
((Br + 2 * stages * Bc) * DP * 2 bytes) for v2; SHARED in cuobjdump's report is static shared memory only.
"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def cuobjdump():
    """(cuobjdump, its environment): fattn.testing.sass finds it (PATH, or PyPI's nvidia-cuda-cuobjdump and
    -nvdisasm wheels)."""
    from fattn.testing import sass
    found = sass.tools()
    if found is None:
        sys.exit("cuobjdump / nvdisasm not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return found


def parse_name(mangled):
    """(variant, dtype, template ints) from a mangled v2_fwd / v3_fwd name, or v3's backward dK/dV kernels (variant
    "v3_bwd": DP, BR, BC, STAGES, DET, MODS; "v3_bwd_wide": BR, BC, STAGES, DET, MODS at DP = 256)."""
    m = re.match(r"_Z(?:6(v[23])_fwd|11v3_bwd_dkdv|16v3_bwd_dkdv(_wide))I(6__half|13__nv_bfloat16)"
                 r"((?:L[ib]\d+E)+)", mangled)
    if not m:
        return None
    variant = m.group(1) or ("v3_bwd_wide" if m.group(2) else "v3_bwd")
    dtype = "fp16" if m.group(3) == "6__half" else "bf16"
    ints = [int(x) for x in re.findall(r"L[ib](\d+)E", m.group(4))]
    return variant, dtype, ints


def main():
    so = sys.argv[1] if len(sys.argv) > 1 else (glob.glob(os.path.join(ROOT, "fattn", "_C*.so")) or [None])[0]
    if not so:
        sys.exit("no built extension: pip install -e . first")
    from fattn.testing import sass as sass_counts
    tool, env = cuobjdump()
    res = subprocess.run([tool, "--dump-resource-usage", so], capture_output=True, text=True, env=env).stdout
    sass = subprocess.run([tool, "-sass", so], capture_output=True, text=True, env=env).stdout
    usage, arch = {}, None
    for line in res.splitlines():
        a = re.search(r"arch = (sm_\w+)", line)
        if a:
            arch = a.group(1)
        f = re.search(r"Function (\S+):", line)
        if f:
            name = f.group(1)
        r = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if r:
            usage[(name, arch)] = tuple(int(x) for x in r.groups())
    # per kernel, summed over the archs it was built for: HGMMA, HMMA and wgmma waits (fattn.testing.sass)
    counts = {name: {"HGMMA": c["HGMMA"], "HMMA": c["HMMA"], "waits": c["DEPBAR"]}
              for name, c in sass_counts.parse(sass).items()}
    from fattn import _C
    smem_of = {(v, tuple(c[f] for f in fields)): c["smem"] for v, fields in
               (("v2", ("dp", "warps", "mt", "bc", "stages")), ("v3", ("dp", "bc", "stages", "consumers", "pingpong")))
               for c in _C._dev.configs(v)}
    print(f"Kernel resources of `{os.path.basename(so)}` (cuobjdump --dump-resource-usage and -sass).\n")
    print("registers: the per-thread count at launch; v3's consumer warpgroups raise theirs with setmaxnreg "
          "(232 with 1 consumer, two blocks per SM; 240 with 2; 160 with 3) and its producer lowers its own "
          "(24 / 24 / 32).  stack bytes: the "
          "spill frame.\n")
    print("wgmma waits: WARPGROUP.DEPBAR instructions; a handful per kernel is the pipeline's own, about one per "
          "HGMMA means ptxas serialized the wgmmas (its C7515-C7520 notes in the build log say why).\n")
    print("| variant | dtype | config | arch | registers | stack bytes | dynamic smem KB | HGMMA | wgmma waits | HMMA |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for (name, arch), (reg, stack, _shared, _local) in usage.items():
        parsed = parse_name(name)
        if not parsed:
            continue
        variant, dtype, ints = parsed
        if variant.startswith("v3_bwd"):  # the backward's dK/dV kernels (their shared memory: v3_bwd_configs.h)
            wide = variant == "v3_bwd_wide"
            # (DP,) BR, BC, STAGES, DET, MODS, SEQ, ZA (zero-ahead, v3_bwd_ring.cuh: v3b_zero), DQ_OUT (dQ added in
            # fp16 straight into dQ, v3_bwd_configs.h: V3_BWD_DQ_OUT)
            dp, br, bc, stages, det, mods, seq, za, dq_out = (([256] if wide else []) + ints + [0, 0, 0])[:9]
            cfg = f"DP={dp} Br={br} Bc={bc} stages={stages}" + (" deterministic" if det else "") + \
                (" mods" if mods else "") + (" varlen" if seq else "") + (" zero-ahead" if za else "") + \
                (" dq-out" if dq_out else "")
            smem = None
        elif variant == "v3":
            dp, bc, stages, cwg, pp = ints[:5]
            mods, seq = (ints[5:7] + [0, 0])[:2]  # score modifiers (softcap / ALiBi), packed batches
            cfg = f"DP={dp} Bc={bc} stages={stages} consumers={cwg} pingpong={pp}" + (" mods" if mods else "") + \
                (" varlen" if seq else "")
            smem = smem_of.get(("v3", (dp, bc, stages, cwg, pp)))
        else:
            dp, warps, mt, bc, stages = ints[:5]
            paged = len(ints) > 5 and ints[5]
            cfg = f"DP={dp} warps={warps} mt={mt} Bc={bc} stages={stages}" + (" paged" if paged else "")
            smem = smem_of.get(("v2", (dp, warps, mt, bc, stages)))
        c = counts.get(name, {"HGMMA": 0, "HMMA": 0, "waits": 0})
        rows.append((variant, dp, cfg, dtype, arch, reg, stack, smem, c["HGMMA"], c["waits"], c["HMMA"]))
    for variant, _dp, cfg, dtype, arch, reg, stack, smem, hg, waits, hm in sorted(rows):
        kb = f"{smem / 1024:.1f}" if smem is not None else "?"
        print(f"| {variant} | {dtype} | {cfg} | {arch} | {reg} | {stack} | {kb} | {hg} | {waits} | {hm} |")


if __name__ == "__main__":
    main()
