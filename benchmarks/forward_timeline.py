"""Where the Hopper Gluon forward's programs spend their time, from clock64 probes (Hopper only).

The tool copies the package's kernel layer (torch-ext/flash_attention/flash_attention_kernel) into a
temporary directory, adds probes to the copy's hopper_forward.py (``probed_source``: the kernel
itself is never edited) and runs the default route's forward there on 16k tokens (hidden 2048, as
bench_flash_attention.py). Each consumer warpgroup reads its SM's cycle counter at its start, once
Q has arrived, once its first key tile's P is formed, once its last P V has finished and after the
epilogue's stores, and writes them with the SM's id and the program's key-tile count into a
[programs, 16] int64 tensor. One call after warm-up is recorded per case.

Printed per case, medians over the programs in cycles: the whole program (first start to last end
of its two warpgroups), Q's wait, the first tile, the other tiles (and per tile), the epilogue, the
gap on the same SM from one program's end to the next one's start, how far apart the two
warpgroups end, and the share of its span each SM is busy. The probes cost a few instructions each;
compare cases, not absolute times. Dropout (whose schedule forms the first P elsewhere) leaves the
first-tile probe empty. A call the route does not give the Gluon forward (tl: short calls, odd
shapes) records nothing and says so.

Stop 58's table (docs/design.md#where-a-short-calls-program-spends-its-time) came from the first
form of these probes, on an H200; stop 59 ran this tool there under Triton 3.6 and 3.9 (the staged
epilogues' cycles in design.md, 3.9's cycles per key tile in docs/gpus.md).

Usage: python benchmarks/forward_timeline.py [--cases 128:2048:causal 64:2048 ...] [--save out.pt]
"""

import argparse
import importlib
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_flash_attention import HIDDEN, TOKENS  # noqa: E402  (the benchmarks' 16k-token grid)

KERNEL_LAYER = Path(__file__).resolve().parent.parent / "torch-ext" / "flash_attention" / "flash_attention_kernel"
DEFAULT_CASES = ["128:2048", "128:2048:causal", "128:4096:causal", "128:16384", "128:16384:causal", "64:2048",
                 "64:4096:causal"]
SLOTS = 16  # per program: SM id; per warpgroup w at 1 + 5 w: start, Q, first P, last P V, end; 11: key tiles
START, QUEUED, FIRST_P, LAST_PV, END = range(5)

_MARK = '''@gluon.jit
def _mark(slot, index: gl.constexpr, rows, first_row):
    """(probe) the SM's clock64 into slot[index], from the threads holding the warpgroup's first row
    (``rows`` ties the read to the values it must follow)."""
    now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [rows], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(slot + index + (rows - first_row), now, mask=rows == first_row)

'''
_START = '''\\1\\2\\1_mark(slot, 1 + WG * 5, rows, first_row)
\\1if WG == 0:
\\1    smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [rows], dtype=gl.int32, is_pure=False, pack=1)
\\1    gl.store(slot + (rows - first_row), smid.to(gl.int64), mask=rows == first_row)
\\1    gl.store(slot + 11 + (rows - first_row), ((keys_hi - keys_lo) // KEYS + rows * 0).to(gl.int64),
\\1             mask=rows == first_row)
'''
# (pattern, replacement, where): each must match exactly once in hopper_forward.py
PROBES = [
    (r"^(def attention_forward\()", "TIMELINE = None  # (probe) int64 [programs, 16]\n\n\n\\1", "attention_forward"),
    (r"(layout\.seqlen_k - layout\.seqlen_q, \*arguments,)", "\\1 TIMELINE,", "the forward's launch"),
    (r"(dropout_scale,)(\s*KEYS: gl\.constexpr)", "\\1 Timeline,\\2", "_forward_kernel's parameters"),
    (r"^(\s*)(sink = Sinks \+ head\n)",
     "\\1\\2\\1slot = Timeline + (gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1)"
     " * gl.program_id(2))).to(gl.int64) * 16\n", "_forward_kernel's sink pointer"),
    (r"dropout_scale,(\s*)FIRST,", "dropout_scale, slot,\\1FIRST,", "the first consumer's arguments"),
    (r"dropout_scale,(\s*)SECOND,", "dropout_scale, slot,\\1SECOND,", "the second consumer's arguments"),
    (r"(dropout_scale,)(\s*WG: gl\.constexpr)", "\\1 slot,\\2", "_consumer's parameters"),
    (r"^(@gluon\.jit\ndef _consumer\()", _MARK + "\\1", "_consumer"),
    (r"^(\s*)(rows = first_row \+ gl\.arange\(0, ROWS, row_layout\)\n)", _START, "the consumer's rows"),
    (r"^(\s*)(mbarrier\.wait\(q_bar, 0\)\n)", "\\1\\2\\1_mark(slot, 2 + WG * 5, rows, first_row)\n", "Q's wait"),
    (r"^(\s*)(first_step = lo \+ KEYS\n\s*step_end = hi\n)",
     "\\1\\2\\1_mark(slot, 3 + WG * 5, rows + (row_sum < 0.0).to(gl.int32), first_row)\n", "the first tile's P"),
    (r"^(\s*)(o = wait_chunks\(0, issue_into_chunks\(carried, .*\n)",
     "\\1\\2\\1_mark(slot, 4 + WG * 5, rows, first_row)\n", "the last P V's wait"),
    (r"^(\s*)(store_chunks\(Out \+ out_base, .*\n)", "\\1\\2\\1_mark(slot, 5 + WG * 5, rows, first_row)\n",
     "the epilogue's store"),
]


def probed_source(source: str) -> str:
    """hopper_forward.py's ``source`` with the probes added; ValueError naming the place where an
    anchor no longer matches once (the kernel changed there: update PROBES)."""
    for pattern, replacement, where in PROBES:
        source, count = re.subn(pattern, replacement, source, flags=re.M)
        if count != 1:
            raise ValueError(f"forward_timeline: {where}: {count} matches of {pattern!r} in hopper_forward.py")
    return source


def summarise(timeline) -> dict:
    """Medians over the programs of ``timeline`` (a [programs, 16] integer tensor as the probes
    write it), in cycles: total, q_wait, first_tile, other_tiles, per_tile, epilogue, gap (to the
    next program on the same SM), end_skew (between the two warpgroups), tiles; and busy, the
    SMs' busy time over their spans."""
    import torch

    t = timeline.long()
    groups = [t[:, 1 + 5 * w: 6 + 5 * w] for w in (0, 1)]
    start = torch.minimum(groups[0][:, START], groups[1][:, START])
    end = torch.maximum(groups[0][:, END], groups[1][:, END])

    def both(first, last):  # (the two warpgroups' mean interval per program)
        return torch.stack([g[:, last] - g[:, first] for g in groups]).double().mean(0)

    tiles = t[:, 11]
    other = both(FIRST_P, LAST_PV)
    gaps, busy, span = [], 0, 0
    for sm in t[:, 0].unique():
        order = (t[:, 0] == sm).nonzero().flatten()
        order = order[start[order].argsort()]
        gaps += (start[order][1:] - end[order][:-1]).tolist()
        busy += (end[order] - start[order]).sum().item()
        span += (end[order][-1] - start[order][0]).item()
    median = lambda x: statistics.median(x.tolist() if hasattr(x, "tolist") else x)  # noqa: E731
    return dict(total=median(end - start), q_wait=median(both(START, QUEUED)), first_tile=median(both(QUEUED, FIRST_P)),
                other_tiles=median(other), per_tile=median(other / (tiles - 1).clamp(min=1)),
                epilogue=median(both(LAST_PV, END)), gap=median(gaps) if gaps else 0.0,
                end_skew=median((groups[0][:, END] - groups[1][:, END]).abs().double()),
                tiles=median(tiles.double()), busy=busy / span if span else 1.0)


def load_probed_layer(directory: Path):
    """The kernel layer copied into ``directory`` with the probes in its hopper_forward.py, imported
    (as ``flash_attention_kernel``, ahead of any other) and returned."""
    copy = directory / "flash_attention_kernel"
    shutil.copytree(KERNEL_LAYER, copy, ignore=shutil.ignore_patterns("__pycache__"))
    forward = copy / "hopper_forward.py"
    forward.write_text(probed_source(forward.read_text()))
    sys.path.insert(0, str(directory))
    return importlib.import_module("flash_attention_kernel")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES,
                        help="HEAD_DIM:SEQLEN[:causal], 16k tokens each (default: %(default)s)")
    parser.add_argument("--save", type=Path, help="write {case: timeline} here (torch.save)")
    args = parser.parse_args(argv)

    import torch

    with tempfile.TemporaryDirectory() as directory:
        kernels = load_probed_layer(Path(directory))
        forward_module = importlib.import_module("flash_attention_kernel.hopper_forward")
        columns = ["total", "q_wait", "first_tile", "other_tiles", "per_tile", "epilogue", "gap", "end_skew"]
        print("| case | tiles | " + " | ".join(columns) + " | SMs busy |")
        print("|---" * (len(columns) + 3) + "|")
        saved = {}
        for case in args.cases:
            head_dim, seqlen, *mask = case.split(":")
            head_dim, seqlen, causal = int(head_dim), int(seqlen), mask == ["causal"]
            batch, heads = TOKENS // seqlen, HIDDEN // head_dim
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            options = kernels.AttentionOptions(softmax_scale=head_dim ** -0.5, causal=causal)
            forward_module.TIMELINE = torch.zeros(batch * heads * (seqlen // 128), SLOTS, dtype=torch.int64,
                                                  device="cuda")
            for _ in range(3):
                kernels.attention_forward(q, k, v, options)
            forward_module.TIMELINE.zero_()
            kernels.attention_forward(q, k, v, options)
            timeline = forward_module.TIMELINE.cpu()
            if not timeline[:, 1].any():
                print(f"| {case} | the route did not give this call the Gluon forward: nothing recorded |")
                continue
            saved[case] = timeline
            summary = summarise(timeline)
            print(f"| {case} | {summary['tiles']:.0f} | " + " | ".join(f"{summary[c] / 1e3:.2f}k" for c in columns)
                  + f" | {summary['busy']:.3f} |", flush=True)
        print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; cycles (clock64), medians over programs")
        if args.save:
            torch.save(saved, args.save)


if __name__ == "__main__":
    main()
