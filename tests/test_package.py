"""The Hub package: build.toml, the built variants, loading through kernels."""

import json

import kernels
import pytest
import torch

from conftest import DEVICE, REPO_ROOT

KERNELS = REPO_ROOT / "torch-ext" / "flash_attention" / "flash_attention_kernel"
KERNEL_FILES = sorted(p.name for p in KERNELS.glob("*.py"))


def _repo_id() -> str:
    import tomllib

    return tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]["hub"]["repo-id"]


def test_build_toml_parses_with_kernels():
    """kernels' own (kernel-builder's) parser accepts build.toml as a noarch kernel whose backends are
    the variants scripts/build_variants.py writes (kernel-builder builds one torch-<backend> per entry)."""
    from kernels._rust import Build

    import build_variants

    build = Build.open(REPO_ROOT)
    assert [str(backend) for backend in build.general.backends] == list(build_variants.BACKENDS)
    import tomllib

    general = tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]
    assert "triton" not in general.get("python-depends", []), "listing triton makes loading fail"


def test_version_is_build_toml_version(fa):
    """__version__, defined once in flash_attention_kernel/__init__.py, is build.toml's major version,
    which the built metadata.json carries and get_kernel(..., version=...) resolves."""
    import tomllib

    version = tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]["version"]
    assert fa.__version__ == fa.flash_attention_kernel.__version__ == str(version)


def test_package_source_is_real_files():
    """torch-ext/flash_attention/ holds the kernels as real files: kernel-builder's source set is
    torch-ext's *.py files with symlinks kept as links, so a link to a file outside torch-ext would
    ship dangling (docs/design.md#packaging)."""
    package = REPO_ROOT / "torch-ext" / "flash_attention"
    assert "__init__.py" in KERNEL_FILES and "launch.py" in KERNEL_FILES
    links = [str(p.relative_to(REPO_ROOT)) for p in package.rglob("*") if p.is_symlink()]
    assert not links, f"symlinks in the shipped package: {links}"


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_built_variant(build_dir, backend):
    variant = build_dir / f"torch-{backend}"
    files = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()}
    assert {"__init__.py", "_ops.py", "metadata.json", "interface.py", "torch_ops.py"} <= files
    assert {f"flash_attention_kernel/{name}" for name in KERNEL_FILES} <= files
    assert not any(p.is_symlink() for p in variant.rglob("*")), "variants hold real files only"
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)
    metadata = json.loads((variant / "metadata.json").read_text())
    assert metadata["name"] == "flash-attention" and metadata["version"] == 1
    assert metadata["backend"] == {"type": backend} and metadata["python-depends"] == []
    assert metadata["id"].startswith(f"_flash_attention_{backend}_") and metadata["id"].isidentifier()
    assert f'"{metadata["id"]}"' in (variant / "_ops.py").read_text()
    from kernels._rust import Metadata

    assert Metadata.read_from_file(variant / "metadata.json").id == metadata["id"]


def test_relative_imports_only():
    """The loader imports the package under a unique name: no absolute self-imports."""
    import ast

    own_names = {"flash_attention", "flash_attention_kernel", "torch_ext"}
    for path in (REPO_ROOT / "torch-ext" / "flash_attention").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert not roots & own_names, f"{path}:{node.lineno} imports the package absolutely"


def test_get_kernel_with_local_kernels(build_dir, monkeypatch):
    """LOCAL_KERNELS=<org>/flash-attention=<build> + get_kernel(..., version=1), offline."""
    monkeypatch.setenv("LOCAL_KERNELS", f"{_repo_id()}={build_dir}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    module = kernels.get_kernel(_repo_id(), version=1)
    assert set(module.__all__) >= {"flash_attn_func", "flash_attention_forward", "ops"}
    q = torch.randn(1, 17, 2, 32, device=DEVICE, dtype=torch.float16, requires_grad=True)
    out = module.flash_attn_func(q, q, q, causal=True)
    out.sum().backward()
    assert out.shape == q.shape and torch.isfinite(q.grad).all()
