"""The backward's Gluon kernels for Hopper (flash_attention_kernel/hopper_dkdv.py, hopper_dq.py).

On a Hopper GPU under a checked Triton, dense backward calls with full tiles, head dim 64, 80, 96 or 128,
bf16/fp16 and any options take them instead of the tl kernels: the dK/dV kernel where seqlen_q is a multiple of 64 and seqlen_k of 128, the dQ kernel
where seqlen_q is a multiple of 128 and seqlen_k of 64 (the other cases mix a Gluon kernel with a
tl one). The cases cross what the kernels handle themselves: causal rows aligned bottom-right
(seqlen_q above and below seqlen_k, rows that see no key), GQA groups streamed through one ring,
heads side by side or one under another in the TMA matrix view, packed qkv, a softcap past its
cap, sinks in the lse, dropout's keep mask redrawn from Philox (it must be the forward's, bit for
bit, or the gradients miss the bar by far), window bounds that cut tiles anywhere (each warpgroup's
tile ranges, tiles released unread), ALiBi on one side of the diagonal and on both. Each meets the float64 bar, and
FLASH_ATTENTION_GLUON=0 (the tl kernels) agrees to rounding. On the CPU the kernels cannot run, so
the CPU tests check the decision and compile the kernels for sm_90 under the installed Triton (its
Gluon API changes by release).
"""

import math

import pytest
import torch
import triton

from conftest import ON_GPU
from gluon_compile import assert_compiles_for_hopper, gluon_module
from inputs import bshd
from reference import BWD_FACTOR, assert_within_bar, run_ref
from sizes import BF16

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


def _routed_to_gluon(fa, q, k, v, causal=False, **options):
    """Whether the planner gives these inputs' (dK/dV, dQ) passes to the Gluon kernels (as
    attention_backward asks it)."""
    kernels = fa.flash_attention_kernel
    layout = kernels.launch.SequenceLayout.of(q, k)
    attention = kernels.AttentionOptions(q.shape[-1] ** -0.5, causal, **options)
    plan = kernels.planner.plan_backward(attention, layout, not ON_GPU, q, k, v, torch.empty_like(q))
    return plan.dkdv.implementation == "gluon", plan.dq.implementation == "gluon"


def _taken(fa, q, k, v, causal=False, **options):
    """Whether both Gluon kernels take these inputs."""
    return all(_routed_to_gluon(fa, q, k, v, causal, **options))


def test_taken_only_where_they_can_work(fa, monkeypatch):
    q, k, v = bshd(2, 256, 4, BF16), bshd(2, 256, 2, BF16), bshd(2, 256, 2, BF16)
    checked = triton.__version__.startswith(fa.flash_attention_kernel.hopper_route.CHECKED_VERSIONS)
    assert _taken(fa, q, k, v, causal=True) == (ON_HOPPER and checked)
    assert _taken(fa, q, k, v, softcap=30.0) == (ON_HOPPER and checked)
    assert _taken(fa, q, k, v, causal=True, softcap=30.0, sinks=torch.zeros(4, device=q.device)) == \
        (ON_HOPPER and checked)
    assert _taken(fa, q, k, v, causal=True, dropout_p=0.1) == (ON_HOPPER and checked)
    # (dQ: the tl kernel is faster)
    assert _routed_to_gluon(fa, q, k, v, dropout_p=0.1) == (ON_HOPPER and checked, False)
    assert _taken(fa, q, k, v) == (ON_HOPPER and checked)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")  # any Triton; still only where the kernel can run
    assert _taken(fa, q, k, v) == ON_HOPPER and _taken(fa, q, k, v, causal=True, dropout_p=0.1) == ON_HOPPER
    assert not any(_routed_to_gluon(fa, q[:, :120], k, v))  # a partial query tile
    assert _routed_to_gluon(fa, q[:, :192], k, v) == (ON_HOPPER, False)  # whole for dK/dV, partial for dQ
    assert _routed_to_gluon(fa, q, k[:, :192], v[:, :192]) == (False, ON_HOPPER)  # partial for dK/dV, whole for dQ
    assert not any(_routed_to_gluon(fa, q, k[:, :160], v[:, :160]))
    assert _taken(fa, *(x[..., :96].contiguous() for x in (q, k, v))) == ON_HOPPER  # (two chunks: 64 + 32)
    assert not any(_routed_to_gluon(fa, *(x[..., :112].contiguous() for x in (q, k, v))))  # (no Gluon head dim)
    assert not any(_routed_to_gluon(fa, q.float(), k.float(), v.float()))
    slopes = torch.zeros(4, device=q.device)
    for options in (dict(window_left=64), dict(causal=True, window_left=64), dict(window_right=0),
                    dict(window_left=8, window_right=3, alibi_slopes=slopes), dict(causal=True, alibi_slopes=slopes)):
        assert _taken(fa, q, k, v, **options) == ON_HOPPER
    monkeypatch.setenv("FLASH_ATTENTION_TMA", "0")
    assert not any(_routed_to_gluon(fa, q, k, v))
    monkeypatch.delenv("FLASH_ATTENTION_TMA")
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "0")
    assert not any(_routed_to_gluon(fa, q, k, v))


# (tests/gluon_compile.py: args kernel ("dkdv", "dkdv_fused": with FUSED_DQ, or "dq"), head dim, group,
# VARIANT, ALIBI_ABS)
_KERNEL_SIGNATURE = """
kernel, head_dim, group, variant, alibi_abs = args
head_dim, group, variant, alibi_abs = int(head_dim), int(group), int(variant), alibi_abs == "True"
fused = kernel == "dkdv_fused"
kernel = kernel.removesuffix("_fused")
module = importlib.import_module(name + ".flash_attention_kernel.hopper_" + kernel)
geometry = [f"{t}_{n}" for t in ("q", "k", "v", "do") for n in ("batch_rows", "head_rows", "head_cols")]
options = dict(score_scale="fp32", softcap_log2="fp32", softmax_scale="fp32", window_left="i32",
               window_right="i32", AlibiSlopes="*fp32", stride_alibi_b="i32", RngState="*i64",
               dropout_threshold="i32", dropout_scale="fp32")
if kernel == "dkdv":
    stats = f"tensordesc<fp32[64],{module.STAT_LAYOUT!r}>"
    arguments = dict(
        lse_desc=stats, delta_desc=stats, DK="*bf16", DV="*bf16",
        **{f"stride_{t}{s}": "i64" for t in ("dk", "dv") for s in ("b", "h", "n")},
        seqlen_q="i32", diag="i32", num_heads="i32", dq_batch_rows="i32", dq_head_rows="i32", dq_head_cols="i32")
    function = module._dkdv_kernel
    extra = dict(FUSED_DQ=fused)
    second_chunk = importlib.import_module(name + ".flash_attention_kernel.configs").head_dim_chunks(head_dim)[1]
    if fused:  # (the fp32 accumulator's boxes: 64 rows by DQ_BOX_COLUMNS, and by a second chunk's width)
        arguments["dq_target"] = f"tensordesc<fp32[64, {module.DQ_BOX_COLUMNS}],{module.DQ_STAGE_LAYOUT!r}>"
        if second_chunk:
            layout = module.dq_stage_layout(second_chunk)
            arguments["dq_target_b"] = f"tensordesc<fp32[64, {second_chunk}],{layout!r}>"
    if not fused or not second_chunk:
        extra["dq_target_b"] = None
    if not fused:
        extra["dq_target"] = None
else:
    arguments = dict(
        Out="*bf16", Lse="*fp32", DLse="*fp32", Delta="*fp32", stride_stat_b="i64", stride_stat_h="i64", DQ="*bf16",
        **{f"stride_{t}{s}": "i64" for t in ("o", "dq") for s in ("b", "h", "m")}, seqlen_k="i32", diag="i32")
    function = module._dq_kernel
    row_calls = sys.modules[name + ".flash_attention_kernel.hopper_dropout"].row_calls
    # (delta made with the lse's gradient: the kernel's every line)
    extra = dict(KEYS=module.KEY_ROWS, CALLS_LAYOUT=row_calls(module.KEY_ROWS), HAS_DLSE=True)
configs = importlib.import_module(name + ".flash_attention_kernel.configs")
mask_left = importlib.import_module(name + ".flash_attention_kernel.options").MASK_LEFT
stages = configs.gluon_config("bwd_" + kernel, head_dim, "window" if variant & mask_left else "none").stages
if fused:
    stages = configs.GLUON_FUSED_STAGES[head_dim]
constants = dict(GROUP_SIZE=group, STAGES=stages, VARIANT=variant, ALIBI_ABS=alibi_abs, **extra)
descriptors = {}
for tensor in ("q", "k", "v", "do"):  # (every tile of both kernels has 64 rows)
    descriptors.update(chunk_descriptors(tensor, 64, configs.head_dim_chunks(head_dim), constants))
types = dict(**descriptors, **{n: "i32" for n in geometry}, **arguments, **options)
signature = {n: "constexpr" if n in constants else types[n] for n in function.arg_names}
"""


@pytest.mark.parametrize("kernel", ["dkdv", "dq"])
@pytest.mark.parametrize("head_dim, group, options", [
    (128, 1, dict(causal=True, softcap=30.0)), (64, 2, {}), (128, 2, dict(causal=True, dropout_p=0.1)),
    (128, 1, dict(window_left=256, window_right=128, alibi=True)),
    (64, 2, dict(causal=True, window_left=256, alibi=True, softcap=30.0, dropout_p=0.1)),
    (96, 2, dict(causal=True, dropout_p=0.1)), (80, 1, dict(window_left=256, alibi=True, softcap=30.0)),
], ids=["causal-softcap", "plain", "causal-dropout", "window-alibi", "everything", "d96-causal-dropout",
        "d80-window-alibi-softcap"])
def test_compiles_for_hopper(fa, kernel, head_dim, group, options):
    """The kernels compile to sm_90 cubins under the installed Triton, with no GPU needed."""
    _assert_kernel_compiles(fa, kernel, head_dim, group, options)


def _assert_kernel_compiles(fa, kernel, head_dim, group, options):
    """``kernel`` (_KERNEL_SIGNATURE's) compiled for sm_90 with these options (``alibi``: slopes given)."""
    options = dict(options)  # (the parametrized dict serves both kernels: popping from it lost dQ's ALiBi)
    alibi = options.pop("alibi", False)
    attention = fa.flash_attention_kernel.AttentionOptions(
        0.125, alibi_slopes=torch.ones(1) if alibi else None, **options)
    _, constexprs = gluon_module(fa, "hopper_gluon").option_arguments(attention, torch.empty(1))
    assert_compiles_for_hopper(fa, _KERNEL_SIGNATURE, kernel, head_dim, group, constexprs["VARIANT"],
                               constexprs["ALIBI_ABS"])


@pytest.mark.parametrize("head_dim, group, options", [
    (128, 1, dict(causal=True)), (128, 1, {}), (64, 1, dict(causal=True)), (64, 2, {}),
    (128, 2, dict(causal=True, window_left=256, softcap=30.0, alibi=True)),
    (96, 1, dict(causal=True)), (96, 1, {}), (80, 1, dict(causal=True)), (80, 2, dict(window_left=256, softcap=30.0)),
], ids=["d128-causal", "d128-plain", "d64-causal", "d64-gqa", "d128-gqa-window-softcap-alibi", "d96-causal",
        "d96-plain", "d80-causal", "d80-gqa-window-softcap"])
def test_fused_dq_compiles_for_hopper(fa, head_dim, group, options):
    """The dK/dV kernel with FUSED_DQ compiles to an sm_90 cubin within 227 KB, its wgmmas
    pipelined, dQ added by TMA reductions (on the CPU, ``scripts/triton_matrix.py --checks gluon
    3.6.0 3.8.0 3.9.0`` runs it under those, docs/testing.md)."""
    _assert_kernel_compiles(fa, "dkdv_fused", head_dim, group, options)


def _bhsd_view(batch, seqlen, heads, dtype, head_dim=128):
    return bshd(batch, heads, seqlen, dtype, head_dim).transpose(1, 2)


# (name, q, k, v builders, causal, which Gluon kernels take it: (dK/dV, dQ))
CASES = [
    ("gqa-causal", lambda dt: (bshd(2, 256, 4, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)), True,
     (True, True)),
    ("gqa4-full", lambda dt: (bshd(1, 384, 8, dt), bshd(1, 384, 2, dt), bshd(1, 384, 2, dt)), False,
     (True, True)),
    ("fewer-queries-causal", lambda dt: (bshd(2, 128, 2, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)), True,
     (True, True)),
    ("more-queries-causal", lambda dt: (bshd(2, 384, 2, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)), True,
     (True, True)),  # (the first 128 rows see no key)
    ("short-keys-causal", lambda dt: (bshd(2, 256, 2, dt), bshd(2, 192, 2, dt), bshd(2, 192, 2, dt)), True,
     (False, True)),
    ("odd-query-tile-causal", lambda dt: (bshd(2, 448, 2, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)), True,
     (True, False)),
    ("bhsd-view", lambda dt: (_bhsd_view(2, 128, 3, dt), _bhsd_view(2, 256, 3, dt), _bhsd_view(2, 256, 3, dt)),
     True, (True, True)),
    ("qkv-packed", lambda dt: bshd(2, 256, 3 * 2, dt).unflatten(2, (3, 2)).unbind(2), False, (True, True)),
    ("d64-gqa-causal", lambda dt: (bshd(2, 256, 4, dt, 64), bshd(2, 384, 1, dt, 64), bshd(2, 384, 1, dt, 64)),
     True, (True, True)),
    ("d64-more-queries", lambda dt: (bshd(1, 320, 4, dt, 64), bshd(1, 256, 2, dt, 64), bshd(1, 256, 2, dt, 64)),
     True, (True, False)),
    # (head dims held as two chunks, 64 + 32 and 64 + 16: hopper_gluon.tile_arguments)
    ("d96-gqa-causal", lambda dt: (bshd(2, 256, 4, dt, 96), bshd(2, 384, 2, dt, 96), bshd(2, 384, 2, dt, 96)),
     True, (True, True)),
    ("d80-gqa4-full", lambda dt: (bshd(1, 384, 8, dt, 80), bshd(1, 384, 2, dt, 80), bshd(1, 384, 2, dt, 80)),
     False, (True, True)),
    ("d96-qkv-packed", lambda dt: bshd(2, 256, 3 * 2, dt, 96).unflatten(2, (3, 2)).unbind(2), False, (True, True)),
    ("d80-bhsd-more-queries", lambda dt: (_bhsd_view(2, 384, 3, dt, 80), _bhsd_view(2, 256, 3, dt, 80),
                                          _bhsd_view(2, 256, 3, dt, 80)), True, (True, True)),
]


def _assert_meets_bar(grads, q, k, v, dout, causal, **reference):
    """dq, dk, dv ``grads`` within BWD_FACTOR of PyTorch's bf16 error against float64 (``run_ref``
    with ``reference``'s options)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    _, truth = run_ref(q, k, v, dout, causal, scale, torch.float64, **reference)
    _, same_dtype = run_ref(q, k, v, dout, causal, scale, BF16, **reference)
    for label, mine, pt, exact in zip(("dq", "dk", "dv"), grads, same_dtype, truth):
        assert_within_bar(label, mine, pt, exact, BWD_FACTOR)


def _gradients(fa, monkeypatch, setting, q, k, v, dout, causal, **options):
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", setting)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = fa.flash_attn_func(*leaves, causal=causal, **options)
    return torch.autograd.grad(out, leaves, dout)


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
@pytest.mark.parametrize("softcap", [0.0, 8.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, make, causal, taken", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_tl_kernel(fa, monkeypatch, name, make, causal, taken, dtype, softcap):
    q, k, v = make(dtype)
    if softcap:
        q = q * 4  # scores past the cap, where tanh' is small
    dout = torch.randn_like(q)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    assert _routed_to_gluon(fa, q, k, v, causal=causal, softcap=softcap) == taken
    ours = _gradients(fa, monkeypatch, "1", q, k, v, dout, causal, softcap=softcap)
    tl_kernel = _gradients(fa, monkeypatch, "0", q, k, v, dout, causal, softcap=softcap)
    scale = 1.0 / math.sqrt(q.shape[-1])
    _, truth = run_ref(q, k, v, dout, causal, scale, torch.float64, softcap=softcap)
    _, same_dtype = run_ref(q, k, v, dout, causal, scale, dtype, softcap=softcap)
    for label, mine, other, pt, exact in zip(("dq", "dk", "dv"), ours, tl_kernel, same_dtype, truth):
        assert_within_bar(label, mine, pt, exact, BWD_FACTOR)
        assert_within_bar(f"{label} (tl kernel)", other, pt, exact, BWD_FACTOR)


FUSED_CASES = [case for case in CASES if case[0] in ("gqa-causal", "gqa4-full", "fewer-queries-causal",
                                                      "more-queries-causal", "odd-query-tile-causal", "bhsd-view",
                                                      "qkv-packed", "d64-gqa-causal", "d64-more-queries",
                                                      "d96-gqa-causal", "d80-gqa4-full", "d96-qkv-packed",
                                                      "d80-bhsd-more-queries")]


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
@pytest.mark.parametrize("options", [{}, dict(softcap=8.0), dict(window_size=(100, 37))], ids=["plain", "softcap", "window"])
@pytest.mark.parametrize("name, make, causal, taken", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_fused_dq(fa, monkeypatch, name, make, causal, taken, options):
    """The backward in one kernel (hopper_dkdv's FUSED_DQ: dQ added by TMA reductions), forced by
    FLASH_ATTENTION_FUSED_DQ=1 beyond the calls its default rule gives it (GQA groups, causal rows
    above and below the keys, a bhsd view, packed qkv, softcap, window), meets the float64 bar
    wherever the dK/dV kernel takes the call."""
    kernels = fa.flash_attention_kernel
    if kernels.hopper_route.fused_launcher() is None:
        pytest.skip(f"Triton {triton.__version__}'s Gluon cannot build the Hopper kernels")
    q, k, v = make(BF16)
    if options.get("softcap"):
        q = q * 4
    dout = torch.randn_like(q)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    monkeypatch.setenv("FLASH_ATTENTION_FUSED_DQ", "1")
    layout = kernels.launch.SequenceLayout.of(q, k)
    window = options.get("window_size", (-1, -1))
    attention = kernels.AttentionOptions(q.shape[-1] ** -0.5, causal, window_left=window[0], window_right=window[1],
                                         softcap=options.get("softcap", 0.0))
    assert kernels.planner.plan_backward(attention, layout, False, q, k, v, dout).fused == taken[0]
    ours = _gradients(fa, monkeypatch, "1", q, k, v, dout, causal, **options)
    _assert_meets_bar(ours, q, k, v, dout, causal, softcap=options.get("softcap", 0.0), window=window)


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
def test_fused_dq_default_route(fa, monkeypatch):
    """By default a long causal d128 call takes the fused backward under the Triton releases whose
    hopper_route.FUSED_DQ_MIN_KEYS holds d128 causal (3072 tokens, a row seeing 1536 keys on average,
    or twice the release's threshold) and meets the float64 bar; deterministic=True keeps it on the
    two kernels, bitwise repeatable."""
    kernels = fa.flash_attention_kernel
    min_keys = kernels.hopper_route.fused_min_keys().get((128, "causal"))
    q, k, v = (bshd(1, max(3072, 2 * (min_keys or 0)), 2, BF16) for _ in range(3))
    dout = torch.randn_like(q)
    monkeypatch.delenv("FLASH_ATTENTION_FUSED_DQ", raising=False)
    layout = kernels.launch.SequenceLayout.of(q, k)
    plan = kernels.planner.plan_backward(kernels.AttentionOptions(128 ** -0.5, True), layout, False, q, k, v, dout)
    assert plan.fused == (min_keys is not None and kernels.hopper_route.fused_launcher() is not None)
    _assert_meets_bar(_gradients(fa, monkeypatch, "", q, k, v, dout, True), q, k, v, dout, True)
    deterministic = kernels.AttentionOptions(128 ** -0.5, True, deterministic=True)
    assert not kernels.planner.plan_backward(deterministic, layout, False, q, k, v, dout).fused
    first, again = (_gradients(fa, monkeypatch, "", q, k, v, dout, True, deterministic=True) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
def test_sinks_and_repeatability(fa, monkeypatch):
    """Sinks reach the kernels through the lse only; the gradients are bitwise repeatable."""
    q, k, v = bshd(2, 256, 4, BF16), bshd(2, 256, 2, BF16), bshd(2, 256, 2, BF16)
    sinks = torch.randn(4, device=q.device)
    dout = torch.randn_like(q)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    assert _taken(fa, q, k, v, causal=True, sinks=sinks)
    first = _gradients(fa, monkeypatch, "1", q, k, v, dout, True, s_aux=sinks)
    again = _gradients(fa, monkeypatch, "1", q, k, v, dout, True, s_aux=sinks)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    _assert_meets_bar(first, q, k, v, dout, True, sinks=sinks)


DROPOUT_CASES = [case for case in CASES if case[0] in ("gqa-causal", "gqa4-full", "more-queries-causal",
                                                        "short-keys-causal", "d64-gqa-causal", "d96-gqa-causal",
                                                        "d80-gqa4-full")]


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
@pytest.mark.parametrize("softcap", [0.0, 8.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("name, make, causal, taken", DROPOUT_CASES, ids=[c[0] for c in DROPOUT_CASES])
def test_dropout_redraws_the_forward_mask(fa, monkeypatch, name, make, causal, taken, softcap):
    """The kernels draw each pair's keep bit themselves (scores.dropout_keep's mapping in Gluon):
    with the mask the forward returned (S_dmask), the gradients meet the float64 bar, as the tl
    kernels' do on the same call; the gradients repeat bit for bit."""
    q, k, v = make(BF16)
    dropout_p = 0.17
    dout = torch.randn_like(q)
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    dkdv_taken, dq_taken = taken  # (the Gluon dQ kernel leaves dropout without causal to the tl one)
    assert _routed_to_gluon(fa, q, k, v, causal=causal, softcap=softcap, dropout_p=dropout_p) == (dkdv_taken, dq_taken and causal)
    runs = {}
    for setting in ("1", "0", "1"):
        monkeypatch.setenv("FLASH_ATTENTION_GLUON", setting)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        torch.manual_seed(7)
        out, _, S_dmask = fa.flash_attn_func(*leaves, dropout_p=dropout_p, causal=causal, softcap=softcap,
                                             return_attn_probs=True)
        grads = torch.autograd.grad(out, leaves, dout)
        if setting in runs:
            assert all(torch.equal(a, b) for a, b in zip(grads, runs[setting][1]))
        runs[setting] = (~torch.signbit(S_dmask), grads)
    keep = runs["1"][0]
    assert torch.equal(keep, runs["0"][0])  # (S_dmask comes from the same tl kernel)
    scale = 1.0 / math.sqrt(q.shape[-1])
    options = dict(softcap=softcap, keep=keep, dropout_p=dropout_p)
    _, truth = run_ref(q, k, v, dout, causal, scale, torch.float64, **options)
    _, same_dtype = run_ref(q, k, v, dout, causal, scale, BF16, **options)
    for label, mine, other, pt, exact in zip(("dq", "dk", "dv"), runs["1"][1], runs["0"][1], same_dtype, truth):
        assert_within_bar(label, mine, pt, exact, BWD_FACTOR)
        assert_within_bar(f"{label} (tl kernel)", other, pt, exact, BWD_FACTOR)


# (name, (batch, seqlen_q, seqlen_k, heads, kv_heads), flash_attn_func options); "slopes" stands
# for ALiBi slopes of shape (heads,), "batch slopes" for (batch, heads); "sinks" for s_aux
BAND_CASES = [
    ("window", (2, 384, 384, 4, 2), dict(window_size=(100, 37))),
    ("window-causal-fewer-queries", (2, 256, 512, 2, 2), dict(causal=True, window_size=(200, -1))),
    ("window-causal-more-queries", (2, 512, 256, 2, 2), dict(causal=True, window_size=(70, -1))),
    ("diagonal-only", (1, 256, 256, 2, 2), dict(window_size=(0, 0))),
    ("right-edge-only", (2, 256, 384, 2, 1), dict(window_size=(-1, 50))),
    ("left-edge-only", (2, 384, 256, 2, 2), dict(window_size=(64, -1))),
    ("window-past-the-sequence", (1, 256, 256, 2, 2), dict(window_size=(5000, 5000))),
    ("alibi-causal-gqa", (2, 384, 384, 4, 2), dict(causal=True, alibi_slopes="slopes")),
    ("alibi", (2, 256, 384, 2, 2), dict(alibi_slopes="batch slopes")),
    ("alibi-window-causal", (2, 384, 256, 4, 2), dict(causal=True, window_size=(150, -1), alibi_slopes="slopes")),
    ("alibi-window-softcap", (1, 384, 384, 2, 2), dict(window_size=(120, 90), alibi_slopes="slopes", softcap=8.0)),
    # (9 and 10 blocks of 128 rows a head: programs whose band ends in different tiles)
    ("many-blocks-causal-window", (3, 1152, 1152, 2, 1), dict(causal=True, window_size=(260, 0))),
    ("many-blocks-left-window", (2, 1280, 1280, 3, 3), dict(window_size=(300, -1))),
    ("everything", (2, 256, 384, 4, 2), dict(causal=True, window_size=(170, -1), alibi_slopes="slopes",
                                             softcap=8.0, dropout_p=0.17, s_aux="sinks")),
]


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
@pytest.mark.parametrize("name, shape, options", BAND_CASES, ids=[c[0] for c in BAND_CASES])
def test_windows_and_alibi(fa, monkeypatch, name, shape, options):
    """Window bounds and ALiBi in both Gluon kernels: the float64 bar, agreement with the tl
    kernels' gradients, bitwise repeatability (with dropout: the forward's mask, from S_dmask)."""
    batch, seqlen_q, seqlen_k, heads, kv_heads = shape
    q, k, v = bshd(batch, seqlen_q, heads, BF16), bshd(batch, seqlen_k, kv_heads, BF16), \
        bshd(batch, seqlen_k, kv_heads, BF16)
    q = q * 2 if options.get("softcap") else q  # (scores past the cap)
    options = dict(options)
    stand_ins = {"slopes": torch.rand(heads, device=q.device) * 0.3 + 0.02,
                 "batch slopes": torch.rand(batch, heads, device=q.device) * 0.3 + 0.02,
                 "sinks": torch.randn(heads, device=q.device)}
    options = {key: stand_ins.get(value, value) if isinstance(value, str) else value for key, value in options.items()}
    dropout_p = options.get("dropout_p", 0.0)
    dout = torch.randn_like(q)
    causal = options.pop("causal", False)
    window = options.get("window_size", (-1, -1))
    kernels = fa.flash_attention_kernel
    attention = kernels.AttentionOptions(
        q.shape[-1] ** -0.5, causal, window_left=window[0], window_right=window[1], softcap=options.get("softcap", 0.0),
        dropout_p=dropout_p, alibi_slopes=options.get("alibi_slopes"), sinks=options.get("s_aux"))
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    layout = kernels.launch.SequenceLayout.of(q, k)
    plan = kernels.planner.plan_backward(attention, layout, False, q, k, v, dout)
    assert plan.dkdv.implementation == "gluon"
    assert (plan.dq.implementation == "gluon") == (causal or not dropout_p)
    runs = {}
    for setting in ("1", "0", "1"):
        monkeypatch.setenv("FLASH_ATTENTION_GLUON", setting)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        torch.manual_seed(7)
        if dropout_p:
            out, _, S_dmask = fa.flash_attn_func(*leaves, causal=causal, return_attn_probs=True, **options)
            keep = ~torch.signbit(S_dmask)
        else:
            out, keep = fa.flash_attn_func(*leaves, causal=causal, **options), None
        grads = torch.autograd.grad(out, leaves, dout)
        if setting in runs:
            assert all(torch.equal(a, b) for a, b in zip(grads, runs[setting]))
        runs[setting] = grads
    reference = dict(window=window, softcap=options.get("softcap", 0.0), alibi_slopes=options.get("alibi_slopes"),
                     sinks=options.get("s_aux"))
    if dropout_p:
        reference.update(keep=keep, dropout_p=dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1])
    _, truth = run_ref(q, k, v, dout, causal, scale, torch.float64, **reference)
    _, same_dtype = run_ref(q, k, v, dout, causal, scale, BF16, **reference)
    for label, mine, other, pt, exact in zip(("dq", "dk", "dv"), runs["1"], runs["0"], same_dtype, truth):
        assert_within_bar(label, mine, pt, exact, BWD_FACTOR)
        assert_within_bar(f"{label} (tl kernel)", other, pt, exact, BWD_FACTOR)
