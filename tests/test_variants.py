"""Docs and dispatch cannot drift: every variant README.md documents is compiled in and dispatchable, every
compiled variant is documented, and each has its numbered kernel file with a header."""
import pathlib
import re

import pytest

from conftest import HAS_CUDA, torch

import fattn

ROOT = pathlib.Path(__file__).resolve().parent.parent


def documented():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Variants", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(v\d+)` \|", section, flags=re.M)


def test_readme_documents_every_compiled_variant():
    if not fattn._C.cuda_compiled:
        pytest.skip("built without CUDA: no GPU variants compiled in")
    compiled = [name for name, _, _ in fattn._C.all_gpu_variants()]
    assert documented() == compiled


def test_every_variant_has_a_numbered_kernel_file():
    for name in documented():
        files = list((ROOT / "kernels").glob(f"{name}_*.cu"))
        assert len(files) == 1, f"{name}: expected one kernels/{name}_*.cu"
        assert files[0].read_text().startswith(f"/* {files[0].name} -- version {name[1:]}:")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")
def test_every_documented_variant_dispatches():
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    for name in documented():
        assert name in fattn.variants("cuda")
        assert fattn.attention(q, q, q, variant=name).shape == q.shape
