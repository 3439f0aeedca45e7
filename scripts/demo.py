"""The main job: load the built Hub variant through kernels, check it, and train with it.

1. Loads ``<org>/flash-attention`` with ``kernels.get_kernel(..., version=1)`` from the local build
   (LOCAL_KERNELS, offline) and checks forward + backward of ``flash_attn_func`` (causal, GQA)
   against ``torch.nn.functional.scaled_dot_product_attention`` in fp32.
2. Trains a tiny randomly initialised transformers Llama (GQA) three times from the same weights,
   with ``attn_implementation="<org>/flash-attention"`` (this kernel, through transformers' hub
   attention), ``"eager"`` and ``"sdpa"``, on the same batches (right-padded, so the varlen path
   runs), prints the loss curves side by side, and generates a few greedy tokens with each.

The training runs in fp32 (the kernel's fp32 path multiplies in full fp32, as eager does), with SDPA
as a second reference: training amplifies rounding differences from step to step, so how far two
correct implementations (eager, SDPA) drift apart is the yardstick, and ours must stay within twice
that (or 1e-3). At the default learning rates the curves agree to rounding (CPU, lr 3e-3: ours
1.2e-7 and SDPA 1.1e-7 from eager; H200, lr 1e-3: 1.8e-6 and 2.2e-6); at `--lr 1e-2` on the GPU
training turns chaotic and eager and SDPA themselves end up 40 % apart. On the GPU it trains on 8 x
512 tokens; without one, on CPU through Triton's interpreter at sizes that finish in about a minute.
Exits non-zero when the kernel and SDPA disagree, the loss curves drift apart or the generated
tokens differ.
"""

import argparse
import os
import sys
import time
import tomllib
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (by kernels)
repo_id = tomllib.loads((REPO_ROOT / "build.toml").read_text())["general"]["hub"]["repo-id"]
os.environ["LOCAL_KERNELS"] = f"{repo_id}={REPO_ROOT / 'build'}"
os.environ["HF_HUB_OFFLINE"] = "1"

import kernels  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
# training sizes: (batch, seqlen, hidden, layers, heads, kv heads, steps)
TRAIN = (8, 512, 256, 2, 8, 2, 30) if ON_GPU else (4, 24, 64, 2, 4, 2, 20)
VOCAB = 64
LR = 1e-3 if ON_GPU else 3e-3


def check_kernel(flash_attention) -> bool:
    """flash_attn_func forward + backward against fp32 SDPA."""
    batch, seqlen, heads, heads_kv, head_dim = (4, 2048, 16, 4, 128) if ON_GPU else (1, 64, 4, 2, 64)
    dtype = torch.bfloat16
    print(f"1. flash_attn_func, q (batch={batch}, seqlen={seqlen}, heads={heads}, head_dim={head_dim}) {dtype}, "
          f"k/v heads={heads_kv}, causal")
    q = torch.randn(batch, seqlen, heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, seqlen, heads_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, seqlen, heads_kv, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(q)

    start = time.perf_counter()
    out = flash_attention.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if ON_GPU:
        torch.cuda.synchronize()
    print(f"   forward + backward: {time.perf_counter() - start:.2f} s (first call, compilation included)")

    # SDPA on (batch, heads, seqlen, dim), fp32 math as the reference.
    q32, k32, v32 = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float().transpose(1, 2))
    ok = True
    for name, ours, theirs, tol in [("out", out, ref, 2e-2),
                                    *[(n, g, r, 5e-2) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)]]:
        err = (ours.float() - theirs.transpose(1, 2)).abs().max().item()
        ok &= err <= tol
        print(f"   {name}: max |flash - sdpa(fp32)| = {err:.2e} (tolerance {tol:.0e}) {'ok' if err <= tol else 'MISMATCH'}")
    return ok


def tiny_llama(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, seqlen, hidden, layers, heads, heads_kv, _ = TRAIN
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads_kv, max_position_embeddings=2 * seqlen,
                         attn_implementation=attn_implementation)
    torch.manual_seed(0)  # the same initial weights for both runs
    return LlamaForCausalLM(config).to(DEVICE)


def batches():
    """Counting sequences (token t + 1 follows token t, modulo the vocabulary) from random starts,
    right-padded to random lengths: a task a tiny model learns in a few steps."""
    batch, seqlen, *_, steps = TRAIN
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        starts = torch.randint(0, VOCAB, (batch, 1), generator=generator)
        ids = (starts + torch.arange(seqlen)) % VOCAB
        lengths = torch.randint(seqlen // 2, seqlen + 1, (batch,), generator=generator)
        mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        yield ids.to(DEVICE), mask.to(DEVICE), labels.to(DEVICE)


def train(attn_implementation: str, lr: float):
    """(losses, generated tokens, seconds) of a tiny Llama trained with ``attn_implementation``."""
    model = tiny_llama(attn_implementation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    start = time.perf_counter()
    for ids, mask, labels in batches():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    prompt = torch.tensor([[5, 6, 7, 8]], device=DEVICE)
    model.eval()
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)
    return losses, generated[0, prompt.shape[1]:].tolist(), time.perf_counter() - start


def _drift(losses, reference) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def check_training(lr: float) -> bool:
    """Ours against eager, with SDPA as a second reference: how far two correct implementations
    drift apart over the same training is the yardstick for ours."""
    batch, seqlen, hidden, layers, heads, heads_kv, steps = TRAIN
    print(f"\n2. tiny Llama ({layers} layers, hidden {hidden}, {heads} heads, {heads_kv} KV heads, fp32), "
          f"{steps} AdamW steps (lr {lr:g}) on right-padded batches of {batch} x {seqlen} tokens")
    ours, ours_tokens, ours_time = train(repo_id, lr)
    eager, eager_tokens, eager_time = train("eager", lr)
    sdpa, sdpa_tokens, _ = train("sdpa", lr)
    print(f"   step  loss ({repo_id})  loss (eager)  loss (sdpa)")
    for step, (a, b, c) in enumerate(zip(ours, eager, sdpa)):
        print(f"   {step:4d}  {a:26.5f}  {b:12.5f}  {c:11.5f}")
    drift, sdpa_drift = _drift(ours, eager), _drift(sdpa, eager)
    tol = max(1e-3, 2 * sdpa_drift)
    learned = min(ours[-3:]) < 0.6 * ours[0]
    print(f"   largest relative loss difference to eager: ours {drift:.1e}, sdpa {sdpa_drift:.1e} (tolerance "
          f"{tol:.0e}); loss fell {ours[0]:.2f} -> {ours[-1]:.2f}; {ours_time:.1f} s ours, {eager_time:.1f} s eager")
    print(f"   generate(), 6 greedy tokens after [5, 6, 7, 8]: ours {ours_tokens}, eager {eager_tokens}, "
          f"sdpa {sdpa_tokens}")
    return drift <= tol and learned and ours_tokens == eager_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=LR, help=f"AdamW learning rate (default {LR:g})")
    args = parser.parse_args()
    flash_attention = kernels.get_kernel(repo_id, version=1)
    print(f"{repo_id} loaded from {flash_attention.__file__}")
    print(f"device: {torch.cuda.get_device_name() if ON_GPU else 'CPU (Triton interpreter)'}\n")
    ok = check_kernel(flash_attention)
    ok &= check_training(args.lr)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
