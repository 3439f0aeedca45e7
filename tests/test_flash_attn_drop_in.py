"""The package serving as ``flash_attn`` (compat/): flash-attn 2.8.3's module layout, its private
entry points' exact contracts, and the ring use of them (the backward on the merged output and
logsumexp of all key blocks) in one process. tests/test_context_parallel.py runs the engines
themselves on two processes."""

import inspect
import sys

import pytest
import torch

from inputs import cu_seqlens, paged_caches, random_qkv
from reference import assert_within_bar, run_ref, run_varlen_ref
from sizes import BF16, DEVICE

# flash-attn 2.8.3's private entry points (flash_attn/flash_attn_interface.py at tag v2.8.3): each
# parameter and its default (inspect.Parameter.empty: none); the engines read these with inspect
EMPTY = inspect.Parameter.empty
SIGNATURES = {
    "_flash_attn_forward": [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("dropout_p", EMPTY), ("softmax_scale", EMPTY), ("causal", EMPTY),
        ("window_size_left", EMPTY), ("window_size_right", EMPTY), ("softcap", EMPTY), ("alibi_slopes", EMPTY),
        ("return_softmax", EMPTY)],
    "_flash_attn_varlen_forward": [
        ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("cu_seqlens_q", EMPTY), ("cu_seqlens_k", EMPTY),
        ("max_seqlen_q", EMPTY), ("max_seqlen_k", EMPTY), ("dropout_p", EMPTY), ("softmax_scale", EMPTY),
        ("causal", EMPTY), ("window_size_left", -1), ("window_size_right", -1), ("softcap", 0.0),
        ("alibi_slopes", None), ("return_softmax", False), ("block_table", None), ("leftpad_k", None),
        ("seqused_k", None), ("zero_tensors", False)],
    "_flash_attn_backward": [
        ("dout", EMPTY), ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("out", EMPTY), ("softmax_lse", EMPTY),
        ("dq", EMPTY), ("dk", EMPTY), ("dv", EMPTY), ("dropout_p", EMPTY), ("softmax_scale", EMPTY),
        ("causal", EMPTY), ("window_size_left", EMPTY), ("window_size_right", EMPTY), ("softcap", EMPTY),
        ("alibi_slopes", EMPTY), ("deterministic", EMPTY), ("rng_state", None)],
    "_flash_attn_varlen_backward": [
        ("dout", EMPTY), ("q", EMPTY), ("k", EMPTY), ("v", EMPTY), ("out", EMPTY), ("softmax_lse", EMPTY),
        ("dq", EMPTY), ("dk", EMPTY), ("dv", EMPTY), ("cu_seqlens_q", EMPTY), ("cu_seqlens_k", EMPTY),
        ("max_seqlen_q", EMPTY), ("max_seqlen_k", EMPTY), ("dropout_p", EMPTY), ("softmax_scale", EMPTY),
        ("causal", EMPTY), ("window_size_left", EMPTY), ("window_size_right", EMPTY), ("softcap", EMPTY),
        ("alibi_slopes", EMPTY), ("deterministic", EMPTY), ("rng_state", None), ("zero_tensors", False)],
}
PUBLIC = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
          "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


@pytest.fixture
def flash_attn(fa):
    """This package installed as flash_attn for the test, and any earlier flash_attn put back."""
    saved = {name: module for name, module in sys.modules.items()
             if name == "flash_attn" or name.startswith("flash_attn.")}
    for name in saved:
        del sys.modules[name]
    module = fa.install_as_flash_attn()
    yield module
    fa.uninstall_flash_attn()
    sys.modules.update(saved)


def test_module_layout(fa, flash_attn):
    """flash-attn 2.8.3's import paths give this package's objects; a second install is the same."""
    import flash_attn as imported
    from flash_attn import flash_attn_interface
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input  # noqa: F401
    from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
    from flash_attn.modules.mha import MHA
    from flash_attn.ops.triton.rotary import apply_rotary

    assert imported is flash_attn and fa.install_as_flash_attn() is flash_attn
    assert flash_attn.__version__ == "2.8.3"
    for name in PUBLIC:
        assert getattr(flash_attn, name) is getattr(fa, name) is getattr(flash_attn_interface, name)
    for name in SIGNATURES:
        assert getattr(flash_attn_interface, "_wrapped" + name) is getattr(flash_attn_interface, name)
    assert (apply_rotary_emb, RotaryEmbedding, MHA) == (fa.apply_rotary_emb, fa.RotaryEmbedding, fa.MHA)
    assert apply_rotary is fa.rotary.apply_rotary
    import importlib.util

    assert importlib.util.find_spec("flash_attn").name == "flash_attn"
    import importlib.metadata  # (version checks that read package metadata, as transformers' and diffusers' do)

    assert importlib.metadata.version("flash_attn") == importlib.metadata.version("flash-attn") == "2.8.3"
    assert importlib.metadata.packages_distributions()["flash_attn"] == ["flash_attn"]
    assert flash_attn.layers.rotary is sys.modules["flash_attn.layers.rotary"]
    # the same module on the loaded kernel, where diffusers' FLASH_HUB backend looks the entry points up
    for name in fa.flash_attn_interface.__all__:
        assert getattr(fa.flash_attn_interface, name) is getattr(flash_attn_interface, name)
    assert fa.flash_attn_interface._wrapped_flash_attn_backward is flash_attn_interface._flash_attn_backward
    from flash_attn.layers.rotary import apply_rotary_emb_func  # (an older name Qwen-style code imports)

    assert apply_rotary_emb_func is fa.apply_rotary_emb


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_private_signatures_are_flash_attn_2_8_3s(flash_attn, name):
    """Names, order and defaults as ring-flash-attn's get_default_args reads them."""
    function = getattr(flash_attn.flash_attn_interface, name)
    assert inspect.isfunction(function)
    spec = inspect.getfullargspec(function)
    defaults = dict(zip(spec.args[len(spec.args) - len(spec.defaults or ()):], spec.defaults or ()))
    assert [(arg, defaults.get(arg, EMPTY)) for arg in spec.args] == SIGNATURES[name]


@pytest.mark.parametrize("module", ["flash_attn.ops.layer_norm", "flash_attn.ops.fused_dense", "flash_attn.ops.rms_norm",
                                    "flash_attn.losses.cross_entropy", "flash_attn.models.gpt"])
def test_missing_parts_raise_a_clear_not_implemented_error(flash_attn, module):
    """Importing a module flash-attn has and this package does not succeeds; its names raise an
    error that is a NotImplementedError naming the module and what it held, and an ImportError,
    so that try/except ImportError fallbacks still work."""
    imported = __import__(module, fromlist=["_"])
    with pytest.raises(NotImplementedError, match=module.replace(".", r"\.") + r"\.Thing is not provided"):
        imported.Thing
    with pytest.raises(ImportError):
        exec(f"from {module} import Thing")
    assert not hasattr(imported, "__wrapped__")  # (dunders stay plain AttributeErrors)


def test_install_refuses_a_real_flash_attn_and_uninstall_removes_only_its_own(fa, flash_attn):
    fa.uninstall_flash_attn()
    assert not any(name == "flash_attn" or name.startswith("flash_attn.") for name in sys.modules)
    import importlib.metadata

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("flash_attn")
    foreign = type(sys)("flash_attn")
    sys.modules["flash_attn"] = foreign
    try:
        with pytest.raises(RuntimeError, match="already imported"):
            fa.install_as_flash_attn()
        assert fa.install_as_flash_attn(replace=True) is not foreign
    finally:
        fa.uninstall_flash_attn()
        sys.modules.pop("flash_attn", None)
    fa.install_as_flash_attn()


def _private(flash_attn):
    return flash_attn.flash_attn_interface


def test_forward_and_backward_contract(fa, flash_attn):
    """The forward's (out, lse, S_dmask, rng_state) are flash_attn_func's results and layouts; the
    backward writes flash_attn_func's gradients into the caller's buffers, bitwise, including
    strided views, and returns softmax_d = rowsum(dout * out) padded as flash-attn's."""
    interface = _private(flash_attn)
    q, k, v = random_qkv((2, 75, 4, 40), (2, 75, 2, 40), dtype=BF16, requires_grad=True)
    scale = 0.3
    out, lse, s_dmask, rng_state = interface._flash_attn_forward(q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False)
    ref_out, ref_lse, _ = fa.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and not out.requires_grad
    assert lse.shape == (2, 4, 75) and lse.dtype == torch.float32
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    dq = torch.full_like(q, float("nan"))
    dkv = torch.full((2, 75, 2, 2, 40), float("nan"), dtype=BF16, device=q.device)  # dk, dv: strided views
    softmax_d = interface._flash_attn_backward(dout, q, k, v, out, lse, dq, dkv[:, :, 0], dkv[:, :, 1], 0.0, scale,
                                               True, -1, -1, 0.0, None, False)
    for ours, theirs in zip((dq, dkv[:, :, 0], dkv[:, :, 1]), grads):
        assert torch.equal(ours, theirs)
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == torch.float32
    expected = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(softmax_d[:, :, :75], expected)
    assert not softmax_d[:, :, 75:].any()
    # None drops a gradient, as in flash-attn
    dk = torch.empty_like(k)
    interface._flash_attn_backward(dout, q, k, v, out, lse, None, dk, None, 0.0, scale, True, -1, -1, 0.0, None, False)
    assert torch.equal(dk, grads[1])


@pytest.mark.parametrize("options", [dict(window_size=(9, 3)), dict(softcap=4.0, causal=True),
                                     dict(alibi_slopes=True, causal=True)], ids=["window", "softcap", "alibi"])
def test_options_reach_the_kernels(fa, flash_attn, options):
    """window_size_left/right, softcap and alibi_slopes mean what flash_attn_func's options mean:
    same outputs and gradients, bitwise."""
    interface = _private(flash_attn)
    q, k, v = random_qkv((1, 50, 4, 32), (1, 61, 2, 32), dtype=BF16, requires_grad=True)
    options = dict(options)
    if options.get("alibi_slopes"):
        options["alibi_slopes"] = torch.rand(4, device=q.device, dtype=torch.float32)
    left, right = options.get("window_size", (-1, -1))
    causal, softcap, slopes = options.get("causal", False), options.get("softcap", 0.0), options.get("alibi_slopes")
    out, lse, _, _ = interface._flash_attn_forward(q, k, v, 0.0, 0.2, causal, left, right, softcap, slopes, False)
    ref_out, ref_lse, _ = fa.flash_attn_func(q, k, v, softmax_scale=0.2, return_attn_probs=True, **options)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    buffers = [torch.empty_like(x) for x in (q, k, v)]
    interface._flash_attn_backward(dout, q, k, v, out, lse, *buffers, 0.0, 0.2, causal, left, right, softcap, slopes,
                                   False)
    for ours, theirs in zip(buffers, grads):
        assert torch.equal(ours, theirs)


def test_varlen_contract(fa, flash_attn):
    interface = _private(flash_attn)
    lengths_q, lengths_k = [17, 1, 40], [30, 5, 40]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q, k, v = random_qkv((58, 4, 32), (75, 2, 32), dtype=BF16, requires_grad=True)
    out, lse, _, _ = interface._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 40, 40, 0.0, 0.25, True)
    ref_out, ref_lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, softmax_scale=0.25, causal=True,
                                                    return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and lse.shape == (4, 58)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    buffers = [torch.empty_like(x) for x in (q, k, v)]
    softmax_d = interface._flash_attn_varlen_backward(dout, q, k, v, out, lse, *buffers, cu_q, cu_k, 40, 40, 0.0, 0.25,
                                                      True, -1, -1, 0.0, None, False)
    for ours, theirs in zip(buffers, grads):
        assert torch.equal(ours, theirs)
    assert softmax_d.shape == (4, 58 + 128 * 3)
    rows = (dout.float() * out.float()).sum(-1).t()
    for b, (start, end) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):  # sequence b from cu_q[b] + 128 b
        torch.testing.assert_close(softmax_d[:, start + 128 * b:end + 128 * b], rows[:, start:end])


def test_varlen_paged_and_dropout_probabilities(fa, flash_attn):
    """The varlen forward with flash-attn's block_table (a paged k/v) gives flash_attn_varlen_func's
    paged results, and with dropout and return_softmax its S_dmask."""
    interface = _private(flash_attn)
    lengths_q, lengths_k = [5, 17], [40, 21]
    cu_q, cu_k = cu_seqlens(lengths_q), cu_seqlens(lengths_k)
    q, k, v = random_qkv((22, 4, 32), (61, 2, 32), dtype=BF16)
    k_cache, v_cache, table = paged_caches(k, v, lengths_k, 16)
    out, lse, _, _ = interface._flash_attn_varlen_forward(q, k_cache, v_cache, cu_q, cu_k, 17, 40, 0.0, 0.2, True,
                                                          block_table=table)
    ref_out, ref_lse, _ = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 17, 40, softmax_scale=0.2,
                                                    causal=True, block_table=table, return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    torch.manual_seed(3)
    out, lse, s_dmask, rng_state = interface._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 17, 40, 0.25, 0.2, True,
                                                                        return_softmax=True)
    torch.manual_seed(3)
    ref_out, _, ref_probs = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, 0.25, 0.2, True,
                                                      return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(s_dmask, ref_probs) and rng_state.shape == (2,)


def test_dropout_needs_the_forwards_rng_state(fa, flash_attn):
    """With dropout the backward regenerates the forward's mask from its rng_state (the gradients
    are flash_attn_func's for the same draw); without rng_state it refuses."""
    interface = _private(flash_attn)
    q, k, v = random_qkv((1, 40, 2, 32), (1, 40, 2, 32), dtype=BF16, requires_grad=True)
    torch.manual_seed(5)
    out, lse, s_dmask, rng_state = interface._flash_attn_forward(q, k, v, 0.2, 0.2, False, -1, -1, 0.0, None, True)
    torch.manual_seed(5)
    ref_out, _, ref_probs = fa.flash_attn_func(q, k, v, 0.2, 0.2, return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(s_dmask, ref_probs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    buffers = [torch.empty_like(x) for x in (q, k, v)]
    interface._flash_attn_backward(dout, q, k, v, out, lse, *buffers, 0.2, 0.2, False, -1, -1, 0.0, None, False,
                                   rng_state)
    for ours, theirs in zip(buffers, grads):
        assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="rng_state"):
        interface._flash_attn_backward(dout, q, k, v, out, lse, *buffers, 0.2, 0.2, False, -1, -1, 0.0, None, False)
    # the backward draws nothing from the generator, and its softmax_d is flash-attn's: rowsum(dout * out)
    # times the keep probability
    before = _generator_state(q.device)
    softmax_d = interface._flash_attn_backward(dout, q, k, v, out, lse, *buffers, 0.2, 0.2, False, -1, -1, 0.0, None,
                                               False, rng_state)
    assert torch.equal(_generator_state(q.device), before)
    expected = (dout.float() * out.float()).sum(-1).transpose(1, 2) * 0.8
    torch.testing.assert_close(softmax_d[:, :, :40], expected)


def _generator_state(device):
    return torch.cuda.get_rng_state(device) if torch.device(device).type == "cuda" else torch.get_rng_state()


def test_lse_in_diffusers_layout(fa, flash_attn):
    """diffusers hands the backward lse.permute(0, 2, 1), as a view or made contiguous: both give the
    gradients of flash-attn's (batch, heads, seqlen) layout, including with heads == seqlen."""
    interface = _private(flash_attn)
    for seqlen, heads in ((24, 4), (4, 4)):
        q, k, v = random_qkv((1, seqlen, heads, 32), (1, seqlen, heads, 32), dtype=BF16)
        out, lse, _, _ = interface._flash_attn_forward(q, k, v, 0.0, 0.2, True, -1, -1, 0.0, None, False)
        dout = torch.randn_like(out)
        results = []
        for given in (lse, lse.permute(0, 2, 1), lse.permute(0, 2, 1).contiguous()):
            buffers = [torch.empty_like(x) for x in (q, k, v)]
            interface._flash_attn_backward(dout, q, k, v, out, given, *buffers, 0.0, 0.2, True, -1, -1, 0.0, None,
                                           False)
            results.append(buffers)
        for other in results[1:] if seqlen != heads else results[1:2]:  # (a contiguous square one is flash-attn's)
            for ours, theirs in zip(other, results[0]):
                assert torch.equal(ours, theirs)


def test_zero_tensors_zeroes_rows_past_the_sequences(flash_attn):
    interface = _private(flash_attn)
    cu = cu_seqlens([10, 7])
    q, k, v = random_qkv((20, 2, 32), (17, 2, 32), dtype=BF16)  # (3 rows of q past the sequences)
    out, lse, _, _ = interface._flash_attn_varlen_forward(q, k, v, cu, cu, 10, 10, 0.0, 0.2, False, zero_tensors=True)
    assert not out[17:].any() and torch.isneginf(lse[:, 17:]).all()
    dq = torch.full_like(q, float("nan"))
    interface._flash_attn_varlen_backward(torch.randn_like(out), q, k, v, out, lse, dq, None, None, cu, cu, 10, 10, 0.0,
                                          0.2, False, -1, -1, 0.0, None, False, zero_tensors=True)
    assert not dq[17:].any() and not dq[:17].isnan().any()


def test_bad_arguments_name_what_is_wrong(flash_attn):
    interface = _private(flash_attn)
    q, k, v = random_qkv((1, 16, 2, 32), (1, 16, 2, 32), dtype=BF16)
    out, lse, _, _ = interface._flash_attn_forward(q, k, v, 0.0, 0.2, False, -1, -1, 0.0, None, False)
    args = (0.0, 0.2, False, -1, -1, 0.0, None, False)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        interface._flash_attn_forward(q.float(), k.float(), v.float(), *args[:-1], False)
    with pytest.raises(ValueError, match="dq must be None or a tensor shaped"):
        interface._flash_attn_backward(out, q, k, v, out, lse, q[:, :8], None, None, *args)
    with pytest.raises(ValueError, match=r"softmax_lse must be a float32 tensor of shape \(1, 2, 16\)"):
        interface._flash_attn_backward(out, q, k, v, out, lse[:, :, :8], None, None, None, *args)
    with pytest.raises(ValueError, match="dout must be a tensor shaped"):
        interface._flash_attn_backward(out[:, :8], q, k, v, out, lse, None, None, None, *args)
    cu = cu_seqlens([16])
    with pytest.raises(NotImplementedError, match="seqused_k"):
        interface._flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 16, 16, 0.0, 0.2, False,
                                             seqused_k=torch.tensor([16], dtype=torch.int32, device=q.device))


def _merge(out, lse, block_out, block_lse):
    """Ring merge of two partial attentions (ring-flash-attn's update_out_and_lse): out fp32
    (..., seqlen, heads, d), lse (..., heads, seqlen)."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    weight = lambda x: torch.exp(x - new_lse).transpose(-1, -2).unsqueeze(-1)  # noqa: E731
    return out * weight(lse) + block_out.float() * weight(block_lse), new_lse


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_backward_on_the_merged_output(fa, flash_attn, causal):
    """A ring of 3 ranks in one process, as ring-flash-attn runs it: rank r holds query block r and
    key block r; at step s it attends to key block r - s (causal: only s <= r, the diagonal one
    causal) and merges; the backward gets the merged out and lse at every step, and the blocks'
    gradients add up. Output and gradients within the error bars of the whole attention."""
    interface = _private(flash_attn)
    ranks, block = 3, 24
    q, k, v = random_qkv((1, ranks * block, 4, 32), (1, ranks * block, 2, 32), dtype=BF16)
    scale = 32 ** -0.5
    blocks = lambda x: x.split(block, dim=1)  # noqa: E731
    qs, ks, vs = blocks(q), blocks(k), blocks(v)
    steps = lambda r: [(r - s) % ranks for s in range(ranks) if not causal or s <= r]  # noqa: E731  (rank r's key blocks)
    outs, lses = [], []
    for r in range(ranks):
        out = lse = None
        for j in steps(r):
            block_out, block_lse, _, _ = interface._flash_attn_forward(qs[r], ks[j], vs[j], 0.0, scale,
                                                                       causal and j == r, -1, -1, 0.0, None, False)
            out, lse = _merge(out, lse, block_out, block_lse)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    ring_out = torch.cat(outs, dim=1)
    dout = torch.randn_like(ring_out)
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    for r in range(ranks):
        douts = blocks(dout)
        for j in steps(r):
            bq, bk, bv = (torch.empty_like(x) for x in (qs[r], ks[j], vs[j]))
            interface._flash_attn_backward(douts[r], qs[r], ks[j], vs[j], outs[r], lses[r], bq, bk, bv, 0.0, scale,
                                           causal and j == r, -1, -1, 0.0, None, False)
            dq[:, r * block:(r + 1) * block] += bq.float()
            dk[:, j * block:(j + 1) * block] += bk.float()
            dv[:, j * block:(j + 1) * block] += bv.float()
    truth, truth_grads = run_ref(q, k, v, dout, causal, scale, torch.float64)
    same, same_grads = run_ref(q, k, v, dout, causal, scale, q.dtype)
    assert_within_bar("out", ring_out, same, truth, 2)
    for name, ours, pytorch, exact in zip(("dq", "dk", "dv"), (dq, dk, dv), same_grads, truth_grads):
        assert_within_bar(name, ours.to(q.dtype), pytorch, exact, 3)


def test_varlen_blocks_backward_on_the_merged_output(fa, flash_attn):
    """The varlen pair the same way: every sequence's keys split in two blocks (lengths 30/11,
    1/1 and 20/20), attended separately, merged, and the backward of each block taking the merged
    out and lse."""
    interface = _private(flash_attn)
    lengths_q, first, second = [23, 5, 40], [30, 1, 20], [11, 1, 20]
    cu_q, cu_first, cu_second = cu_seqlens(lengths_q), cu_seqlens(first), cu_seqlens(second)
    q, _, _ = random_qkv((68, 4, 32), (1, 2, 32), dtype=BF16)
    _, k1, v1 = random_qkv((1, 4, 32), (sum(first), 2, 32), dtype=BF16)
    _, k2, v2 = random_qkv((1, 4, 32), (sum(second), 2, 32), dtype=BF16)
    scale = 0.2
    out = lse = None
    for k, v, cu_k in ((k1, v1, cu_first), (k2, v2, cu_second)):
        block_out, block_lse, _, _ = interface._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 40, 30, 0.0, scale,
                                                                          False)
        out, lse = _merge(out, lse, block_out, block_lse)
    out = out.to(q.dtype)
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q, dtype=torch.float32)
    grads_kv = []
    for k, v, cu_k in ((k1, v1, cu_first), (k2, v2, cu_second)):
        bq, bk, bv = (torch.empty_like(x) for x in (q, k, v))
        interface._flash_attn_varlen_backward(dout, q, k, v, out, lse, bq, bk, bv, cu_q, cu_k, 40, 30, 0.0, scale,
                                              False, -1, -1, 0.0, None, False)
        dq += bq.float()
        grads_kv.append((bk, bv))
    # the whole keys of each sequence, in order: its first block's, then its second block's
    pieces = lambda a, b, cu_a, cu_b: torch.cat([torch.cat([a[s:e], b[s2:e2]]) for s, e, s2, e2 in zip(  # noqa: E731
        cu_a.tolist(), cu_a.tolist()[1:], cu_b.tolist(), cu_b.tolist()[1:])])
    k, v = pieces(k1, k2, cu_first, cu_second), pieces(v1, v2, cu_first, cu_second)
    cu_k = cu_seqlens([a + b for a, b in zip(first, second)])
    truth, truth_grads, _ = run_varlen_ref(q, k, v, dout, cu_q, cu_k, False, scale, torch.float64)
    same, same_grads, _ = run_varlen_ref(q, k, v, dout, cu_q, cu_k, False, scale, q.dtype)
    assert_within_bar("out", out, same, truth, 2)
    assert_within_bar("dq", dq.to(q.dtype), same_grads[0], truth_grads[0], 3)
    dk = pieces(grads_kv[0][0], grads_kv[1][0], cu_first, cu_second)
    dv = pieces(grads_kv[0][1], grads_kv[1][1], cu_first, cu_second)
    assert_within_bar("dk", dk, same_grads[1], truth_grads[1], 3)
    assert_within_bar("dv", dv, same_grads[2], truth_grads[2], 3)


def test_bert_padding_and_rotary_helpers(fa, flash_attn):
    """flash-attn's other bert_padding helpers and rotary references, as it defines them."""
    from flash_attn.bert_padding import (index_first_axis, index_first_axis_residual, index_put_first_axis,
                                         unpad_input_for_concatenated_sequences)
    from flash_attn.layers.rotary import apply_rotary_emb, apply_rotary_emb_torch, rotate_half
    from flash_attn.ops.triton.rotary import apply_rotary

    x = torch.randn(2, 6, 3, 8)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 11] and max_seqlen == 6 and indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert torch.equal(packed, index_first_axis(x.flatten(0, 1), indices))
    back = index_put_first_axis(packed, indices, 12)
    assert torch.equal(back[indices], packed) and not back[5].any()
    leaf = x.flatten(0, 1).clone().requires_grad_()
    gathered, residual = index_first_axis_residual(leaf, indices)
    assert torch.equal(gathered, packed) and torch.equal(residual, leaf)
    (gathered.sum() + 2 * residual.sum()).backward()  # (both outputs' gradients reach x, as flash-attn's)
    expected = torch.full_like(leaf, 2.0)
    expected[indices] += 1
    assert torch.equal(leaf.grad, expected)
    assert torch.equal(rotate_half(torch.arange(4.0)), torch.tensor([-2.0, -3.0, 0.0, 1.0]))
    assert torch.equal(rotate_half(torch.arange(4.0), interleaved=True), torch.tensor([-1.0, 0.0, -3.0, 2.0]))
    q = torch.randn(1, 9, 2, 16, dtype=torch.float32, device=DEVICE)
    angles = torch.randn(9, 6, device=q.device)
    cos, sin = angles.cos(), angles.sin()
    for interleaved in (False, True):
        expected = apply_rotary_emb_torch(q, cos, sin, interleaved)
        torch.testing.assert_close(apply_rotary_emb(q, cos, sin, interleaved), expected)
        torch.testing.assert_close(apply_rotary(q, cos, sin, interleaved=interleaved), expected)
        back = apply_rotary(expected, cos, sin, interleaved=interleaved, conjugate=True)
        torch.testing.assert_close(back, q, atol=1e-5, rtol=1e-5)


def test_private_entry_points_compile_fullgraph(fa, flash_attn):
    """A ring step as an engine writes it (forward, then backward into its buffers) compiles with
    fullgraph=True and gives the eager results (the kernels' bitwise)."""
    interface = _private(flash_attn)
    q, k, v = random_qkv((1, 40, 4, 32), (1, 40, 2, 32), dtype=BF16)
    dout = torch.randn_like(q)

    def step(q, k, v, dout, dq, dk, dv):
        out, lse, _, _ = interface._wrapped_flash_attn_forward(q, k, v, 0.0, 0.2, True, -1, -1, 0.0, None, False)
        softmax_d = interface._wrapped_flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.2, True, -1,
                                                           -1, 0.0, None, False)
        return out, lse, softmax_d

    eager_grads = [torch.empty_like(x) for x in (q, k, v)]
    compiled_grads = [torch.empty_like(x) for x in (q, k, v)]
    eager = step(q, k, v, dout, *eager_grads)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, k, v, dout, *compiled_grads)
    for ours, theirs in zip((*compiled[:2], *compiled_grads), (*eager[:2], *eager_grads)):
        assert torch.equal(ours, theirs)
    torch.testing.assert_close(compiled[2], eager[2])  # (softmax_d: a torch reduction, fused in its own order)


def test_run_with_flash_attn_runs_an_unchanged_script(build_dir, tmp_path):
    """scripts/run_with_flash_attn.py: a script that imports flash_attn by name runs on this package,
    with its own arguments and folder on sys.path; transformers, imported after the install, finds
    flash_attn 2.8.3 through package metadata."""
    import subprocess

    from conftest import REPO_ROOT

    (tmp_path / "helper_module.py").write_text("VALUE = 7\n")
    script = tmp_path / "uses_flash_attn.py"
    script.write_text("import sys\nimport flash_attn, helper_module\n"
                      "from flash_attn.flash_attn_interface import _flash_attn_forward\n"
                      "from transformers.utils import import_utils\n"  # (its check reads package metadata)
                      "print(import_utils._is_package_available('flash_attn', return_version=True),\n"
                      "      import_utils.PACKAGE_DISTRIBUTION_MAPPING['flash_attn'])\n"
                      "print(flash_attn.__version__, helper_module.VALUE, sys.argv[1:], __name__)\n")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "run_with_flash_attn.py"), "--build",
                             str(build_dir), str(script), "--an-argument", "x"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-2:] == ["(True, '2.8.3') ['flash_attn']",
                                                       "2.8.3 7 ['--an-argument', 'x'] __main__"]


def _call_from(module_name: str, function, group, **arguments):
    """``function(**arguments)`` called as ring-flash-attn's zigzag scheme calls the forward: from
    a per-block helper inside the engine's function, which holds the ``process_group`` it runs
    over, both in a module named ``module_name``."""
    namespace = {"__name__": module_name, "forward": function}
    exec("def engine(process_group, arguments):\n"
         "    def block(arguments):\n"
         "        return forward(**arguments)\n"
         "    return block(arguments)\n", namespace)
    return namespace["engine"](group, arguments)


@pytest.mark.parametrize("option", ["window", "alibi"])
def test_positions_across_ring_blocks_are_refused(fa, flash_attn, monkeypatch, option):
    """A window or ALiBi inside a ring's block loop over more than one rank raises a ValueError
    naming the option (each block call sees block-local positions); over one rank, outside a ring
    engine, and in ring-flash-attn's llama3 scheme (which gathers each query block's keys) it runs."""
    from flash_attn.flash_attn_interface import _flash_attn_forward

    q, k, v = random_qkv((1, 17, 2, 32), (1, 17, 2, 32), BF16)
    arguments = dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=None, causal=True, window_size_left=-1,
                     window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
    if option == "window":
        arguments.update(window_size_left=4, window_size_right=0)
    else:
        arguments.update(alibi_slopes=torch.rand(2, device=DEVICE, dtype=torch.float32))
    single = _flash_attn_forward(**arguments)[0]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    group = object()  # (the engine's process group: only its size counts, not the default group's)
    for ranks, module, refused in ((2, "ring_flash_attn.zigzag_ring_flash_attn", True),
                                   (2, "yunchang.ring.ring_flash_attn", True),
                                   (1, "ring_flash_attn.ring_flash_attn", False),
                                   (2, "ring_flash_attn.llama3_flash_attn_varlen", False),
                                   (2, "my_training_loop", False)):
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda g=None, ranks=ranks: ranks if g is group else 8)
        if refused:
            with pytest.raises(ValueError, match="alibi_slopes" if option == "alibi" else r"window_size \(4, 0\)"):
                _call_from(module, _flash_attn_forward, group, **arguments)
        else:
            assert torch.equal(_call_from(module, _flash_attn_forward, group, **arguments)[0], single), module
