"""End to end through transformers: generate() and a training step of a Llama-shaped model.

The rows issue 41 asks for, which users recognise: a Llama-shaped model with random weights (bf16,
--layers 16, hidden 2048, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 32000: about 1.1B
parameters) run with this kernel as its attention (attn_implementation = the kernel's repo id,
loaded offline from this repository's build through LOCAL_KERNELS, as tests/test_transformers.py
loads it) against attn_implementation="sdpa" and, where flash-attn is installed,
"flash_attention_2", on the same weights:

  generate  tokens per second of greedy generate(): batch 1 and 8, a 512-token prompt, 256 new
            tokens (min_new_tokens: random weights may emit EOS early), eager with the dynamic
            cache, and with the static cache, for which generate() compiles the model's forward
            itself on a GPU (transformers' auto-compile; a row that cannot run prints n/a and why).
  train     one training step (forward with labels, backward) at sequence 2k and 4k, batch 1:
            milliseconds per step and tokens per second, after warm-up, synchronised per step.

Each implementation runs in the same process on the same model object (set_attn_implementation
between them), so the host and the weights are the same. --smoke runs a two-layer model of
hidden 64 on the CPU through Triton's interpreter (8 new tokens, sequence 64): a check that the
script and the APIs fit, not a measurement.

Usage: python benchmarks/bench_generate.py [--sections generate train] [--layers 16]
           [--out benchmarks/results/generate.md]       (after scripts/build_variants.py, on a GPU)
       python benchmarks/bench_generate.py --smoke       (any machine)
"""

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_decode import DEVICE, failure_reason, synchronize  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO = "kernels-triton/flash-attention"


def use_local_build(build: Path) -> None:
    """Let transformers load the kernel from ``build`` offline (LOCAL_KERNELS, HF_HUB_OFFLINE)."""
    os.environ["LOCAL_KERNELS"] = f"{REPO}={build}"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True  # (read once, when huggingface_hub is imported)


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads_k, vocab_size=args.vocab,
                         max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(args.dtype)
    return model


def implementations(args) -> list:
    """The attention implementations to compare: this kernel, sdpa, and flash-attn's own route
    where flash-attn is installed."""
    names = [REPO, "sdpa"]
    if importlib.util.find_spec("flash_attn") is not None:
        names.append("flash_attention_2")
    else:
        print("flash_attention_2: n/a (flash-attn is not installed)")
    return names


def generate_rows(model, args, report):
    report.append("\n### generate: tokens per second (new tokens of the whole batch / wall time)\n")
    report.append("| implementation | cache | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    report.append("|---|---|" + "---|" * len(args.batches))
    generator = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(3, args.vocab, (b, args.prompt), generator=generator).to(DEVICE) for b in args.batches}
    for name in implementations(args):
        for cache in ("dynamic", "static"):
            cells = []
            for batch in args.batches:
                cells.append(_generate_rate(model, name, cache, prompts[batch], args))
            line = f"| {_label(name)} | {cache}{' + compile' if cache == 'static' else ''} | " + " | ".join(cells) + " |"
            report.append(line)
            print(line, flush=True)


def _generate_rate(model, name, cache, prompt, args) -> str:
    try:
        model.set_attn_implementation(name)
        kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                      pad_token_id=0, attention_mask=torch.ones_like(prompt))
        if cache == "static":
            kwargs["cache_implementation"] = "static"
        with torch.no_grad():
            model.generate(prompt, **kwargs)  # warm-up (and compile, for the static cache)
            synchronize()
            start = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            synchronize()
        elapsed = time.perf_counter() - start
        new = (out.shape[1] - prompt.shape[1]) * prompt.shape[0]
        return f"{new / elapsed:.0f}"
    except Exception as error:  # noqa: BLE001 (a route this transformers or GPU cannot run: a cell, not a crash)
        return f"n/a ({failure_reason(error)})"


def train_rows(model, args, report):
    report.append("\n### train: one step (forward with labels + backward), batch 1: ms per step, tokens/s\n")
    report.append("| implementation | " + " | ".join(f"seq {s}" for s in args.train_seqlens) + " |")
    report.append("|---|" + "---|" * len(args.train_seqlens))
    generator = torch.Generator().manual_seed(2)
    model.train()
    for name in implementations(args):
        cells = []
        for seqlen in args.train_seqlens:
            ids = torch.randint(3, args.vocab, (1, seqlen), generator=generator).to(DEVICE)
            cells.append(_train_time(model, name, ids, args))
        line = f"| {_label(name)} | " + " | ".join(cells) + " |"
        report.append(line)
        print(line, flush=True)
    model.eval()


def _train_time(model, name, ids, args) -> str:
    try:
        model.set_attn_implementation(name)
        times = []
        for step in range(args.train_warmup + args.train_steps):
            model.zero_grad(set_to_none=True)
            synchronize()
            start = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            synchronize()
            if step >= args.train_warmup:
                times.append(time.perf_counter() - start)
        ms = sorted(times)[len(times) // 2] * 1e3
        return f"{ms:.1f} ms, {ids.numel() / ms * 1e3:.0f} tok/s"
    except Exception as error:  # noqa: BLE001
        return f"n/a ({failure_reason(error)})"


def _label(name: str) -> str:
    return "this kernel" if name == REPO else name


def apply_presets(args):
    if args.smoke:
        args.dtype, args.layers, args.hidden, args.intermediate = torch.float32, 2, 64, 128
        args.heads, args.heads_k, args.vocab = 4, 2, 128
        args.batches, args.prompt, args.new_tokens = [2], 16, 8
        args.train_seqlens, args.train_warmup, args.train_steps = [64], 1, 1


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=["generate", "train"], default=["generate", "train"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--train-seqlens", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--build", type=Path, default=REPO_ROOT / "build",
                        help="the build transformers loads the kernel from (scripts/build_variants.py)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on any machine (see the docstring)")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    args = parser.parse_args(argv)
    args.dtype, args.hidden, args.intermediate, args.heads, args.heads_k, args.vocab = (
        torch.bfloat16, 2048, 8192, 32, 8, 32000)
    args.train_warmup, args.train_steps = 2, 5
    apply_presets(args)
    use_local_build(args.build.resolve())
    import transformers

    model = build_model(args).eval()
    parameters = sum(p.numel() for p in model.parameters())
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (interpreter)"
    report = [f"# End to end through transformers\n\n{device}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}; Llama-shaped, {args.layers} layers, {parameters / 1e9:.2f}B parameters, "
              f"{args.dtype}"]
    print(report[0])
    if "generate" in args.sections:
        generate_rows(model, args, report)
    if "train" in args.sections:
        train_rows(model, args, report)
    text = "\n".join(report) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    failed = args.smoke and "n/a" in "\n".join(line for line in report if line.startswith("| this kernel"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
