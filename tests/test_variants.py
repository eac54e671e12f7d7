"""Docs and dispatch cannot drift: every variant README.md documents is in the variant table and dispatchable, every
variant of the table is documented, and each names its kernel file, which exists and says what version it is."""
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


def test_readme_documents_every_variant_of_the_table():
    assert documented() == [row[0] for row in fattn._C._dev.variant_table()]


def test_every_variant_names_its_kernel_file():
    for name, family, path, summary, min_sm, max_sm in fattn._C._dev.variant_table():
        f = ROOT / path
        assert f.is_file(), f"{name}: {path} does not exist"
        assert f.parent.name == family and (ROOT / "kernels" / family).is_dir()
        assert f.read_text().startswith(f"/* {f.name} -- version {name[1:]}:"), f"{path}: header"


def backward_column():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Variants", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(v\d+|cpu)` \|.*\| `(v\d+|cpu)`[^|]*\|$", section, flags=re.M))


def test_readme_names_each_variants_backward_and_its_file_exists():
    table = fattn._C._dev.bwd_variant_table()
    assert backward_column() == {"cpu": "cpu", **{f: name for name, *_, of in table for f in of}}
    for name, family, path, summary, min_sm, max_sm, of in table:
        f = ROOT / path
        assert f.is_file() and f.parent.name == family, path
        assert f.read_text().startswith(f"/* {f.name} -- "), f"{path}: header"
        assert name in of  # a backward differentiates at least its own forward


def test_package_list_covers_every_subpackage():
    """pyproject.toml finds the packages: every fattn/**/__init__.py is in a wheel (fattn.tune, fattn.testing)."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["packages"] == {"find": {"include": ["fattn", "fattn.*"]}}
    from setuptools import find_packages

    found = set(find_packages(str(ROOT), include=["fattn", "fattn.*"]))
    on_disk = {str(p.parent.relative_to(ROOT)).replace("/", ".") for p in (ROOT / "fattn").rglob("__init__.py")}
    assert on_disk <= found and {"fattn.tune", "fattn.testing"} <= found


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU usable by fattn here")
def test_every_documented_variant_dispatches():
    q = torch.randn(1, 2, 8, 64, device="cuda", dtype=torch.float16)
    for name in documented():
        assert name in fattn.variants("cuda")
        assert fattn.attention(q, q, q, variant=name).shape == q.shape
