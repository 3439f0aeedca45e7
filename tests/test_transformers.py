"""transformers' hub attention through this kernel (attn_implementation="kernels-triton/flash-attention").

Tiny random models of each family whose attention differs (tiny_models.py: Llama GQA, Mistral sliding
window, Gemma 2 softcap + window + query_pre_attn_scalar, gpt-oss sinks + alternating window,
ModernBERT bidirectional local attention, Bart cross-attention) run with this kernel and with
attn_implementation="eager" on the same weights: last hidden states and logits of a right-padded, a
left-padded and a packed batch (several sequences in one row: transformers' varlen path, against
eager on each sequence alone), parameter gradients, greedy generate() (dynamic and static cache) and
continuous batching. A spy on the functions transformers loaded records every call: they are this
build's, and the keywords transformers passes (window_size, softcap, s_aux, deterministic, dropout_p,
max_seqlen as a 0-d tensor, int32 cu_seqlens) arrive with the values the model means.

The kernel is loaded the way a user loads it offline: LOCAL_KERNELS maps the repo id to the build
(conftest's build_dir) and HF_HUB_OFFLINE=1. CPU (interpreter): fp32, tolerance 1e-4. GPU: bf16 with
transformers' own tolerance (atol = rtol = 4e-2), or, where eager's own bf16 rounding exceeds it, no
more than twice eager's distance to an fp32 run of the same weights; generation is compared in fp32
on both (greedy tokens must be exact).

Also here: the routes to this kernel for gpt-oss (transformers rewrites any "flash" id for a model
that lists _compatible_flash_implementations), what the kernel refuses, and transformers behaviours
that no kernel can fix, as strict xfails (they fail once transformers changes).
"""

import contextlib
import copy
import dataclasses
import functools
import inspect
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import huggingface_hub.constants  # noqa: E402
import kernels  # noqa: E402
import transformers.modeling_flash_attention_utils as mfau  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

from sizes import DEVICE, ON_GPU  # noqa: E402
from tiny_models import DTYPE, FAMILIES, PAD, SIZES, ablated_config, build  # noqa: E402

REPO = "kernels-triton/flash-attention"
ALIAS = "kernels-triton/triton-attention"  # the same build under an id without "flash" in it


def tolerance(dtype):
    """fp32: 1e-4 (the kernel multiplies in full fp32); bf16: transformers' own 4e-2."""
    return 1e-4 if dtype == torch.float32 else 4e-2


# Generation compares greedy tokens, a discontinuous function of the logits: always in fp32 (the kernel
# runs fp32 in full precision on GPUs too), where eager's tokens are exact to expect.
GENERATE_DTYPE = torch.float32


@pytest.fixture(scope="session")
def kernel(build_dir):
    """Offline loading as a user does it: LOCAL_KERNELS + HF_HUB_OFFLINE (restored afterwards).
    Returns the kernel module transformers will use."""
    if not transformers.utils.import_utils.is_kernels_available():
        pytest.skip(f"transformers {transformers.__version__} does not accept kernels {kernels.__version__}")
    saved_env = {name: os.environ.get(name) for name in ("LOCAL_KERNELS", "HF_HUB_OFFLINE")}
    saved_offline = huggingface_hub.constants.HF_HUB_OFFLINE  # (read once, when huggingface_hub is imported)
    os.environ["LOCAL_KERNELS"] = f"{REPO}={build_dir}:{ALIAS}={build_dir}"
    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield kernels.get_kernel(REPO, version=1)
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE = saved_offline
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- the spy ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Call:
    function: str  # "flash_attn_func" or "flash_attn_varlen_func"
    q_shape: tuple
    k_shape: tuple
    dtype: torch.dtype
    kwargs: dict


@contextlib.contextmanager
def kernel_calls(kernel):
    """Records the calls transformers makes to the attention functions it loaded, after checking that
    they are ``kernel``'s. The spies keep the functions' signatures (functools.wraps)."""
    assert mfau._flash_fn is kernel.flash_attn_func, "transformers did not load this kernel's flash_attn_func"
    assert mfau._flash_varlen_fn is kernel.flash_attn_varlen_func, "... nor its flash_attn_varlen_func"
    calls = []

    def spy(function):
        @functools.wraps(function)
        def wrapper(q, k, v, *args, **kwargs):
            assert not args, f"transformers passed positional options to {function.__name__}: {args}"
            calls.append(Call(function.__name__, tuple(q.shape), tuple(k.shape), q.dtype, dict(kwargs)))
            return function(q, k, v, **kwargs)

        return wrapper

    saved = mfau._flash_fn, mfau._flash_varlen_fn
    mfau._flash_fn, mfau._flash_varlen_fn = spy(saved[0]), spy(saved[1])
    try:
        yield calls
    finally:
        mfau._flash_fn, mfau._flash_varlen_fn = saved


def use_kernel(model, implementation=REPO):
    """Switch ``model`` to the kernel. gpt-oss rewrites any "flash" id it does not list in
    _compatible_flash_implementations, so ours is listed first (on the instance here; the class-level form
    a user writes before from_pretrained is test_gpt_oss_compatible_route)."""
    listed = type(model)._compatible_flash_implementations
    if listed is not None and implementation not in listed:
        model._compatible_flash_implementations = [implementation, *listed]
    model.set_attn_implementation(implementation)
    assert model.config._attn_implementation == implementation


@dataclasses.dataclass
class Runs:
    expected: object  # eager attention, in the model's dtype
    actual: object  # the kernel, in the model's dtype
    reference: object  # eager attention on an fp32 copy of the same weights (None for an fp32 model)
    calls: list  # the kernel's calls


def eager_and_kernel(model, kernel, run, implementation=REPO) -> Runs:
    """``run(model)`` in eager attention, through the kernel (its calls recorded), and for a bf16 model
    (GPU) also in eager attention on an fp32 copy."""
    model.set_attn_implementation("eager")
    fp32 = run(copy.deepcopy(model).float()) if model.dtype != torch.float32 else None
    expected = run(model)
    use_kernel(model, implementation)
    try:
        with kernel_calls(kernel) as calls:
            actual = run(model)
    finally:
        model.set_attn_implementation("eager")
    assert calls, "the kernel was never called"
    return Runs(expected, actual, fp32, calls)


def assert_close(actual, expected, what, record_property, reference=None, tol=None):
    """The kernel's ``actual`` against eager's ``expected`` within ``tolerance`` of their dtype. In bf16,
    where eager's own rounding error can exceed transformers' tolerance on large activations, an fp32
    ``reference`` decides instead: the kernel must be at most twice as far from it as eager in bf16."""
    dtype = expected.dtype
    tol = tolerance(dtype) if tol is None else tol
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape, f"{what}: shapes {tuple(actual.shape)} != {tuple(expected.shape)}"
    record_property(f"max_abs_diff[{what}]", float((actual - expected).abs().max()) if actual.numel() else 0.0)
    if reference is not None and not torch.allclose(actual, expected, atol=tol, rtol=tol):
        reference = reference.float()
        kernel_error, eager_error = float((actual - reference).abs().max()), float((expected - reference).abs().max())
        record_property(f"error_vs_fp32[{what}]", f"kernel {kernel_error:.3g}, eager {eager_error:.3g}")
        assert kernel_error <= 2 * eager_error, (f"{what}: the kernel is {kernel_error:.3g} from eager in fp32, "
                                                 f"eager in {dtype} {eager_error:.3g}")
        return
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# --- inputs ----------------------------------------------------------------------------------------


def random_ids(*shape, seed=2):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, SIZES.vocab, shape, generator=generator).to(DEVICE)


def padded_batch(side, seqlen=SIZES.seqlen, seed=2):
    """2 rows of ``seqlen`` tokens, the second with SIZES.pad padding tokens on ``side``."""
    ids = random_ids(2, seqlen, seed=seed)
    mask = torch.ones_like(ids)
    if side == "right":
        mask[1, seqlen - SIZES.pad:] = 0
    else:
        mask[1, :SIZES.pad] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def packed_batch():
    """One row holding the sequences SIZES.packed, position_ids restarting at 0 for each."""
    sequences = [random_ids(n, seed=10 + i) for i, n in enumerate(SIZES.packed)]
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in SIZES.packed])
    return sequences, torch.cat(sequences)[None], positions[None]


def outputs(out):
    """(last hidden state, logits) of a model output (the decoder's for an encoder-decoder model)."""
    hidden = out.decoder_hidden_states if getattr(out, "decoder_hidden_states", None) is not None else out.hidden_states
    return hidden[-1], out.logits


# --- what the calls must carry ----------------------------------------------------------------------


def check_calls(family, model, calls, path):
    """The keywords transformers passed, for one forward of ``family`` (``path`` "right", "left",
    "packed", "backward") or a whole generate() ("generate")."""
    signature = inspect.signature(mfau._flash_varlen_fn).parameters
    sinks = [m.sinks for m in model.modules() if hasattr(m, "sinks")]
    for call in calls:
        assert call.dtype == model.dtype
        assert set(call.kwargs) <= set(signature), f"unknown keywords {set(call.kwargs) - set(signature)}"
        for name in ("causal", "softmax_scale", "dropout_p", "deterministic"):
            assert name in call.kwargs, f"transformers did not pass {name}"
        assert call.kwargs["dropout_p"] == 0.0 and call.kwargs["deterministic"] is False
        for name, value in family.expected.items():
            assert call.kwargs[name] == pytest.approx(value), f"{name}: {call.kwargs[name]} != {value}"
        if family.kind == "decoder":
            assert call.kwargs["causal"] is True
        assert ("s_aux" in call.kwargs) == bool(sinks)
        if call.function == "flash_attn_varlen_func":
            for name in ("cu_seqlens_q", "cu_seqlens_k"):
                assert call.kwargs[name].dtype == torch.int32 and call.kwargs[name].device.type == torch.device(DEVICE).type
        window = call.kwargs.get("window_size")
        assert window is None or window == family.window, f"window_size {window}, expected {family.window}"
    windows = [call.kwargs.get("window_size") for call in calls]
    if family.window is not None:
        assert any(windows), "transformers never passed window_size"
    else:
        assert not any(windows)

    if path == "generate":
        return
    # One forward: one call per attention layer, in layer order.
    if family.kind == "seq2seq":
        encoder, decoder = model.config.encoder_layers, model.config.decoder_layers
        assert len(calls) == encoder + 2 * decoder
        assert all(c.kwargs["causal"] is False for c in calls[:encoder])
        assert [c.kwargs["causal"] for c in calls[encoder:]] == [True, False] * decoder  # self, cross
        for self_attention, cross in zip(calls[encoder::2], calls[encoder + 1::2]):
            assert self_attention.function == "flash_attn_varlen_func"  # the padded decoder batch
            assert cross.function == "flash_attn_func" and cross.q_shape[1] != cross.k_shape[1]  # (unpadded encoder)
        return
    layers = model.config.num_hidden_layers
    assert len(calls) == layers
    assert windows == [family.window if i in family.sliding_layers else None for i in range(layers)]
    for call, sink in zip(calls, sinks):
        assert torch.equal(call.kwargs["s_aux"], sink), "s_aux is not the layer's sinks"
    assert all(c.function == "flash_attn_varlen_func" for c in calls)  # padded or packed: varlen
    if path == "packed":
        lengths = torch.tensor([0, *SIZES.packed]).cumsum(0).tolist()
        for call in calls:
            assert call.kwargs["cu_seqlens_q"].tolist() == lengths == call.kwargs["cu_seqlens_k"].tolist()
            for name in ("max_seqlen_q", "max_seqlen_k"):
                value = call.kwargs[name]
                if family.kind == "decoder":  # from position_ids: a 0-d tensor
                    assert isinstance(value, torch.Tensor) and value.dim() == 0
                assert int(value) == max(SIZES.packed)
    else:  # from the padding mask: Python ints
        for call in calls:
            assert call.kwargs["max_seqlen_q"] == call.kwargs["max_seqlen_k"] == SIZES.seqlen


# --- every family, every path -----------------------------------------------------------------------

PATHS = [(name, path) for name in FAMILIES for path in ("right", "left", "packed", "backward", "generate")
         if not (path == "packed" and FAMILIES[name].kind == "seq2seq")
         and not (path == "generate" and FAMILIES[name].kind == "encoder")]


def _forward(model, family, ids, mask):
    with torch.no_grad():
        if family.kind == "seq2seq":  # an unpadded encoder batch, the padded batch in the decoder
            encoder_ids = random_ids(2, SIZES.seqlen, seed=3)
            out = model(input_ids=encoder_ids, decoder_input_ids=ids, decoder_attention_mask=mask,
                        output_hidden_states=True)
        else:
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return outputs(out)


@pytest.mark.parametrize("name, side", [(n, s) for n, p in PATHS for s in ("right", "left") if p == s])
def test_padded_batch(kernel, name, side, record_property):
    """Last hidden states and logits of a padded batch (transformers unpads it: the varlen function)."""
    family = FAMILIES[name]
    model = build(family)
    seqlen = SIZES.decoder_seqlen if family.kind == "seq2seq" else SIZES.seqlen
    ids, mask = padded_batch(side, seqlen)
    runs = eager_and_kernel(model, kernel, lambda m: _forward(m, family, ids, mask))
    valid = mask.bool()
    for i, what in enumerate(("last hidden state", "logits")):
        assert_close(runs.actual[i][valid], runs.expected[i][valid], f"{name} {side}-padded {what}", record_property,
                     runs.reference[i][valid] if runs.reference else None)
    check_calls(family, model, runs.calls, side)


@pytest.mark.parametrize("name", [n for n, p in PATHS if p == "packed"])
def test_packed_batch(kernel, name, record_property):
    """Sequences packed in one row without padding, against eager on each sequence alone. Decoders:
    position_ids restarting at 0 (DataCollatorWithFlattening's default), which transformers turns into
    cu_seqlens with max_seqlen a 0-d tensor. Encoders: ModernBERT does not hand position_ids to its
    attention, so a packed row is one sequence to every implementation unless the caller passes
    cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True))."""
    family = FAMILIES[name]
    model = build(family)
    sequences, ids, positions = packed_batch()
    if family.kind == "decoder":
        packing = {"position_ids": positions}
    else:
        cu_seqlens = torch.tensor([0, *SIZES.packed], device=DEVICE).cumsum(0, dtype=torch.int32)
        longest = max(SIZES.packed)
        packing = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest)

    def run(m):
        with torch.no_grad():
            if m.config._attn_implementation == "eager":  # each sequence alone
                alone = [outputs(m(input_ids=s[None], output_hidden_states=True)) for s in sequences]
                return [torch.cat([a[i] for a in alone], dim=1) for i in range(2)]
            return outputs(m(input_ids=ids, output_hidden_states=True, **packing))

    runs = eager_and_kernel(model, kernel, run)
    for i, what in enumerate(("last hidden state", "logits")):
        assert_close(runs.actual[i], runs.expected[i], f"{name} packed {what}", record_property,
                     runs.reference[i] if runs.reference else None)
    check_calls(family, model, runs.calls, "packed")


def _loss(model, family, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)
    if family.kind == "seq2seq":  # an unpadded encoder batch, the padded batch in the decoder
        return model(input_ids=random_ids(2, SIZES.seqlen, seed=3), decoder_input_ids=ids, decoder_attention_mask=mask,
                     labels=labels).loss
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _gradients(model, family, ids, mask):
    model.train()
    model.zero_grad(set_to_none=True)
    _loss(model, family, ids, mask).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", [n for n, p in PATHS if p == "backward"])
def test_backward(kernel, name, record_property):
    """Gradients of every parameter (training mode, a right-padded batch) against eager; in bf16 those of
    the attention layers."""
    family = FAMILIES[name]
    model = build(family)
    ids, mask = padded_batch("right", SIZES.decoder_seqlen if family.kind == "seq2seq" else SIZES.seqlen)
    runs = eager_and_kernel(model, kernel, lambda m: _gradients(m, family, ids, mask))
    expected, actual = runs.expected, runs.actual
    assert expected.keys() == actual.keys()
    attention = [n for n, _ in model.named_parameters() if any(a in n for a in ("attn", "attention", "Wqkv"))]
    assert attention and set(attention) <= expected.keys(), "attention parameters without gradients"
    # Each gradient relative to its largest entry, or to a hundredth of the model's largest entry for
    # gradients that are 0 but for rounding (k_proj's bias: softmax ignores a shift shared by all keys).
    floor = 1e-2 * max(float(g.abs().max()) for g in expected.values())
    worst = 0.0
    for parameter, e in expected.items():
        if model.dtype != torch.float32 and parameter not in attention:
            # bf16: the attention's parameters, whose gradients come straight from the kernel's backward;
            # others (a router's bias: sums of cancelling terms) can be all bf16 noise
            continue
        scale = max(float(e.abs().max()), floor)
        if runs.reference is not None and float(runs.reference[parameter].abs().max()) < 1e-3 * floor:
            # 0 but for rounding in fp32: in bf16 there is nothing but rounding to compare
            assert float(actual[parameter].abs().max()) <= floor, f"{name}: gradient of {parameter} is not ~0"
            continue
        reference = runs.reference[parameter] / scale if runs.reference else None
        assert_close(actual[parameter] / scale, e / scale, f"{name} gradient of {parameter} / its max",
                     lambda *_: None, reference)
        worst = max(worst, float((actual[parameter] - e).abs().max()) / scale)
    record_property(f"max_rel_diff[{name} gradients]", worst)
    check_calls(family, model, runs.calls, "backward")


def _generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=SIZES.new_tokens, do_sample=False,
                             pad_token_id=PAD, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("name", [n for n, p in PATHS if p == "generate"])
def test_generate(kernel, name, record_property):
    """Greedy generate() from a left-padded batch gives eager's tokens (Bart: a padded encoder batch)."""
    family = FAMILIES[name]
    model = build(family, dtype=GENERATE_DTYPE)
    ids, mask = padded_batch("left" if family.kind == "decoder" else "right")
    runs = eager_and_kernel(model, kernel, lambda m: _generate(m, ids, mask))
    assert_same_tokens(runs, f"{name} generate", record_property)
    check_calls(family, model, runs.calls, "generate")


def assert_same_tokens(runs, what, record_property):
    """The kernel generates eager's tokens and logits (an fp32 model: GENERATE_DTYPE)."""
    (expected, expected_logits), (actual, actual_logits) = runs.expected, runs.actual
    new = expected_logits.shape[0]
    record_property(f"tokens[{what}]", str(actual[:, -new:].tolist()))
    assert torch.equal(actual, expected), f"{what}: {actual[:, -new:].tolist()} != {expected[:, -new:].tolist()}"
    assert_close(actual_logits, expected_logits, f"{what} logits", record_property)


# --- the features really matter in these models ----------------------------------------------------


@pytest.mark.parametrize("name, feature", [(n, a) for n, f in FAMILIES.items() for a in f.ablations])
def test_feature_changes_the_output(name, feature):
    """Switching the family's feature off (in fp32) moves eager's logits by more than 100x the fp32
    tolerance: the comparisons above would see the kernel ignore it."""
    family = FAMILIES[name]
    ids, mask = padded_batch("right")
    with torch.no_grad():
        base = build(family, dtype=torch.float32)(input_ids=ids, attention_mask=mask).logits
        off = build(family, ablated_config(family, feature), sinks_off=feature == "sinks", dtype=torch.float32)
        changed = off(input_ids=ids, attention_mask=mask).logits
    assert (base - changed)[mask.bool()].abs().max() > 100 * 1e-4


@pytest.mark.parametrize("name, graphs", [("llama", False), ("gpt_oss", False),
                                          pytest.param("llama", True, marks=pytest.mark.skipif(
                                              not ON_GPU, reason="CUDA graphs need a GPU"))])
def test_continuous_batching(kernel, name, graphs):
    """generate_batch() (continuous batching: prompts of different lengths in one packed varlen batch, then
    one query per sequence against its paged keys) gives the tokens of eager generate() on each prompt. With
    ``graphs`` (a GPU) transformers captures its steps in CUDA graphs, so the replays never reach the spy;
    gpt-oss runs without them (its MoE's grouped_mm copies from the host inside the capture, a
    transformers 5.22 failure whatever the attention)."""
    family = FAMILIES[name]
    model = build(family, dtype=GENERATE_DTYPE)
    prompts = [random_ids(n, seed=20 + n).tolist() for n in (SIZES.seqlen - SIZES.pad, SIZES.seqlen, 3)]
    with torch.no_grad():
        expected = [model.generate(input_ids=torch.tensor([p], device=DEVICE), max_new_tokens=SIZES.new_tokens,
                                   do_sample=False, pad_token_id=PAD)[0, len(p):].tolist() for p in prompts]
    use_kernel(model)
    config = transformers.GenerationConfig(max_new_tokens=SIZES.new_tokens, do_sample=False, pad_token_id=PAD,
                                           eos_token_id=None)
    with kernel_calls(kernel) as calls:
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                       continuous_batching_config=transformers.ContinuousBatchingConfig(
                                           use_cuda_graph=graphs))
    assert len(results) == len(prompts) and all(r.error is None for r in results.values())
    actual = [next(r.generated_tokens for r in results.values() if r.prompt_ids == p) for p in prompts]
    assert actual == expected
    assert calls and all(c.function == "flash_attn_varlen_func" for c in calls)
    if not graphs:
        assert any(c.q_shape[0] == len(prompts) and c.k_shape[0] > len(prompts) for c in calls)  # decode steps
    check_calls(family, model, calls, "generate")


# --- what transformers passes: accepted, and used ---------------------------------------------------


def test_transformers_passes_every_option(kernel):
    """transformers passes an option only if its name is in the function's signature: all of them are."""
    model = build(FAMILIES["llama"])
    use_kernel(model)
    supports = mfau._process_flash_kwargs_fn.keywords["supports_mapping"]
    for name in ("dropout_p", "window_size", "softcap", "deterministic", "s_aux", "max_seqlen_q", "max_seqlen_k",
                 "block_table"):
        assert supports[name], f"transformers would drop {name}"
    paged = mfau._process_with_kvcache_kwargs_fn.keywords["supports_mapping"]  # the paged decode fast path
    for name in ("window_size", "softcap", "s_aux", "block_table", "cache_seqlens"):
        assert paged[name], f"transformers would drop {name} for flash_attn_with_kvcache"
    assert mfau._flash_with_kvcache_fn.__wrapped__ is kernel.flash_attn_with_kvcache


def test_dropout_and_deterministic(kernel, monkeypatch):
    """attention_dropout reaches the kernel in training mode (0 in eval), seeded like any torch op;
    FLASH_ATTENTION_DETERMINISTIC=1 passes deterministic=True, which changes nothing (no atomics)."""
    family = FAMILIES["llama"]
    model = build(family, family.make_config(SIZES, attention_dropout=0.25))
    use_kernel(model)
    ids, mask = padded_batch("right")
    valid = mask.bool()

    def forward():
        torch.manual_seed(5)
        return model(input_ids=ids, attention_mask=mask).logits

    model.train()
    with kernel_calls(kernel) as calls:
        dropped, again = forward(), forward()
    assert {c.kwargs["dropout_p"] for c in calls} == {0.25}
    assert torch.equal(dropped, again)
    dropped[valid].sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    model.eval()
    with kernel_calls(kernel) as calls, torch.no_grad():
        plain = forward()
    assert {c.kwargs["dropout_p"] for c in calls} == {0.0}
    assert (dropped - plain)[valid].abs().max() > 10 * tolerance(DTYPE)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    with kernel_calls(kernel) as calls, torch.no_grad():
        deterministic = forward()
    assert {c.kwargs["deterministic"] for c in calls} == {True}
    assert torch.equal(deterministic, plain)


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_generate_static_cache(kernel, name, record_property):
    """generate() with a static cache (keys padded to the cache's length: transformers keeps the mask for
    a "flash" implementation and unpads them) gives eager's tokens."""
    model = build(FAMILIES[name], dtype=GENERATE_DTYPE)
    ids = random_ids(2, SIZES.seqlen - SIZES.pad)
    runs = eager_and_kernel(model, kernel, lambda m: _generate(m, ids, torch.ones_like(ids),
                                                               cache_implementation="static"))
    assert_same_tokens(runs, f"{name} generate static cache", record_property)


# --- clear errors -----------------------------------------------------------------------------------


def test_refused_inputs_are_clear_errors(kernel):
    """What the kernel cannot compute raises, naming the problem: a float64 model, a head dim over 256."""
    family = FAMILIES["llama"]
    ids = random_ids(1, 5)
    model = build(family).double()
    use_kernel(model)
    with pytest.raises(TypeError, match="float64; supported dtypes are float16, bfloat16 and float32"):
        model(input_ids=ids)
    model = build(family, family.make_config(SIZES, head_dim=264))
    use_kernel(model)
    with pytest.raises(ValueError, match="head dim must be between 1 and 256, got 264"):
        model(input_ids=ids)


# --- gpt-oss: which id reaches this kernel ----------------------------------------------------------


def test_gpt_oss_plain_route_is_rewritten(kernel, monkeypatch):
    """gpt-oss lists _compatible_flash_implementations, so transformers replaces any other id containing
    "flash" by the first listed kernel for the device (kernels-community/vllm-flash-attn3 on CUDA, and on
    CPU, which none lists), with a warning; offline, loading that kernel fails and the model keeps its
    attention. Asked again in the same process, transformers (which marked vllm-flash-attn3 as loaded)
    accepts it, and the first forward raises: never a silent fallback."""
    warnings = []
    monkeypatch.setattr(transformers.modeling_utils.logger, "warning_once", warnings.append)
    model = build(FAMILIES["gpt_oss"])
    with pytest.raises(ValueError, match="kernels-community/vllm-flash-attn3.*offline mode"):
        model.set_attn_implementation(REPO)
    assert model.config._attn_implementation == "eager"
    assert any(f"Automatically falling back to `kernels-community/vllm-flash-attn3` instead of `{REPO}`" in w
               for w in warnings), warnings
    try:
        model.set_attn_implementation(REPO)
    except ValueError:
        return  # (the first attempt in this process)
    assert model.config._attn_implementation == "kernels-community/vllm-flash-attn3"
    with pytest.raises(KeyError, match="vllm-flash-attn3"):
        model(input_ids=random_ids(1, 5))


def test_gpt_oss_compatible_route(kernel, monkeypatch, tmp_path, record_property):
    """The route: list this kernel in GptOssPreTrainedModel._compatible_flash_implementations before
    loading (the model's own list of vouched-for kernels, which also skips the Hub's publisher check);
    from_pretrained(attn_implementation=REPO) then runs this kernel, sinks and window included."""
    family = FAMILIES["gpt_oss"]
    saved = build(family)
    saved.save_pretrained(tmp_path)
    cls = modeling_gpt_oss.GptOssPreTrainedModel
    monkeypatch.setattr(cls, "_compatible_flash_implementations", [REPO, *cls._compatible_flash_implementations])
    model = family.model_class.from_pretrained(tmp_path, attn_implementation=REPO, dtype=DTYPE).to(DEVICE).eval()
    assert model.config._attn_implementation == REPO
    assert torch.equal(model.model.layers[0].self_attn.sinks, saved.model.layers[0].self_attn.sinks.to(DTYPE))
    ids, mask = padded_batch("left")

    def run(m):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask).logits[mask.bool()]

    runs = eager_and_kernel(model, kernel, run)
    assert_close(runs.actual, runs.expected, "gpt_oss from_pretrained logits", record_property, runs.reference)
    check_calls(family, model, runs.calls, "left")


@pytest.mark.parametrize("static_cache", [False, pytest.param(True, marks=pytest.mark.xfail(
    strict=True, reason="transformers treats an id without 'flash' as not flash attention: generate() with a static "
                        "cache then drops the all-ones mask and the kernel attends to the cache's empty slots"))])
def test_gpt_oss_alias_route(kernel, static_cache, record_property):
    """Another route: the same build under an id without "flash" (LOCAL_KERNELS="kernels-triton/triton-attention=
    <build>") is not rewritten and works with a dynamic cache, but not with a static cache (xfail): not the
    route to recommend."""
    family = FAMILIES["gpt_oss"]
    model = build(family, dtype=GENERATE_DTYPE)
    ids = random_ids(2, 3)  # a short prompt: most of the static cache's slots are empty
    cache = {"cache_implementation": "static"} if static_cache else {}
    runs = eager_and_kernel(model, kernel, lambda m: _generate(m, ids, torch.ones_like(ids), **cache), ALIAS)
    assert all("s_aux" in c.kwargs for c in runs.calls)
    assert_same_tokens(runs, f"gpt_oss alias route, static cache {static_cache}", record_property)


# --- transformers behaviours no kernel can fix (strict xfails: they fail once transformers changes) ----


@pytest.mark.xfail(strict=True, reason="transformers 5.22's flash path unpads the decoder's queries of a "
                                       "cross-attention with the encoder's padding mask (_upad_input)")
def test_cross_attention_with_padded_encoder(kernel, record_property):
    model = build(FAMILIES["bart"])
    encoder_ids, encoder_mask = padded_batch("right")
    decoder_ids = random_ids(2, SIZES.decoder_seqlen, seed=4)

    def run(m):
        with torch.no_grad():
            return m(input_ids=encoder_ids, attention_mask=encoder_mask, decoder_input_ids=decoder_ids).logits

    runs = eager_and_kernel(model, kernel, run)
    assert_close(runs.actual, runs.expected, "bart, padded encoder", record_property, runs.reference)


@pytest.mark.xfail(strict=True, reason="transformers 5.22 lets a hub kernel replace the attention of models that "
                                       "set _supports_flash_attn = False (T5's relative position bias is dropped)")
def test_t5_relative_position_bias(kernel, record_property):
    config = transformers.T5Config(vocab_size=SIZES.vocab, d_model=SIZES.hidden, d_kv=SIZES.head_dim,
                                   d_ff=2 * SIZES.hidden, num_layers=1, num_heads=SIZES.hidden // SIZES.head_dim,
                                   dropout_rate=0.0, pad_token_id=PAD, decoder_start_token_id=PAD)
    torch.manual_seed(0)
    model = transformers.T5Model(config).to(DEVICE, DTYPE).eval()
    ids = random_ids(2, SIZES.seqlen)

    def run(m):
        with torch.no_grad():
            return m(input_ids=ids, decoder_input_ids=ids[:, :5]).last_hidden_state

    runs = eager_and_kernel(model, kernel, run)
    assert_close(runs.actual, runs.expected, "t5", record_property, runs.reference)
