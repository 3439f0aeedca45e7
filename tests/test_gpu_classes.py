"""Which configs a GPU gets (configs.GPU_CLASSES, launch.device_gpu_class), what happens when one
does not fit after all (launch.launch_fitting), and which GPUs and dtypes are refused
(launch.check_gpu_supports). Pure host logic: the same on CPU and GPU. That every table entry
fits its class is checked by compilation in test_resource_arch.py; under emulation
(../shared/tools/emulate_gpu.py) the whole suite runs each class's entries on an H100/H200.
"""

import itertools
import warnings
from types import SimpleNamespace

import pytest
import torch
from triton.runtime.errors import OutOfResources

from inputs import random_qkv

KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")


@pytest.fixture
def configs(fa):
    return fa.flash_attention_kernel.configs


@pytest.fixture
def launch(fa):
    return fa.flash_attention_kernel.launch


@pytest.mark.parametrize("capability, shared_memory, expected", [
    ((9, 0), 232448, "sm90"),  # H100 / H200
    ((10, 0), 232448, "sm100"),  # B200
    ((8, 0), 166912, "sm80"),  # A100
    ((8, 7), 166912, "sm80"),  # Orin
    ((8, 6), 101376, "sm86"),  # RTX 3090, A10
    ((8, 9), 101376, "sm86"),  # RTX 4090, L4
    ((12, 0), 101376, "sm86"),  # RTX 5090
    ((7, 5), 65536, "sm75"),  # T4
    ((12, 1), 101376, "sm86"),  # unknown: the largest class its memory holds
    ((11, 0), 232448, "sm100"),  # unknown, as much memory as Hopper: the newest such class
    ((9, 0), 101376, "sm86"),  # a known capability with less memory than its class
    ((8, 0), 65536, "sm75"),
])
def test_gpu_class(configs, capability, shared_memory, expected):
    assert configs.gpu_class(capability, shared_memory).name == expected


def test_gpu_class_too_small(configs):
    with pytest.raises(ValueError, match="no config class.*capability \\(8, 6\\) with 49152 bytes"):
        configs.gpu_class((8, 6), 49152)


@pytest.mark.parametrize("gpu", ["sm90", "sm100", "sm80", "sm86", "sm75"])
def test_every_call_finds_a_config(configs, gpu):
    """Every head dim, dtype, mask, length and dropout setting has an entry in every class, with
    the tiles dropout needs (at least 16 by 16), but the fp32 backward beyond head dim 128 on
    Turing, which no tile fits (a ValueError)."""
    calls = itertools.product(KERNELS, range(1, 257), (torch.float16, torch.bfloat16, torch.float32),
                              ("none", "causal", "window"), (1, 1500, 1 << 20), (False, True))
    for kernel, head_dim, dtype, mask, seqlen, dropout in calls:
        if gpu == "sm75" and dtype == torch.float32 and kernel != "fwd" and head_dim > 128:
            with pytest.raises(ValueError, match=f"head dim {head_dim} need more shared memory"):
                configs.tile_config(kernel, head_dim, dtype, False, mask, seqlen, dropout, gpu)
            continue
        config = configs.tile_config(kernel, head_dim, dtype, False, mask, seqlen, dropout, gpu)
        assert min(config.block_m, config.block_n) >= 16, (kernel, head_dim, config)
        assert config.num_stages >= 1 and config.num_warps in (4, 8)
    assert set(configs.TABLES) == {cls.name for cls in configs.GPU_CLASSES}


def test_smaller_configs_end(configs):
    """smaller_config steps down to 16 x 16 with one stage, then gives up."""
    config, seen = configs.TileConfig(128, 128, 8, 3, tma=True), []
    while config is not None:
        seen.append(config)
        config = configs.smaller_config(config)
    assert len(seen) == len(set(seen)) < 30
    last = seen[-1]
    assert (last.block_m, last.block_n, last.num_stages, last.tma) == (16, 16, 1, True)


def _plan(fa, launch, q, k, v):
    options = fa.flash_attention_kernel.AttentionOptions(q.shape[-1] ** -0.5, False)
    layout = launch.SequenceLayout.of(q, k)
    return launch.tl_launch("fwd", q.shape[-1], q.dtype, options, layout, True, q, k, v)


def test_out_of_resources_steps_down_once(fa, launch, configs, monkeypatch):
    """A config the GPU refuses (OutOfResources at launch) is replaced by the next smaller one that
    launches, with one warning; later plans of the same call take that one directly."""
    monkeypatch.setattr(launch, "_FITTED", {})
    q, k, v = random_qkv((1, 64, 2, 64), (1, 64, 2, 64))
    plan = _plan(fa, launch, q, k, v)
    launched = []

    def launch_needing(limit):
        def run(config, specialized):
            launched.append(config)
            need = config.num_stages * (config.block_m + config.block_n)
            if need > limit:
                raise OutOfResources(need, limit, "shared memory")
        return run

    first = plan.config
    limit = first.num_stages * (first.block_m + first.block_n) - 1
    with pytest.warns(RuntimeWarning, match="does not fit this GPU"):
        launch.launch_fitting(plan, launch_needing(limit))
    expected = [first]
    while expected[-1].num_stages * (expected[-1].block_m + expected[-1].block_n) > limit:
        expected.append(configs.smaller_config(expected[-1]))
    assert launched == expected and len(launched) >= 2
    fitted = launched[-1]
    again = _plan(fa, launch, q, k, v)
    assert again.config == fitted and not again.specialized
    launched.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch.launch_fitting(again, launch_needing(limit))
    assert launched == [fitted]


def test_fixed_config_steps_down_and_remembers(fa, launch, configs, monkeypatch):
    """A kernel outside the table (the probabilities kernel) launches through fixed_tl_launch:
    it steps down like the table's kernels, and its next plan starts from the config that fit."""
    monkeypatch.setattr(launch, "_FITTED", {})
    options = fa.flash_attention_kernel.AttentionOptions(0.125, False, dropout_p=0.1)
    chosen = configs.TileConfig(32, 32, 4, 1)
    device = torch.device("cpu")
    plan = launch.fixed_tl_launch("probs", chosen, 192, torch.float32, options.variant, device)
    assert plan.config == chosen and not plan.specialized and not plan.tma

    def fits_16_rows(config, specialized):
        if config.block_m > 16:
            raise OutOfResources(74752, 65536, "shared memory")

    with pytest.warns(RuntimeWarning, match="probs kernel"):
        launch.launch_fitting(plan, fits_16_rows)
    again = launch.fixed_tl_launch("probs", chosen, 192, torch.float32, options.variant, device)
    assert again.config == configs.TileConfig(16, 32, 4, 2)


def test_out_of_resources_when_nothing_fits(launch, configs, monkeypatch):
    """Where no config fits, the error reaches the caller and no fallback is remembered."""
    monkeypatch.setattr(launch, "_FITTED", {})
    plan = launch.TlLaunch("fwd", configs.TileConfig(32, 16, 4, 1), False, False, ("key",))

    def never(config, specialized):
        raise OutOfResources(1 << 20, 1, "shared memory")

    with pytest.warns(RuntimeWarning), pytest.raises(OutOfResources):
        launch.launch_fitting(plan, never)
    assert not launch.any_refitted()


@pytest.fixture
def fake_gpu(launch, monkeypatch):
    """Make torch report a GPU of the given (capability, name) to check_gpu_supports."""
    def install(capability, name):
        props = SimpleNamespace(major=capability[0], minor=capability[1], name=name,
                                shared_memory_per_block_optin=65536)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        launch.check_gpu_supports.cache_clear()
        launch.device_gpu_class.cache_clear()
    yield install
    launch.check_gpu_supports.cache_clear()
    launch.device_gpu_class.cache_clear()


def test_turing_refuses_bf16(launch, fake_gpu):
    fake_gpu((7, 5), "Tesla T4")
    device = torch.device("cuda", 0)
    with pytest.raises(TypeError, match=r"bfloat16 inputs need an Ampere .*Tesla T4 is 7\.5 .*use float16"):
        launch.check_gpu_supports(device, torch.bfloat16)
    launch.check_gpu_supports(device, torch.float16)
    launch.check_gpu_supports(device, torch.float32)
    assert launch.device_gpu_class(device).name == "sm75"


def test_older_gpus_refused(launch, fake_gpu):
    fake_gpu((7, 0), "Tesla V100-SXM2-16GB")
    with pytest.raises(RuntimeError, match=r"compute capability 7\.5 \(Turing\) or newer; Tesla V100-SXM2-16GB is 7\.0"):
        launch.check_gpu_supports(torch.device("cuda", 0), torch.float16)
