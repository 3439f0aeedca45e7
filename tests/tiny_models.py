"""Tiny randomly initialised transformers models, one per kind of attention, for test_transformers.py.

Each family builds a model small enough for Triton's CPU interpreter (2 layers, hidden 64, head dim
16, sequences of at most 16 tokens, fp32) or, on a GPU, a little larger (hidden 256, head dim 64,
sequences up to 128 tokens, bf16). Weights are drawn with a large
``initializer_range`` so that the attention is far from uniform and every feature under test
(sliding window, softcap, sinks) changes the output well beyond the tolerance;
test_transformers.py checks that too, by switching the feature off in the eager reference.
"""

import dataclasses
from typing import Callable, Optional

import torch
import transformers

from sizes import DEVICE, ON_GPU


@dataclasses.dataclass(frozen=True)
class Sizes:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    seqlen: int  # of a padded batch of 2 rows
    pad: int  # padding tokens in the second row
    window: int  # sliding_window, smaller than seqlen so that it matters
    packed: tuple  # sequence lengths packed into one row
    new_tokens: int  # greedy tokens generated
    decoder_seqlen: int  # encoder-decoder models: decoder tokens


CPU_SIZES = Sizes(hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=96, seqlen=12, pad=3, window=4,
                  packed=(5, 7, 4), new_tokens=4, decoder_seqlen=7)
GPU_SIZES = Sizes(hidden=256, heads=4, kv_heads=2, head_dim=64, layers=2, vocab=256, seqlen=80, pad=23, window=24,
                  packed=(37, 64, 27), new_tokens=8, decoder_seqlen=41)
SIZES = GPU_SIZES if ON_GPU else CPU_SIZES
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# Large enough for far from uniform attention; scaled with the width so that q, k and v entries have
# the same size (about 1.6) at both sizes.
INIT_STD = 0.2 * (64 / SIZES.hidden) ** 0.5
PAD = 0  # pad token id of every family (no bos/eos: generate() always makes new_tokens tokens)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family and what its attention passes to the kernel.

    kind: "decoder" (causal LM), "encoder" (masked LM) or "seq2seq" (encoder-decoder).
    sliding_layers: indices of the layers with a sliding window, where transformers must pass
    window_size == window (the kernel's inclusive (left, right)).
    expected: keywords every call of the family's attention must receive, with their values.
    ablations: the family's features that ``ablated_config`` / ``build(sinks_off=True)`` switch off;
    eager's output must move when one is, else the comparisons could not see the kernel ignore it.
    post_init: draws what the family's own initialisation leaves too small to matter.
    """

    name: str
    kind: str
    make_config: Callable
    model_class: Callable
    sliding_layers: tuple = ()
    window: Optional[tuple] = None
    expected: dict = dataclasses.field(default_factory=dict)
    ablations: tuple = ()
    post_init: Optional[Callable] = None


def _common(s: Sizes) -> dict:
    return dict(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
                num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                max_position_embeddings=256, initializer_range=INIT_STD, pad_token_id=PAD, bos_token_id=None,
                eos_token_id=None, tie_word_embeddings=False, attention_dropout=0.0)


def _llama(s, **kw):
    return transformers.LlamaConfig(**{**_common(s), **kw})


def _mistral(s, **kw):
    return transformers.MistralConfig(**{**_common(s), "sliding_window": s.window, **kw})


QUERY_PRE_ATTN_SCALAR = 24  # Gemma 2: softmax_scale = 24 ** -0.5, not head_dim ** -0.5
SOFTCAP = 50.0


def _gemma2(s, **kw):
    return transformers.Gemma2Config(**{
        **_common(s), "sliding_window": s.window, "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR,
        "attn_logit_softcapping": SOFTCAP, "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)], **kw})


def _gemma2_scores(model):
    """Scale q and k up so that the scores reach the softcap's saturating range: |scores| up to about 60-80
    against the cap of 50."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(GEMMA2_QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(GEMMA2_QK_SCALE)


GEMMA2_QK_SCALE = 2.0 if ON_GPU else 3.0


def _gpt_oss(s, **kw):
    common = _common(s)
    common["intermediate_size"] = s.hidden
    return transformers.GptOssConfig(**{
        # every token to both experts: a top-k router is discontinuous, and a bf16 rounding difference in the
        # attention could send a token elsewhere
        **common, "sliding_window": s.window, "num_local_experts": 2, "num_experts_per_tok": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)], **kw})


def _gpt_oss_sinks(model):
    """gpt-oss initialises its sinks near 0: draw them from N(0, 1), large enough to matter."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=generator))


def _modernbert(s, **kw):
    return transformers.ModernBertConfig(**{
        "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": 2 * s.hidden,
        "num_hidden_layers": s.layers, "num_attention_heads": s.hidden // s.head_dim, "max_position_embeddings": 256,
        "initializer_range": INIT_STD, "local_attention": s.window, "global_attn_every_n_layers": 2,
        "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2,
        "tie_word_embeddings": False, **kw})


def _bart(s, **kw):
    return transformers.BartConfig(**{
        "vocab_size": s.vocab, "d_model": s.hidden, "encoder_layers": s.layers // 2 or 1,
        "decoder_layers": s.layers // 2 or 1, "encoder_attention_heads": s.hidden // s.head_dim,
        "decoder_attention_heads": s.hidden // s.head_dim, "encoder_ffn_dim": 2 * s.hidden,
        "decoder_ffn_dim": 2 * s.hidden, "max_position_embeddings": 256, "init_std": INIT_STD, "dropout": 0.0,
        "attention_dropout": 0.0, "activation_dropout": 0.0, "pad_token_id": PAD, "bos_token_id": 1,
        "eos_token_id": None, "forced_eos_token_id": None, "decoder_start_token_id": 2, "scale_embedding": False,
        "tie_word_embeddings": False, **kw})


S = SIZES
FAMILIES = {
    # GQA (4 query heads, 2 KV heads), plain causal attention.
    "llama": Family("llama", "decoder", _llama, transformers.LlamaForCausalLM),
    # Sliding window on every layer.
    "mistral": Family("mistral", "decoder", _mistral, transformers.MistralForCausalLM,
                      sliding_layers=tuple(range(S.layers)), window=(S.window - 1, S.window - 1),
                      ablations=("sliding_window",)),
    # Softcap 50, sliding window on alternate layers, softmax scale from query_pre_attn_scalar.
    "gemma2": Family("gemma2", "decoder", _gemma2, transformers.Gemma2ForCausalLM,
                     sliding_layers=tuple(range(0, S.layers, 2)), window=(S.window - 1, S.window - 1),
                     expected={"softcap": SOFTCAP, "softmax_scale": QUERY_PRE_ATTN_SCALAR ** -0.5},
                     ablations=("sliding_window", "softcap"), post_init=_gemma2_scores),
    # Attention sinks (s_aux), sliding window on alternate layers, mixture of experts.
    "gpt_oss": Family("gpt_oss", "decoder", _gpt_oss, transformers.GptOssForCausalLM,
                      sliding_layers=tuple(range(0, S.layers, 2)), window=(S.window - 1, S.window - 1),
                      ablations=("sliding_window", "sinks"), post_init=_gpt_oss_sinks),
    # Encoder: bidirectional, symmetric sliding window (local attention) on alternate layers.
    "modernbert": Family("modernbert", "encoder", _modernbert, transformers.ModernBertForMaskedLM,
                         sliding_layers=tuple(range(1, S.layers, 2)), window=(S.window // 2, S.window // 2),
                         expected={"causal": False}, ablations=("sliding_window",)),
    # Encoder-decoder: bidirectional encoder, causal decoder, cross-attention (seqlen_q != seqlen_k).
    "bart": Family("bart", "seq2seq", _bart, transformers.BartForConditionalGeneration),
}


def ablated_config(family: Family, what: str):
    """The family's config with one feature switched off."""
    if what == "sliding_window":  # a window longer than any sequence here
        if family.name == "modernbert":
            return family.make_config(SIZES, local_attention=512)
        return family.make_config(SIZES, sliding_window=256)
    if what == "softcap":
        return family.make_config(SIZES, attn_logit_softcapping=None)
    if what == "sinks":
        return family.make_config(SIZES)  # same config: build() is told to set the sinks to -inf
    raise ValueError(what)


def build(family: Family, config=None, sinks_off: bool = False, dtype=DTYPE):
    """A fresh model of ``family`` with seeded random weights (the same for any config with the same shapes),
    in eager attention, in ``dtype`` on DEVICE."""
    config = config if config is not None else family.make_config(SIZES)
    torch.manual_seed(0)
    model = family.model_class(config)
    if family.post_init is not None:
        family.post_init(model)
    if sinks_off:
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "sinks"):
                    module.sinks.fill_(-torch.inf)
    model.set_attn_implementation("eager")
    return model.to(device=DEVICE, dtype=dtype).eval()
