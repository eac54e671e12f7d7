"""The Hopper kernels as compiled (issue 16's SASS check, and v3's forward alike): every GEMM of v3's forward (S = Q K^T,
O += P V) and backward (S^T, dP^T, dV += P^T dO, dK += dS^T Q, dQ = dS K) runs on the asynchronous tensor cores
(HGMMA), none on mma.sync (HMMA), and ptxas serialized none of their wgmmas.  Reads the built extension's sm_90a
code with cuobjdump (fattn.testing.sass), so it runs on any machine that built the kernels -- CI's included, no GPU
needed; it skips where the kernels were not built (no nvcc) or the disassembler is missing."""
import pytest

from fattn import _C
from fattn.testing import sass


def needs_kernels(test):
    test = pytest.mark.skipif(not _C.cuda_compiled, reason="built without CUDA kernels (no nvcc, or FATTN_NO_CUDA=1)")(test)
    return pytest.mark.skipif(sass.tools() is None, reason="needs cuobjdump and nvdisasm: pip install "
                              "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")(test)


# The kernels with GEMMs; their other kernels (the backward's preprocessing and dQ convert) have none.
GEMM_KERNELS = ("v3_fwd", "v3_bwd_dkdv", "v3_bwd_dkdv_wide")
# A pipelined kernel waits on its wgmma groups a handful of times (4-6 in every v3 kernel at 5dcfd2d); a serialized
# one after about every wgmma (16-48 of them a kernel).
MAX_WAITS = 8


@pytest.fixture(scope="module")
def v3_kernels():
    found = {}
    for name, counts in sass.kernels(_C.__file__).items():
        fam = sass.family(name)
        if fam in GEMM_KERNELS:
            found.setdefault(fam, {})[name] = counts
    return found


@needs_kernels
def test_every_v3_gemm_kernel_was_built(v3_kernels):
    """Both dtypes of each kernel family, and as many kernels as its tables compile at least (two per family)."""
    for fam in GEMM_KERNELS:
        names = v3_kernels.get(fam, {})
        assert len(names) >= 2, (fam, sorted(names))
        assert any("__half" in n for n in names) and any("__nv_bfloat16" in n for n in names), fam


@needs_kernels
def test_v3_gemms_run_on_hgmma_unserialized(v3_kernels):
    """Per kernel: HGMMA present, no HMMA, a handful of waits (MAX_WAITS) and fewer than one per four wgmmas; the
    forward's P V and the narrow backward's dV / dK take their A operand from registers (P, dS^T as the accumulators
    left them), the S-like products both operands from shared memory; the D=256 backward computes from shared memory
    only (its P and dS go through shared memory)."""
    bad = []
    for fam, names in v3_kernels.items():
        for name, c in names.items():
            why = []
            if c["HGMMA"] == 0:
                why.append("no HGMMA")
            if c["HMMA"]:
                why.append(f"{c['HMMA']} HMMA")
            if c["DEPBAR"] > MAX_WAITS or 4 * c["DEPBAR"] > c["HGMMA"]:
                why.append(f"{c['DEPBAR']} waits for {c['HGMMA']} HGMMA: serialized")
            if fam == "v3_bwd_dkdv_wide":
                if c["HGMMA_RS"] or not c["HGMMA_SS"]:
                    why.append(f"forms {c['HGMMA_RS']} RS / {c['HGMMA_SS']} SS")
            elif not (c["HGMMA_RS"] and c["HGMMA_SS"]):
                why.append(f"forms {c['HGMMA_RS']} RS / {c['HGMMA_SS']} SS")
            if why:
                bad.append((name, why))
    assert not bad, bad


def test_sass_parse_counts_forms():
    """fattn.testing.sass.parse on a recorded excerpt of cuobjdump's output."""
    text = """
        Function : _Z6v3_fwdI6__halfLi128ELi128ELi2ELi2ELb1ELb0ELb0ELb0EEv14CUtensorMap_stS1_S1_S1_11attn_paramsiiiPj
        /*1740*/                   HGMMA.64x128x16.F32 R24, R152, gdesc[UR20].tnspB, R24 ;
        /*1750*/                   HGMMA.64x128x16.F32 R88, gdesc[UR20], RZ, !UPT ;
        /*1760*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        Function : _Z5v2_fwdI6__halfEvv
        /*0100*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
    """
    got = sass.parse(text)
    fwd = got["_Z6v3_fwdI6__halfLi128ELi128ELi2ELi2ELb1ELb0ELb0ELb0EEv14CUtensorMap_stS1_S1_S1_11attn_paramsiiiPj"]
    assert (fwd["HGMMA"], fwd["HGMMA_RS"], fwd["HGMMA_SS"], fwd["DEPBAR"], fwd["HMMA"]) == (2, 1, 1, 1, 0)
    assert got["_Z5v2_fwdI6__halfEvv"]["HMMA"] == 1
    assert sass.family("_Z16v3_bwd_dkdv_wideI6__halfLi64EEv") == "v3_bwd_dkdv_wide"
    assert sass.family("plain_name") == "plain_name"
