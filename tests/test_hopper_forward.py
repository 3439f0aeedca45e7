"""The forward's Gluon kernel for Hopper (flash_attention_kernel/hopper_forward.py).

On a Hopper GPU under a checked Triton, dense forward calls whose seqlen_q and seqlen_k are
multiples of 128, with head dim 64, 80, 96 or 128, bf16/fp16 and any options take it instead of the
tl kernel. The cases cross what the kernel handles itself: its software pipeline (the first tile's P
formed before the loop, the last tile's P V after it, whichever range they lie in), causal rows
aligned bottom-right (rows that see no key end with lse +inf, or the sink), GQA groups, heads side
by side or one under another in the TMA matrix view, packed qkv, window bounds that cut tiles
anywhere, ALiBi on one side of the diagonal and on both, a softcap with the fixed pivot (bf16,
softcap <= 52) and with the running max (fp16, or a larger softcap), sinks, and dropout, whose keep
mask must be the one the tl kernels draw (``return_attn_probs``' S_dmask), bit for bit. Each meets
the float64 bar, agrees with the tl kernel (FLASH_ATTENTION_GLUON=0) and repeats bit for bit. On the
CPU the kernel cannot run: the CPU tests check the decision and compile it for sm_90 under the
installed Triton.
"""

import math

import pytest
import torch
import triton

from conftest import ON_GPU
from gluon_compile import assert_compiles_for_hopper, gluon_module
from inputs import bshd
from reference import FWD_FACTOR, assert_within_bar, attention_ref
from sizes import BF16

ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if ON_GPU else "cpu"


def _routed_to_gluon(fa, q, k, v, causal=False, **options):
    """Whether the planner gives these inputs' forward to the Gluon kernel (as attention_forward asks it)."""
    kernels = fa.flash_attention_kernel
    layout = kernels.launch.SequenceLayout.of(q, k)
    attention = kernels.AttentionOptions(q.shape[-1] ** -0.5, causal, **options)
    return kernels.planner.plan_forward(attention, layout, not ON_GPU, q, k, v).implementation == "gluon"


def test_taken_only_where_it_can_work(fa, monkeypatch):
    q, k, v = bshd(2, 256, 4, BF16), bshd(2, 384, 2, BF16), bshd(2, 384, 2, BF16)
    checked = triton.__version__.startswith(fa.flash_attention_kernel.hopper_route.CHECKED_VERSIONS)
    expected = ON_HOPPER and checked
    assert _routed_to_gluon(fa, q, k, v, causal=True) == expected
    assert _routed_to_gluon(fa, q, k, v, softcap=30.0, dropout_p=0.1, window_left=300, window_right=40) == expected
    assert _routed_to_gluon(fa, q, k, v, sinks=torch.zeros(4, device=q.device)) == expected
    # (too few keys a row for the default route, hopper_route.long_enough: d128 from 256, d64 from 1024)
    assert not _routed_to_gluon(fa, q, k, v, softcap=30.0, dropout_p=0.1, window_left=100, window_right=7)
    assert not _routed_to_gluon(fa, q[..., :64], k[..., :64], v[..., :64])
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")  # (every call it can run, short ones too)
    assert _routed_to_gluon(fa, q, k, v, softcap=30.0, dropout_p=0.1, window_left=100, window_right=7) == ON_HOPPER
    assert _routed_to_gluon(fa, q[..., :64], k[..., :64], v[..., :64]) == ON_HOPPER
    monkeypatch.delenv("FLASH_ATTENTION_GLUON")
    assert not _routed_to_gluon(fa, q, k[:, :192], v[:, :192])  # (keys not a multiple of 128)
    assert not _routed_to_gluon(fa, q[:, :192], k, v)  # (queries not a multiple of 128)
    assert not _routed_to_gluon(fa, q[..., :112], k[..., :112], v[..., :112])  # (no Gluon head dim)
    assert _routed_to_gluon(fa, q[..., :96], k[..., :96], v[..., :96]) == expected  # (two chunks: 64 + 32)
    assert not _routed_to_gluon(fa, q.float(), k.float(), v.float())
    kernels = fa.flash_attention_kernel
    cu_seqlens = torch.tensor([0, 256, 512], dtype=torch.int32, device=q.device)
    varlen = kernels.launch.SequenceLayout.of(q.flatten(0, 1), k[:, :256].flatten(0, 1), cu_seqlens, cu_seqlens,
                                              256, 256)
    assert kernels.planner.plan_forward(kernels.AttentionOptions(q.shape[-1] ** -0.5, True), varlen, not ON_GPU,
                                        q.flatten(0, 1), k[:, :256].flatten(0, 1),
                                        v[:, :256].flatten(0, 1)).implementation == "tl"
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "0")
    assert not _routed_to_gluon(fa, q, k, v, causal=True)


# (tests/gluon_compile.py: args head dim, group, VARIANT, ALIBI_ABS)
_KERNEL_SIGNATURE = """
head_dim, group, variant, alibi_abs = int(args[0]), int(args[1]), int(args[2]), args[3] == "True"
module = importlib.import_module(name + ".flash_attention_kernel.hopper_forward")
configs = importlib.import_module(name + ".flash_attention_kernel.configs")
types = dict(Out="*bf16", Lse="*fp32", Sinks="*fp32", AlibiSlopes="*fp32", RngState="*i64", score_scale="fp32",
             softcap_log2="fp32", softmax_scale="fp32", dropout_scale="fp32")
constants = dict(KEYS=module.KEY_ROWS, GROUP_SIZE=group,
                 STAGES=configs.gluon_config("fwd", head_dim, "none").stages, CALLS_LAYOUT=module.CALLS,
                 VARIANT=variant, ALIBI_ABS=alibi_abs)
for tensor, rows in (("q", module.QUERY_ROWS), ("k", module.KEY_ROWS), ("v", module.KEY_ROWS)):
    types.update(chunk_descriptors(tensor, rows, configs.head_dim_chunks(head_dim), constants))
function = module._forward_kernel
signature = {n: "constexpr" if n in constants else types.get(n, "i64" if n.startswith("stride_o") else "i32")
             for n in function.arg_names}
"""


@pytest.mark.parametrize("head_dim, group, options", [
    (128, 1, dict(causal=True, softcap=30.0)), (64, 2, {}),
    (128, 2, dict(causal=True, window_left=256, alibi=True, dropout_p=0.1, sinks=True)),
    (96, 1, dict(causal=True)), (80, 2, dict(window_left=256, alibi=True, dropout_p=0.1, softcap=30.0)),
], ids=["causal-softcap", "plain", "window-alibi-dropout-sinks", "d96-causal", "d80-everything"])
def test_compiles_for_hopper(fa, head_dim, group, options):
    """The kernel compiles to an sm_90 cubin under the installed Triton, with no GPU needed."""
    kernels = fa.flash_attention_kernel
    options = dict(options)
    alibi, sinks = options.pop("alibi", False), options.pop("sinks", False)
    attention = kernels.AttentionOptions(0.125, alibi_slopes=torch.ones(1) if alibi else None,
                                         sinks=torch.ones(1) if sinks else None, **options)
    _, constexprs = gluon_module(fa, "hopper_gluon").option_arguments(attention, torch.empty(1))
    variant = constexprs["VARIANT"] | gluon_module(fa, "hopper_forward").forward_bits(attention, BF16)
    assert_compiles_for_hopper(fa, _KERNEL_SIGNATURE, head_dim, group, variant, constexprs["ALIBI_ABS"])


@pytest.mark.parametrize("head_dim, chunks", [(64, (64,)), (80, (64, 16)), (96, (64, 32)), (128, (128,))])
def test_tile_arguments_hold_head_dims_in_chunks(fa, head_dim, chunks):
    """Every kernel's first arguments: each tensor's first-chunk descriptor, then its second-chunk
    one (None where the head dim is one chunk), then the row geometry; the chunks are the head dim
    split into powers of two, each descriptor over the whole row matrix (the kernels add the first
    chunk's width to the second's column)."""
    kernels = fa.flash_attention_kernel
    q, k = bshd(2, 256, 4, BF16, head_dim), bshd(2, 384, 2, BF16, head_dim)
    layout = kernels.launch.SequenceLayout.of(q, k)
    arguments = gluon_module(fa, "hopper_gluon").tile_arguments((q, k, k), layout, (64, 128, 128))
    descriptors, geometry = arguments[:6], arguments[6:]
    for i, (x, rows) in enumerate(zip((q, k, k), (64, 128, 128))):
        first, second = descriptors[i], descriptors[3 + i]
        assert first.base is x and list(first.block_shape) == [rows, chunks[0]]
        assert list(first.shape) == [x.shape[0] * x.shape[1], x.shape[2] * head_dim]
        if len(chunks) == 1:
            assert second is None
        else:
            assert second.base is x and list(second.block_shape) == [rows, chunks[1]]
            assert list(second.shape) == list(first.shape)
    assert geometry == [256, 0, head_dim, 384, 0, head_dim, 384, 0, head_dim]


def _bhsd_view(batch, seqlen, heads, dtype, head_dim=128):
    return bshd(batch, heads, seqlen, dtype, head_dim).transpose(1, 2)


# (name, q, k, v builders, flash_attn_func options); "slopes" stands for ALiBi slopes of shape
# (heads,), "batch slopes" for (batch, heads), "negative slopes" for (heads,) below zero, "sinks" for
# s_aux
CASES = [
    ("gqa-causal", lambda dt: (bshd(2, 256, 4, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)), dict(causal=True)),
    ("gqa4-full", lambda dt: (bshd(1, 384, 8, dt), bshd(1, 384, 2, dt), bshd(1, 384, 2, dt)), {}),
    ("one-tile", lambda dt: (bshd(3, 128, 2, dt), bshd(3, 128, 2, dt), bshd(3, 128, 2, dt)), {}),
    ("fewer-queries-causal", lambda dt: (bshd(2, 128, 2, dt), bshd(2, 512, 2, dt), bshd(2, 512, 2, dt)),
     dict(causal=True)),
    ("more-queries-causal", lambda dt: (bshd(2, 512, 2, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)),
     dict(causal=True)),  # (the first 256 rows see no key)
    ("bhsd-view", lambda dt: (_bhsd_view(2, 128, 3, dt), _bhsd_view(2, 256, 3, dt), _bhsd_view(2, 256, 3, dt)),
     dict(causal=True)),
    ("qkv-packed", lambda dt: bshd(2, 256, 3 * 2, dt).unflatten(2, (3, 2)).unbind(2), {}),
    ("d64-gqa-causal", lambda dt: (bshd(2, 256, 4, dt, 64), bshd(2, 384, 1, dt, 64), bshd(2, 384, 1, dt, 64)),
     dict(causal=True)),
    ("softcap-fixed-pivot", lambda dt: (bshd(2, 256, 2, dt) * 3, bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)),
     dict(causal=True, softcap=30.0)),
    ("softcap-running-max", lambda dt: (bshd(2, 384, 2, dt) * 3, bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)),
     dict(softcap=60.0)),
    ("sinks-causal", lambda dt: (bshd(2, 384, 4, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)),
     dict(causal=True, s_aux="sinks")),
    ("window", lambda dt: (bshd(2, 384, 4, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)),
     dict(window_size=(100, 37))),
    ("window-causal-more-queries", lambda dt: (bshd(2, 512, 2, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)),
     dict(causal=True, window_size=(70, -1))),
    ("diagonal-only", lambda dt: (bshd(1, 256, 2, dt), bshd(1, 256, 2, dt), bshd(1, 256, 2, dt)),
     dict(window_size=(0, 0))),
    ("left-edge-only", lambda dt: (bshd(2, 384, 2, dt), bshd(2, 256, 2, dt), bshd(2, 256, 2, dt)),
     dict(window_size=(64, -1))),
    ("window-past-the-sequence", lambda dt: (bshd(1, 256, 2, dt), bshd(1, 256, 2, dt), bshd(1, 256, 2, dt)),
     dict(window_size=(5000, 5000))),
    # (9 and 10 blocks of 128 rows a head: programs whose band ends in different tiles)
    ("many-blocks-causal-window", lambda dt: (bshd(3, 1152, 2, dt), bshd(3, 1152, 1, dt), bshd(3, 1152, 1, dt)),
     dict(causal=True, window_size=(260, 0))),
    ("many-blocks-left-window", lambda dt: (bshd(2, 1280, 3, dt), bshd(2, 1280, 3, dt), bshd(2, 1280, 3, dt)),
     dict(window_size=(300, -1))),
    ("alibi-causal-gqa", lambda dt: (bshd(2, 384, 4, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)),
     dict(causal=True, alibi_slopes="slopes")),
    ("alibi", lambda dt: (bshd(2, 256, 2, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)),
     dict(alibi_slopes="batch slopes")),
    ("alibi-more-queries-negative-slopes",  # (tiles below, across and above the diagonal; diag < 0)
     lambda dt: (bshd(2, 512, 2, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)),
     dict(alibi_slopes="negative slopes")),
    ("alibi-window-softcap", lambda dt: (bshd(1, 384, 2, dt) * 2, bshd(1, 384, 2, dt), bshd(1, 384, 2, dt)),
     dict(window_size=(120, 90), alibi_slopes="slopes", softcap=8.0)),
    ("dropout", lambda dt: (bshd(2, 256, 4, dt), bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)), dict(dropout_p=0.17)),
    ("dropout-causal-d64", lambda dt: (bshd(2, 384, 2, dt, 64), bshd(2, 256, 2, dt, 64), bshd(2, 256, 2, dt, 64)),
     dict(causal=True, dropout_p=0.3)),
    ("everything", lambda dt: (bshd(2, 256, 4, dt) * 2, bshd(2, 384, 2, dt), bshd(2, 384, 2, dt)),
     dict(causal=True, window_size=(170, -1), alibi_slopes="slopes", softcap=8.0, dropout_p=0.17, s_aux="sinks")),
    # (head dims held as two chunks, 64 + 32 and 64 + 16: hopper_gluon.tile_arguments)
    ("d96-gqa-causal", lambda dt: (bshd(2, 256, 4, dt, 96), bshd(2, 384, 2, dt, 96), bshd(2, 384, 2, dt, 96)),
     dict(causal=True)),
    ("d80-gqa4-full", lambda dt: (bshd(1, 384, 8, dt, 80), bshd(1, 384, 2, dt, 80), bshd(1, 384, 2, dt, 80)), {}),
    ("d96-qkv-packed", lambda dt: bshd(2, 256, 3 * 2, dt, 96).unflatten(2, (3, 2)).unbind(2), {}),
    ("d80-bhsd-view-causal", lambda dt: (_bhsd_view(2, 128, 3, dt, 80), _bhsd_view(2, 256, 3, dt, 80),
                                         _bhsd_view(2, 256, 3, dt, 80)), dict(causal=True)),
    ("d96-dropout-causal", lambda dt: (bshd(2, 384, 2, dt, 96), bshd(2, 256, 2, dt, 96), bshd(2, 256, 2, dt, 96)),
     dict(causal=True, dropout_p=0.3)),
    ("d80-everything", lambda dt: (bshd(2, 256, 4, dt, 80) * 2, bshd(2, 384, 2, dt, 80), bshd(2, 384, 2, dt, 80)),
     dict(causal=True, window_size=(170, -1), alibi_slopes="slopes", softcap=8.0, dropout_p=0.17, s_aux="sinks")),
]


def _forward(fa, monkeypatch, setting, q, k, v, options):
    """(out, lse, keep mask or None) of flash_attn_func with FLASH_ATTENTION_GLUON=setting."""
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", setting)
    torch.manual_seed(7)
    out, lse, S_dmask = fa.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    return out, lse, None if S_dmask is None else ~torch.signbit(S_dmask)


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon kernels run on Hopper GPUs only")
@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name, make, options", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_tl_kernel(fa, monkeypatch, name, make, options, dtype):
    q, k, v = make(dtype)
    batch, heads = q.shape[0], q.shape[2]
    stand_ins = {"slopes": torch.rand(heads, device=q.device) * 0.3 + 0.02,
                 "batch slopes": torch.rand(batch, heads, device=q.device) * 0.3 + 0.02,
                 "negative slopes": -(torch.rand(heads, device=q.device) * 0.05 + 0.01),
                 "sinks": torch.randn(heads, device=q.device)}
    options = {key: stand_ins.get(value, value) if isinstance(value, str) else value for key, value in options.items()}
    causal = options.get("causal", False)
    attention_options = dict(window_left=options.get("window_size", (-1, -1))[0],
                             window_right=options.get("window_size", (-1, -1))[1],
                             softcap=options.get("softcap", 0.0), dropout_p=options.get("dropout_p", 0.0),
                             alibi_slopes=options.get("alibi_slopes"), sinks=options.get("s_aux"))
    monkeypatch.setenv("FLASH_ATTENTION_GLUON", "1")
    assert _routed_to_gluon(fa, q, k, v, causal=causal, **attention_options)
    ours, lse, keep = _forward(fa, monkeypatch, "1", q, k, v, options)
    again = _forward(fa, monkeypatch, "1", q, k, v, options)
    assert torch.equal(ours, again[0]) and torch.equal(lse, again[1])
    tl_out, tl_lse, tl_keep = _forward(fa, monkeypatch, "0", q, k, v, options)
    reference = dict(window=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
                     alibi_slopes=options.get("alibi_slopes"), sinks=options.get("s_aux"))
    if keep is not None:
        assert torch.equal(keep, tl_keep)
        reference.update(keep=keep, dropout_p=options["dropout_p"])
    scale = 1.0 / math.sqrt(q.shape[-1])
    truth, truth_lse = attention_ref(q, k, v, causal, scale, torch.float64, **reference)
    same_dtype, _ = attention_ref(q, k, v, causal, scale, dtype, **reference)
    assert_within_bar("out", ours, same_dtype, truth, FWD_FACTOR)
    assert_within_bar("out (tl kernel)", tl_out, same_dtype, truth, FWD_FACTOR)
    # lse: +inf where a row sees no key (the reference's -inf), else fp32-close to the truth
    no_key = torch.isneginf(truth_lse)
    assert torch.equal(torch.isposinf(lse), no_key) and torch.equal(torch.isposinf(tl_lse), no_key)
    torch.testing.assert_close(lse[~no_key].double(), truth_lse[~no_key], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, tl_lse, rtol=1e-5, atol=1e-5)
