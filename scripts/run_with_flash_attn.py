"""Run a Python script with this package serving as ``flash_attn`` (install_as_flash_attn first).

For code that imports flash-attn by name and cannot be edited, such as an engine's own test
scripts under torchrun:

    torchrun --nproc_per_node 2 scripts/run_with_flash_attn.py ring-flash-attention/test/test_ring_flash_attn_func.py
    python scripts/run_with_flash_attn.py --build /path/to/build my_script.py --its-args

The package is loaded from the build (``build/`` of this repository after
scripts/build_variants.py, or --build) through kernels.get_local_kernel, installed as
``flash_attn``, and the script then runs as ``__main__`` with its own arguments and its folder first
on sys.path, as ``python SCRIPT`` would run it. Under transformers 5, ring-flash-attn 0.1.8's package
import fails in its transformers adapter (it takes ``is_flash_attn_greater_or_equal_2_10`` from
``transformers.modeling_flash_attention_utils``, which transformers 5 moved to transformers.utils);
the name is put back there first, so its scripts import as they are.
"""

import argparse
import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def transformers_name_for_ring_flash_attn() -> None:
    """transformers 5's ``is_flash_attn_greater_or_equal_2_10`` where ring-flash-attn 0.1.8 imports it."""
    try:
        import transformers.modeling_flash_attention_utils as utils
        from transformers.utils import is_flash_attn_greater_or_equal_2_10
    except ImportError:  # (no transformers, or one that has the name where the adapter looks)
        return
    if not hasattr(utils, "is_flash_attn_greater_or_equal_2_10"):
        utils.is_flash_attn_greater_or_equal_2_10 = is_flash_attn_greater_or_equal_2_10


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", type=Path, default=REPO_ROOT / "build", help="the built package (default: build/)")
    parser.add_argument("script", type=Path)
    parser.add_argument("arguments", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    import kernels

    kernels.get_local_kernel(args.build).install_as_flash_attn()
    transformers_name_for_ring_flash_attn()
    sys.argv = [str(args.script), *args.arguments]
    sys.path.insert(0, str(args.script.resolve().parent))
    runpy.run_path(str(args.script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
