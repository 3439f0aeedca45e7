"""The planner (flash_attention_kernel/planner.py): which kernel runs each pass with which config.

On the CPU every pass runs its tl kernel: the planner's tl launches and delta source must be the
ones the launchers chose before it existed (``launch.tl_launch`` per kernel and backward.py's delta
rule), over a grid of dtypes, head dims, masks, options, varlen and the warp-specialised loops.
The Gluon side needs a Hopper GPU; its decision logic is checked here with ``hopper_route.fits``
made true and stand-ins for the Gluon launch functions: which passes go to Gluon, with the ring
depths the Gluon modules used to hold, and that the backward plans no tl launch for a pass a Gluon
kernel runs. The override hook (configs.set_override, planner.override) must force each choice.
"""

import math

import pytest
import torch

from conftest import DEVICE
from sizes import BF16

FP16, FP32 = torch.float16, torch.float32

GLUON_STAGES = {("fwd", 64): 4, ("fwd", 128): 3, ("bwd_dq", 64): 6, ("bwd_dq", 128): 4,
                ("bwd_dkdv", 64): 4, ("bwd_dkdv", 128): 3,  # (the modules' STAGES before the planner)
                ("fwd", 80): 3, ("fwd", 96): 3, ("bwd_dq", 80): 5, ("bwd_dq", 96): 6,
                ("bwd_dkdv", 80): 2, ("bwd_dkdv", 96): 2}  # (two head-dim chunks: stop 53's sweep)
GLUON_WINDOW_STAGES = {64: 4, 80: 4, 96: 4, 128: 4}  # (hopper_dkdv.WINDOW_STAGES)
OPTIONS = [dict(), dict(causal=True), dict(window_left=5, window_right=3), dict(softcap=20.0),
           dict(dropout_p=0.1), dict(causal=True, dropout_p=0.1), dict(sinks=True)]


@pytest.fixture
def kernels(fa):
    """The kernel package, its plan cache empty (tests here replace what plans are made from)."""
    kernels = fa.flash_attention_kernel
    kernels.planner._PLANS.clear()
    yield kernels
    for kernel in list(kernels.configs.OVERRIDES):
        kernels.configs.set_override(kernel, None)
    kernels.planner._PLANS.clear()


def _call(kernels, dtype, head_dim, seqlen_q=32, seqlen_k=48, varlen=False, **options):
    """(options, layout, q, k, v, dout) of a small call."""
    if options.pop("sinks", False):
        options["sinks"] = torch.zeros(2, device=DEVICE)
    q = torch.randn(2, seqlen_q, 2, head_dim, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(2, seqlen_k, 1, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    dout = torch.randn_like(q)
    attention = kernels.AttentionOptions(head_dim ** -0.5, options.pop("causal", False), **options)
    if varlen:
        cu_q = torch.tensor([0, seqlen_q, 2 * seqlen_q], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, seqlen_k, 2 * seqlen_k], dtype=torch.int32, device=DEVICE)
        q, dout, k, v = (x.flatten(0, 1) for x in (q, dout, k, v))
        layout = kernels.launch.SequenceLayout.of(q, k, cu_q, cu_k, seqlen_q, seqlen_k)
    else:
        layout = kernels.launch.SequenceLayout.of(q, k)
    return attention, layout, q, k, v, dout


def _delta_source_before(kernels, attention, layout, q, dq_launch):
    """backward.py's rule before the planner, for a tl dQ kernel: fp32 from its first pass, a
    plain dense dQ kernel in its prologue, else the preprocess kernel."""
    planner = kernels.planner
    if q.dtype == torch.float32:
        return planner.DELTA_FP32_PASS
    if not dq_launch.specialized and not layout.is_varlen:
        return planner.DELTA_IN_DQ
    return planner.DELTA_PREPROCESS


@pytest.mark.parametrize("warp_specialize", ["", "1"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_planner_tl_decisions_match_the_launchers_before(kernels, monkeypatch, head_dim, dtype, varlen,
                                                          warp_specialize):
    """On the CPU every pass is the tl kernel's, with the TlLaunch the launchers asked for before
    the planner (tl_launch per kernel) and backward.py's delta source."""
    monkeypatch.setenv("FLASH_ATTENTION_WS", warp_specialize)
    for options in OPTIONS:
        for seqlen_q, seqlen_k in ((32, 48), (17, 17)):
            attention, layout, q, k, v, dout = _call(kernels, dtype, head_dim, seqlen_q, seqlen_k, varlen, **options)
            launch = kernels.launch
            forward = kernels.planner.plan_forward(attention, layout, True, q, k, v)
            assert forward.implementation == "tl" and forward.gluon is None
            assert forward.tl == launch.tl_launch("fwd", head_dim, dtype, attention, layout, True, q, k, v)
            backward = kernels.planner.plan_backward(attention, layout, True, q, k, v, dout)
            for step, kernel in ((backward.dq, "bwd_dq"), (backward.dkdv, "bwd_dkdv")):
                assert step.implementation == "tl"
                assert step.tl == launch.tl_launch(kernel, head_dim, dtype, attention, layout, True, q, k, v, dout)
            assert backward.delta_source == _delta_source_before(kernels, attention, layout, q, backward.dq.tl)
    if warp_specialize and not varlen and dtype != FP32 and head_dim == 128:  # (the dQ entry: d128 only)
        attention, layout, q, k, v, dout = _call(kernels, dtype, head_dim, 64, 64)
        backward = kernels.planner.plan_backward(attention, layout, True, q, k, v, dout)
        assert backward.dq.tl.specialized and backward.delta_source == kernels.planner.DELTA_PREPROCESS


@pytest.fixture
def gluon_fits(kernels, monkeypatch):
    """hopper_route.fits true wherever the options are allowed (as on an H100 under a checked
    Triton), and stand-ins for the Gluon launch functions; returns pass -> stand-in."""
    route = kernels.hopper_route
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    monkeypatch.setattr(route, "fits", lambda kernel, options, layout, interpreted, tensors,
                        allowed_options=route.ALL_OPTIONS: not options.variant & ~allowed_options)
    stand_ins = {kernel: (lambda *args, kernel=kernel: kernel) for kernel in route.KERNELS}
    monkeypatch.setattr(route, "launcher", stand_ins.get)
    # (an H100 for the A100 class's fused backward too, which an emulated A100 would route to)
    monkeypatch.setattr(kernels.ampere_route, "gpu_class_name", lambda device: "sm90")
    return stand_ins


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_planner_gluon_decisions(kernels, gluon_fits, monkeypatch, head_dim):
    """Where the Gluon kernels fit: each pass runs its Gluon kernel, with its program tiles and the
    ring depth the modules held; dQ stays on the tl kernel for dropout without causal masking;
    either dQ kernel makes delta in its prologue and runs first, and the backward plans no tl
    launch for a pass a Gluon kernel runs."""
    planner, GluonConfig = kernels.planner, kernels.configs.GluonConfig
    tl_launches = []
    real_tl_launch = planner.tl_launch
    monkeypatch.setattr(planner, "tl_launch", lambda kernel, *args: tl_launches.append(kernel)
                        or real_tl_launch(kernel, *args))
    tiles = {"fwd": (128, 128), "bwd_dq": (128, 64), "bwd_dkdv": (64, 128)}
    for options in OPTIONS:
        attention, layout, q, k, v, dout = _call(kernels, BF16, head_dim, 256, 256, **options)
        window = "window_left" in options
        tl_launches.clear()
        forward = planner.plan_forward(attention, layout, True, q, k, v)
        assert forward.gluon is gluon_fits["fwd"] and forward.tl is None
        assert forward.gluon_config == GluonConfig(*tiles["fwd"], GLUON_STAGES["fwd", head_dim])
        backward = planner.plan_backward(attention, layout, True, q, k, v, dout)
        assert backward.dkdv.gluon is gluon_fits["bwd_dkdv"] and backward.dkdv.tl is None
        stages = GLUON_WINDOW_STAGES[head_dim] if window else GLUON_STAGES["bwd_dkdv", head_dim]
        assert backward.dkdv.gluon_config == GluonConfig(*tiles["bwd_dkdv"], stages)
        if options.get("dropout_p") and not options.get("causal"):  # (the tl dQ is faster there)
            assert backward.dq.implementation == "tl" and backward.delta_source == planner.DELTA_IN_DQ
            assert tl_launches == ["bwd_dq"]
        else:
            assert backward.dq.gluon is gluon_fits["bwd_dq"] and backward.dq.tl is None
            assert backward.dq.gluon_config == GluonConfig(*tiles["bwd_dq"], GLUON_STAGES["bwd_dq", head_dim])
            assert backward.delta_source == planner.DELTA_IN_DQ
            assert tl_launches == []  # (no tl launch planned for passes the Gluon kernels run)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "0")
    attention, layout, q, k, v, dout = _call(kernels, BF16, head_dim, 256, 256)
    assert planner.plan_forward(attention, layout, True, q, k, v).implementation == "tl"
    backward = planner.plan_backward(attention, layout, True, q, k, v, dout)
    assert (backward.dq.implementation, backward.dkdv.implementation) == ("tl", "tl")


def test_planner_fused_dq_rule(kernels, gluon_fits, monkeypatch):
    """Hopper's backward in one kernel (hopper_route.fused_chosen): by default under the Triton
    releases, head dims and masks of FUSED_DQ_MIN_KEYS (3.9: d64, d128; 3.6-3.8 the same, d64 from
    longer rows; d80 and d96 from 2k keys a row), one query head a KV head, from that many keys a row on average;
    FLASH_ATTENTION_FUSED_DQ=1 wherever the kernel can take it (never with dropout, determinism,
    a head dim GLUON_FUSED_STAGES lacks, an override, or a Triton whose Gluon cannot build it), 0 never. Its plan:
    one launch function for both passes, the package's preprocess, GLUON_FUSED_STAGES."""
    route, planner, configs = kernels.hopper_route, kernels.planner, kernels.configs
    launchers = {"fused": lambda *args: "fused"}
    monkeypatch.setattr(route, "fused_launcher", lambda: launchers["fused"])
    monkeypatch.setattr(route.triton, "__version__", "3.9.0")
    monkeypatch.delenv("FLASH_ATTENTION_FUSED_DQ", raising=False)

    def fused(head_dim=128, seqlen=4096, causal=True, heads_kv=2, **options):
        planner._PLANS.clear()  # (the version and the stand-in are not in the plan key)
        q = torch.empty(1, seqlen, 2, head_dim, dtype=BF16, device=DEVICE)
        k = torch.empty(1, seqlen, heads_kv, head_dim, dtype=BF16, device=DEVICE)
        attention = kernels.AttentionOptions(head_dim ** -0.5, causal, **options)
        plan = planner.plan_backward(attention, kernels.launch.SequenceLayout.of(q, k), True, q, k, k, q)
        if plan.fused:
            assert plan.dq is plan.dkdv and plan.dq.gluon is launchers["fused"]
            assert plan.delta_source == planner.DELTA_PREPROCESS
            assert plan.dq.gluon_config == configs.GluonConfig(64, 128, configs.GLUON_FUSED_STAGES[head_dim])
        return plan.fused

    # the default rule: the lengths an H200 measured it faster from (a row's mean visible keys)
    assert fused(seqlen=2048) and not fused(seqlen=1024) and fused(seqlen=1024, causal=False)
    assert fused(64, 1024) and not fused(64, 512) and fused(64, 512, causal=False)
    assert fused(80, 4096) and not fused(80, 2048) and fused(96, 2048, causal=False) and not fused(96, 1024, causal=False)
    sinks = torch.zeros(2, device=DEVICE)
    for options in (dict(softcap=20.0), dict(window_left=512), dict(window_right=64, causal=False), dict(sinks=sinks),
                    dict(alibi_slopes=torch.ones(2, device=DEVICE)), dict(heads_kv=1)):
        assert not fused(**options), options
    for release in ("3.8.0", "3.7.1", "3.6.0"):  # (d64 from 1k keys a row before 3.9)
        monkeypatch.setattr(route.triton, "__version__", release)
        assert fused(seqlen=2048) and not fused(seqlen=1024) and fused(64, 2048) and not fused(64, 1024)
        assert fused(seqlen=1024, causal=False) and not fused(seqlen=512, causal=False)
        assert fused(96, 4096) and not fused(96, 2048) and fused(80, 2048, causal=False)
    monkeypatch.setattr(route.triton, "__version__", "3.5.1")
    assert not fused() and not fused(64, 2048)
    monkeypatch.setenv("FLASH_ATTENTION_FUSED_DQ", "1")  # wherever the kernel can take the call
    for options in (dict(softcap=20.0), dict(window_left=512), dict(sinks=sinks), dict(heads_kv=1), dict(seqlen=256),
                    dict(head_dim=64, seqlen=128, causal=False), dict(head_dim=80), dict(head_dim=96, causal=False)):
        assert fused(**options), options
    for options in (dict(dropout_p=0.1), dict(deterministic=True)):
        assert not fused(**options), options
    monkeypatch.delitem(configs.GLUON_FUSED_STAGES, 96)  # (a head dim the fused kernel has no ring for)
    assert not fused(96) and fused(80)
    with planner.override("bwd_dq", implementation="gluon"):
        assert not fused()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not fused()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    assert fused()
    launchers["fused"] = None  # (a Triton whose Gluon cannot build the kernel: fused_launcher)
    assert not fused()
    launchers["fused"] = lambda *args: "fused"
    monkeypatch.setenv("FLASH_ATTENTION_FUSED_DQ", "0")
    assert not fused()


def test_planner_override_forces_each_choice(kernels, gluon_fits, monkeypatch):
    """configs.set_override / planner.override: "tl" or a TileConfig keeps a pass on the tl kernel
    where Gluon would run it; "gluon" or a GluonConfig runs Gluon wherever it fits (even with
    FLASH_ATTENTION_GLUON=0, even for dQ with dropout) and raises where it does not; the override
    ends with the block."""
    planner, configs = kernels.planner, kernels.configs
    attention, layout, q, k, v, dout = _call(kernels, BF16, 128, 256, 256)
    tile = configs.TileConfig(16, 32, 4, 1)
    with planner.override("fwd", implementation="tl"):
        forward = planner.plan_forward(attention, layout, True, q, k, v)
        assert forward.implementation == "tl" and forward.tl.config == configs._INTERPRETER["fwd"]
    with planner.override("bwd_dq", tile):
        backward = planner.plan_backward(attention, layout, True, q, k, v, dout)
        assert backward.dq.tl.config == tile and not backward.dq.tl.specialized
        assert backward.dkdv.implementation == "gluon" and backward.delta_source == planner.DELTA_IN_DQ
        with planner.override("bwd_dq", implementation="gluon"):  # (nested: the outer one comes back)
            assert planner.plan_backward(attention, layout, True, q, k, v, dout).dq.implementation == "gluon"
        assert configs.OVERRIDES["bwd_dq"].config == tile
    assert "bwd_dq" not in configs.OVERRIDES
    assert planner.plan_forward(attention, layout, True, q, k, v).implementation == "gluon"

    ring = configs.GluonConfig(128, 64, 2)
    with planner.override("bwd_dq", ring):
        monkeypatch.setenv("FLASH_ATTENTION_GLUON", "0")
        dropout = kernels.AttentionOptions(128 ** -0.5, False, dropout_p=0.1)
        backward = planner.plan_backward(dropout, layout, True, q, k, v, dout)
        assert backward.dq.gluon_config == ring and backward.dkdv.implementation == "tl"
        assert backward.delta_source == planner.DELTA_IN_DQ  # (the Gluon dQ kernel makes it)
    with pytest.raises(ValueError, match="compiled in"):
        configs.set_override("fwd", configs.GluonConfig(64, 64, 3))
    with pytest.raises(ValueError, match="implementation"):
        configs.set_override("fwd", tile, implementation="gluon")
    with pytest.raises(ValueError, match="no pass"):
        configs.set_override("bwd", tile)
    with pytest.raises(ValueError, match="no Gluon kernel"):
        configs.set_override("decode", implementation="gluon")

    monkeypatch.setattr(kernels.hopper_route, "fits", lambda *args, **kwargs: False)
    with planner.override("fwd", implementation="gluon"), pytest.raises(ValueError, match="cannot run this call"):
        planner.plan_forward(attention, layout, True, q, k, v)
    decode_tile = configs.TileConfig(32, 16, 4, 2)
    assert configs.decode_config(4, 64, BF16, True) != decode_tile
    with planner.override("decode", decode_tile):
        assert configs.decode_config(4, 64, BF16, True) == decode_tile


def test_planner_override_reaches_the_warp_specialised_loop(kernels, monkeypatch):
    """A TileConfig with warp_specialized=True is the warp-specialised entry (where the call can
    take that loop: FLASH_ATTENTION_WS=1 under the interpreter), and with False the plain one."""
    monkeypatch.setenv("FLASH_ATTENTION_WS", "1")
    planner, configs = kernels.planner, kernels.configs
    attention, layout, q, k, v, dout = _call(kernels, BF16, 64, 64, 64)
    tile = configs.TileConfig(32, 32, 4, 2)
    with planner.override("fwd", tile, warp_specialized=True):
        forward = planner.plan_forward(attention, layout, True, q, k, v).tl
        assert forward.config == tile and forward.specialized and forward.tma
    with planner.override("fwd", tile):
        forward = planner.plan_forward(attention, layout, True, q, k, v).tl
        assert forward.config == tile and not forward.specialized


@pytest.mark.parametrize("head_dim, seqlen_q, seqlen_k, options", [
    (64, 113, 203, dict(causal=True)), (80, 203, 113, dict()), (40, 97, 97, dict(window_left=16, window_right=8)),
])
def test_forward_reads_q_per_tile_as_it_holds_it(kernels, head_dim, seqlen_q, seqlen_k, options):
    """TileConfig.q_per_tile (Q read again for each key tile, the A100 class's d64 forward) gives
    the forward of Q held across the loop bitwise: the same products in the same order. GQA,
    seqlen_q != seqlen_k, head-dim chunks (80 = 64 + 16), partial tiles, masks."""
    attention, layout, q, k, v, dout = _call(kernels, FP16, head_dim, seqlen_q, seqlen_k, **options)
    results = []
    for q_per_tile in (False, True):
        with kernels.planner.override("fwd", kernels.configs.TileConfig(32, 16, 4, 2, q_per_tile=q_per_tile)):
            results.append(kernels.attention_forward(q, k, v, attention))
    (out, lse), (again, again_lse) = results
    assert torch.isfinite(out.float()).all()
    assert torch.equal(again, out) and torch.equal(again_lse, lse)


def test_planner_launchers_launch_what_it_plans(kernels, gluon_fits, monkeypatch):
    """attention_forward / attention_backward launch the planned kernels with the planned configs:
    Gluon stand-ins get their GluonConfig (the backward's delta then from the dQ kernel, the first),
    and a tl override gives the tl kernel's result."""
    launched = {}

    def stand_in(kernel):
        def launch(*args):
            launched[kernel] = args[-1]
        return launch

    monkeypatch.setattr(kernels.hopper_route, "launcher", stand_in)
    attention, layout, q, k, v, dout = _call(kernels, BF16, 64, 128, 128)
    out, lse = kernels.attention_forward(q, k, v, attention)
    assert launched.pop("fwd") == kernels.configs.GluonConfig(128, 128, 4)
    with kernels.planner.override("fwd", implementation="tl"):
        out, lse = kernels.attention_forward(q, k, v, attention)
    assert not launched and torch.isfinite(out.float()).all()
    with kernels.planner.override("fwd", kernels.configs.TileConfig(16, 16, 4, 1)):
        again, _ = kernels.attention_forward(q, k, v, attention)
    torch.testing.assert_close(again, out, atol=2e-2, rtol=0)  # (other tiles: another summation order)
    tl_kernels = []
    real_launcher = kernels.backward.launcher
    monkeypatch.setattr(kernels.backward, "launcher", lambda kernel, *args: tl_kernels.append(kernel.__name__)
                        or real_launcher(kernel, *args))
    kernels.attention_backward(dout, q, k, v, out, lse, attention)
    assert launched == {"bwd_dq": kernels.configs.GluonConfig(128, 64, 6),
                        "bwd_dkdv": kernels.configs.GluonConfig(64, 128, 4)}
    assert list(launched) == ["bwd_dq", "bwd_dkdv"] and tl_kernels == []  # (dQ first, making delta: no preprocess)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("window", [(-1, -1), (128, 0)])
def test_gluon_launchers_take_their_config(kernels, head_dim, window):
    """The Gluon launch functions build their grid, TMA blocks and ring depth from the planner's
    GluonConfig exactly as they did from their own constants (compiled here, launched only on
    Hopper, so the kernels are stand-ins that record their launch): programs of 128 query rows
    (forward, dQ) or 128 keys (dK/dV), blocks of 64 rows per consumer warpgroup, the table's
    stages (the window's deeper dK/dV ring)."""
    import sys

    names = {"fwd": "_forward_kernel", "bwd_dq": "_dq_kernel", "bwd_dkdv": "_dkdv_kernel"}
    launch_functions = {kernel: kernels.hopper_route.launcher(kernel) for kernel in names}
    if not all(launch_functions.values()):
        pytest.skip("this Triton's Gluon cannot build the Hopper kernels (hopper_route warned)")
    launches, scales = {}, {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                tiles = args[:6] if self.kernel == "fwd" else args[:8]  # (each tensor's chunks' descriptors)
                launches[self.kernel] = (grid, [list(getattr(a, "block_shape", [])) for a in tiles],
                                         constexprs.get("KEYS"), constexprs["STAGES"])
                scales[self.kernel] = [a for a in args if isinstance(a, float)]
            return launch

    module_objects = {kernel: sys.modules[function.__module__] for kernel, function in launch_functions.items()}
    saved = {kernel: getattr(module, names[kernel]) for kernel, module in module_objects.items()}
    try:
        for kernel, module in module_objects.items():
            setattr(module, names[kernel], Recorder(kernel))
        batch, seqlen, heads, heads_kv = 2, 512, 4, 2
        q = torch.randn(batch, seqlen, heads, head_dim, dtype=BF16)
        k, v = (torch.randn(batch, seqlen, heads_kv, head_dim, dtype=BF16) for _ in range(2))
        options = kernels.AttentionOptions(head_dim ** -0.5, False, *window)
        layout = kernels.launch.SequenceLayout.of(q, k)
        lse, out = torch.empty(batch, heads, seqlen), torch.empty_like(q)
        config = {kernel: kernels.configs.gluon_config(kernel, head_dim, options.mask_kind) for kernel in names}
        module_objects["fwd"].attention_forward(q, k, v, out, lse, options, layout, config["fwd"])
        module_objects["bwd_dq"].attention_dq(q, q, k, v, out, lse, None, lse, out, options, layout, config["bwd_dq"])
        module_objects["bwd_dkdv"].attention_dkdv(q, q, k, v, lse, lse, k, v, options, layout, config["bwd_dkdv"])
    finally:
        for kernel, module in module_objects.items():
            setattr(module, names[kernel], saved[kernel])
    d, programs = head_dim, seqlen // 128
    first, second = kernels.configs.head_dim_chunks(d)  # (96: 64 + 32; a second chunk of 0: None)
    window_dkdv = 4 if window[0] >= 0 else GLUON_STAGES["bwd_dkdv", d]
    second_fwd = [[64, second], [128, second], [128, second]] if second else [[], [], []]
    assert launches["fwd"] == ((programs, heads, batch), [[64, first], [128, first], [128, first], *second_fwd],
                               128, GLUON_STAGES["fwd", d])
    second_bwd = [[64, second] if second else []] * 4
    assert launches["bwd_dq"] == ((programs, heads, batch), [[64, first]] * 4 + second_bwd, 64,
                                  GLUON_STAGES["bwd_dq", d])
    assert launches["bwd_dkdv"] == ((programs, heads_kv, batch), [[64, first]] * 4 + second_bwd, None, window_dkdv)
    # the logits' units of these 2-byte kernels: q.k * softmax_scale * log2(e) (an fp32 stand-in for
    # the options' pointers once gave kernel_args' natural fp32 units: every Gluon result wrong on an H100)
    for kernel in names:
        assert scales[kernel][0] == pytest.approx(head_dim ** -0.5 * math.log2(math.e), rel=1e-12), scales[kernel]


def test_plans_are_cached_by_the_calls_signature(kernels, monkeypatch):
    """An eager call's plan is made once per signature (planner.plan_key) and found again; a call
    that differs in any fact a plan reads (a shape, the options, a tensor's alignment, an
    environment switch) is planned afresh; an override empties the cache; fake tensors (traced
    calls) are never cached."""
    planner = kernels.planner
    made = []
    monkeypatch.setattr(planner, "tl_launch", lambda kernel, *args: made.append(kernel) or kernels.launch.TlLaunch(
        kernel, kernels.configs.TileConfig(16, 16, 1, 1), False, False))
    # another call's launch fell back to a smaller config (as an earlier test in this process may
    # have made one do): this call's plan, which that fallback does not touch, is still the cached one
    monkeypatch.setattr(kernels.launch, "_FITTED", {("another call",): kernels.configs.TileConfig(16, 16, 1, 1)})
    attention, layout, q, k, v, dout = _call(kernels, BF16, 64, 32, 48)
    first = planner.plan_forward(attention, layout, True, q, k, v)
    assert planner.plan_forward(attention, layout, True, q.clone(), k.clone(), v.clone()) is first
    assert planner.plan_backward(attention, layout, True, q, k, v, dout) is planner.plan_backward(
        attention, layout, True, q, k, v, dout)
    assert made == ["fwd", "bwd_dq", "bwd_dkdv"]
    causal = kernels.AttentionOptions(attention.softmax_scale, True)
    planner.plan_forward(causal, layout, True, q, k, v)
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    planner.plan_forward(attention, layout, True, misaligned, k, v)
    monkeypatch.setenv("FLASH_ATTENTION_TMA", "0")
    planner.plan_forward(attention, layout, True, q, k, v)
    assert made[3:] == ["fwd", "fwd", "fwd"]
    monkeypatch.delenv("FLASH_ATTENTION_TMA")
    assert planner.plan_forward(attention, layout, True, q, k, v) is first
    with planner.override("fwd", implementation="tl"):
        planner.plan_forward(attention, layout, True, q, k, v)
    assert planner.plan_forward(attention, layout, True, q, k, v) is not first
    assert made[6:] == ["fwd", "fwd"]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in (q, k, v)]
        assert planner.plan_key("fwd", attention, layout, True, fakes) is None
