"""Where the host time of a training step's attention goes, layer by layer, on a GPU.

cProfile's per-call overhead distorts calls this small, so this wraps the package's layers (the
public function, the checks, the autograd Function's forward and backward, the launchers, the
planner, the Gluon argument builders, the direct launch) and Triton's launcher
(``CudaLauncher.__call__``, ``make_tensordesc_arg``) in perf_counter timers and prints each one's
inclusive time per forward + backward step (bf16, batch 1, N = --seqlen, 16 heads of 128, causal),
with the Gluon kernels on and off (FLASH_ATTENTION_GLUON). A wrapper costs well under a
microsecond, so the step's total runs a little above the unwrapped time. The calls' eager and
CUDA-graph times beside SDPA are bench_host.py's (its host and scaling sections).

Usage: python benchmarks/host_pieces.py [--seqlen 128]     (after scripts/build_variants.py, on a GPU)
"""

import argparse
import functools
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flash_attention import load_kernel  # noqa: E402

HEADS, HEAD_DIM = 16, 128
# (module, function) pairs to time, inside the loaded package
LAYERS = [("interface", "flash_attn_func"), ("checks", "checked_attention_options"), ("checks", "check_qkv"),
          ("torch_ops", "run_attention"), ("flash_attention_kernel.forward", "attention_forward"),
          ("flash_attention_kernel.backward", "attention_backward"),
          ("flash_attention_kernel.planner", "plan_forward"), ("flash_attention_kernel.planner", "plan_backward"),
          ("flash_attention_kernel.hopper_forward", "attention_forward"),
          ("flash_attention_kernel.hopper_dkdv", "attention_dkdv"), ("flash_attention_kernel.hopper_dq", "attention_dq"),
          ("flash_attention_kernel.hopper_gluon", "tile_arguments"),
          ("flash_attention_kernel.hopper_gluon", "option_arguments"),
          ("flash_attention_kernel.hopper_gluon", "vector_descriptor")]


def inputs(batch, seqlen, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, generator=generator).cuda().bfloat16()
                     for _ in range(4))
    return [x.requires_grad_() for x in (q, k, v)], dout


class Timers:
    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, name, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
        return timed

    def clear(self):
        self.seconds.clear()
        self.calls.clear()


def wrap_layers(fa, timers):
    """Replace each layer function by its timed wrapper wherever the package holds it."""
    prefix = fa.__name__
    for module_name, attribute in LAYERS:
        module = sys.modules.get(f"{prefix}.{module_name}")
        if module is None:  # (the Gluon modules are imported on first use only)
            continue
        original = getattr(module, attribute)
        timed = timers.wrap(f"{module_name.split('.')[-1]}.{attribute}", original)
        for name, holder in list(sys.modules.items()):
            if name.startswith(prefix) and holder is not None:
                for key, value in list(vars(holder).items()):
                    if value is original:
                        setattr(holder, key, timed)
    fa.flash_attn_func = sys.modules[f"{prefix}.interface"].flash_attn_func
    direct = sys.modules[f"{prefix}.flash_attention_kernel.direct_launch"].DirectKernel
    direct._launch = timers.wrap("DirectKernel._launch", direct._launch)
    eager = sys.modules[f"{prefix}.torch_ops"]._EagerAttention
    eager.forward = staticmethod(timers.wrap("_EagerAttention.forward", eager.forward))
    eager.backward = staticmethod(timers.wrap("_EagerAttention.backward", eager.backward))
    import triton.backends.nvidia.driver as driver
    driver.make_tensordesc_arg = timers.wrap("triton make_tensordesc_arg", driver.make_tensordesc_arg)
    driver.CudaLauncher.__call__ = timers.wrap("triton CudaLauncher.__call__", driver.CudaLauncher.__call__)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_pieces: needs a CUDA GPU")
    fa = load_kernel()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"Triton {__import__('triton').__version__}")
    (q, k, v), dout = inputs(1, args.seqlen)

    def step():
        return torch.autograd.grad(fa.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

    for gluon in ("1", "0"):  # (compiles the kernels and imports the Gluon modules, which wrap_layers wraps)
        os.environ["FLASH_ATTENTION_GLUON"] = gluon
        step()
    timers = Timers()
    wrap_layers(fa, timers)
    for gluon in ("1", "0"):
        os.environ["FLASH_ATTENTION_GLUON"] = gluon
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        timers.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        total = (time.perf_counter() - start) / args.steps * 1e6
        print(f"\nGLUON={gluon}, N={args.seqlen}: {total:.1f} us per forward + backward step (wrapped)\n")
        print("| layer | us per step (inclusive) | calls per step |\n|---|---|---|")
        for name, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
            print(f"| {name} | {seconds / args.steps * 1e6:.1f} | {timers.calls[name] / args.steps:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
