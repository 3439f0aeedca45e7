"""Serving as ``flash_attn`` in a process: flash-attn 2.8.3's module layout over this package.

Much code imports flash-attn by module name (training repositories, ring-attention engines,
research scripts). After

    fa = kernels.get_kernel("<org>/flash-attention", version=1)
    fa.install_as_flash_attn()

``import flash_attn`` and flash-attn 2.8.3's module paths give this package's functions:

* ``flash_attn``: the seven public functions and ``__version__`` = "2.8.3", the version mirrored
  (so version checks such as yunchang's ``flash_attn.__version__ < "2.6.3"`` take the 2.8 path);
* ``flash_attn.flash_attn_interface``: the same functions, the private entry points that ring
  engines call (``_flash_attn_forward``, ``_flash_attn_backward`` and the varlen pair, with their
  exact contracts: entry_points.py) and their ``_wrapped_`` names;
* ``flash_attn.bert_padding``, ``flash_attn.layers.rotary``, ``flash_attn.ops.triton.rotary``
  (``apply_rotary``) and ``flash_attn.modules.mha`` (``MHA``, ``FlashSelfAttention``,
  ``FlashCrossAttention``, ``get_alibi_slopes``).

The modules are registered in ``sys.modules`` (the Hub's loading rules allow no files outside the
package, and the package is imported under a unique name): module objects named as flash-attn's,
whose attributes are this package's objects. Every other module of flash-attn 2.8.3 (fused dense,
layer norm, RMS norm, cross entropy, the models, the utils...) is registered too, as a module whose
names raise ``FlashAttnNotProvided``: a NotImplementedError naming what is missing, which is also
an ImportError, so that ``try: from flash_attn.ops.layer_norm import ... except ImportError:``
fallbacks keep working. Version checks that read package metadata (transformers'
``is_flash_attn_2_available``) find a ``flash_attn`` 2.8.3 distribution too: a metadata finder
on ``sys.meta_path`` answers ``importlib.metadata`` for that name in this process (nothing is
written to disk). transformers reads the mapping of packages to distributions once, when it is
imported, so install first.

``install_as_flash_attn`` refuses when a real flash-attn is already imported (``replace=True`` takes
its place in sys.modules; modules that imported it keep their references), and is idempotent.
``uninstall_flash_attn`` removes what it registered.

``kernels_in_torch_context_parallel`` (torch_context_parallel.py, experimental) makes PyTorch's own
``context_parallel`` run this package's kernel at every ring step.
"""

import importlib.machinery
import importlib.metadata
import pathlib
import re
import sys
import types

from .torch_context_parallel import kernels_in_torch_context_parallel

FLASH_ATTN_VERSION = "2.8.3"
_MARK = "__flash_attention_drop_in__"  # set on every module this installs

# flash-attn 2.8.3's modules that this package does not provide, by group: what they hold
_EXTENSIONS = "CUDA extensions of flash-attn that this pure-Triton kernel does not include"
MISSING = {
    "flash_attn.ops.fused_dense": f"fused dense layers and MLPs (FusedDense, FusedMLP; {_EXTENSIONS})",
    "flash_attn.ops.layer_norm": f"fused dropout + add + layer norm ({_EXTENSIONS}); use torch.nn.LayerNorm",
    "flash_attn.ops.rms_norm": f"fused dropout + add + RMS norm ({_EXTENSIONS}); use torch.nn.RMSNorm",
    "flash_attn.ops.activations": "fused activations (bias_gelu, swiglu); use torch.nn.functional",
    "flash_attn.ops.triton.layer_norm": "the Triton layer norm / RMS norm; use torch.nn.LayerNorm / RMSNorm",
    "flash_attn.ops.triton.cross_entropy": "the Triton cross entropy; use torch.nn.functional.cross_entropy",
    "flash_attn.ops.triton.linear": "the Triton linear layers; use torch.nn.Linear",
    "flash_attn.ops.triton.mlp": "the Triton fused MLP",
    "flash_attn.ops.triton.k_activations": "the Triton activation kernels",
    "flash_attn.losses": "flash-attn's losses (CrossEntropyLoss)",
    "flash_attn.losses.cross_entropy": "flash-attn's CrossEntropyLoss; use torch.nn.CrossEntropyLoss",
    "flash_attn.models": "flash-attn's model implementations",
    **{f"flash_attn.models.{name}": f"flash-attn's {name} model" for name in (
        "baichuan", "bert", "bigcode", "btlm", "falcon", "gpt", "gpt_neox", "gptj", "llama", "opt", "vit")},
    "flash_attn.modules.block": "flash-attn's transformer Block (it needs the fused layer norm)",
    "flash_attn.modules.embedding": "flash-attn's embedding modules",
    "flash_attn.modules.mlp": "flash-attn's MLP modules (they need the fused dense layers)",
    "flash_attn.layers.patch_embed": "flash-attn's PatchEmbed",
    "flash_attn.utils": "flash-attn's utilities",
    **{f"flash_attn.utils.{name}": f"flash-attn's utils.{name}" for name in (
        "benchmark", "distributed", "generation", "library", "pretrained", "testing", "torch")},
    "flash_attn.flash_attn_triton": "flash-attn's older Triton attention; use flash_attn.flash_attn_func",
    "flash_attn.flash_attn_triton_og": "flash-attn's older Triton attention; use flash_attn.flash_attn_func",
    "flash_attn.flash_blocksparse_attention": "block-sparse attention",
    "flash_attn.flash_blocksparse_attn_interface": "block-sparse attention",
    "flash_attn.cute": "FlashAttention-4's CuTe DSL kernels",
}
_PACKAGES = {"flash_attn", "flash_attn.layers", "flash_attn.modules", "flash_attn.ops", "flash_attn.ops.triton",
             "flash_attn.losses", "flash_attn.models", "flash_attn.utils", "flash_attn.cute"}


class FlashAttnNotProvided(NotImplementedError, ImportError):
    """A part of flash-attn that this package does not provide (see MISSING)."""


def provided_modules() -> dict:
    """Module name -> {attribute: object} of what this package serves under flash-attn's names."""
    from .. import bert_padding, flash_attn_interface, modules, rotary

    def names(module, *attributes):
        return {name: getattr(module, name) for name in attributes}

    public = {name: getattr(flash_attn_interface, name) for name in flash_attn_interface.__all__
              if not name.startswith("_")}
    return {
        "flash_attn": {**public, "__version__": FLASH_ATTN_VERSION},
        "flash_attn.flash_attn_interface": names(flash_attn_interface, *flash_attn_interface.__all__),
        "flash_attn.bert_padding": names(bert_padding, "unpad_input", "pad_input", "index_first_axis",
                                         "index_put_first_axis", "index_first_axis_residual",
                                         "unpad_input_for_concatenated_sequences"),
        "flash_attn.layers": {},
        "flash_attn.layers.rotary": names(rotary, "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_qkv_",
                                          "apply_rotary_emb_kv_", "RotaryEmbedding", "rotate_half",
                                          "apply_rotary_emb_torch", "apply_rotary"),
        "flash_attn.modules": {},
        "flash_attn.modules.mha": names(modules, "MHA", "FlashSelfAttention", "FlashCrossAttention",
                                        "get_alibi_slopes"),
        "flash_attn.ops": {},
        "flash_attn.ops.triton": {},
        "flash_attn.ops.triton.rotary": names(rotary, "apply_rotary"),
    }


class _MissingModule(types.ModuleType):
    """A flash-attn module this package does not provide: its names raise FlashAttnNotProvided."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise FlashAttnNotProvided(
            f"{self.__name__}.{name} is not provided by the pure-Triton flash-attention kernel standing in for "
            f"flash_attn: {MISSING[self.__name__]}. It provides flash_attn's attention functions, bert_padding, "
            f"layers.rotary, ops.triton.rotary and modules.mha.")


class _Distribution(importlib.metadata.Distribution):
    """flash-attn's distribution metadata as importlib.metadata reads it: name, version and the
    top-level package (what packages_distributions maps); no files."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {FLASH_ATTN_VERSION}\n"
                    f"Summary: flash-attn's interface, served by the pure-Triton flash-attention kernel\n")
        if filename == "top_level.txt":
            return "flash_attn\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(path)


class _DistributionFinder(importlib.metadata.DistributionFinder):
    """On sys.meta_path: finds no module (sys.modules serves them) and the flash_attn distribution."""

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or re.sub(r"[-_.]+", "_", context.name).lower() == "flash_attn":
            yield _Distribution()


def install_as_flash_attn(replace: bool = False) -> types.ModuleType:
    """Serve this package as ``flash_attn`` in this process (module docstring); returns the
    ``flash_attn`` module. A real flash-attn already imported is a RuntimeError unless ``replace``."""
    current = sys.modules.get("flash_attn")
    if current is not None and getattr(current, _MARK, False):
        return current
    if current is not None and not replace:
        raise RuntimeError(f"flash_attn is already imported from {getattr(current, '__file__', current)}: call "
                           f"install_as_flash_attn() before anything imports flash_attn, or pass replace=True")
    for name in [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]:
        del sys.modules[name]
    created = {}
    for name, attributes in provided_modules().items():
        created[name] = _module(types.ModuleType, name, attributes)
    for name in MISSING:
        created[name] = _module(_MissingModule, name, {})
    for name in sorted(created, key=lambda name: name.count(".")):
        sys.modules[name] = created[name]
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(created[parent], child, created[name])
    if not any(isinstance(finder, _DistributionFinder) for finder in sys.meta_path):
        sys.meta_path.append(_DistributionFinder())
    return created["flash_attn"]


def uninstall_flash_attn() -> None:
    """Remove the modules install_as_flash_attn registered (and only those)."""
    for name in [name for name, module in sys.modules.items()
                 if (name == "flash_attn" or name.startswith("flash_attn.")) and getattr(module, _MARK, False)]:
        del sys.modules[name]
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _DistributionFinder)]


def _module(kind, name: str, attributes: dict) -> types.ModuleType:
    module = kind(name, f"flash-attn {FLASH_ATTN_VERSION}'s {name}, served by the pure-Triton flash-attention kernel")
    package = name in _PACKAGES
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__package__ = name if package else name.rpartition(".")[0]
    setattr(module, _MARK, True)
    for attribute, value in attributes.items():
        setattr(module, attribute, value)
    return module
