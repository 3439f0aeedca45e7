"""Run every kernel with every option at awkward sizes under compute-sanitizer's four tools.

Usage (on a CUDA machine, from the repository root): python3 scripts/sanitize.py [--tools memcheck,racecheck]
[--tool-seconds 110]

The script first runs the cases once without a sanitizer (that fills Triton's cache, so the
sanitized runs load compiled kernels instead of compiling under the tool, and checks that every
case runs), then once under each of ``compute-sanitizer --tool memcheck | racecheck | synccheck
| initcheck`` (memcheck and initcheck with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that an access
past a tensor's end lands outside any allocation instead of in the caching allocator's slack).
It prints one summary line per tool, "<tool>: <n> errors ...", with the tool's own summary
lines, writes each tool's full log under $OUT (or ./sanitize-logs), and exits non-zero if any
tool reports an error or does not finish.

The cases (``run_cases``) are small (sanitizers slow kernels 10-100x) and awkward (sequence
lengths that fill no tile, GQA, head dims that are no power of two), and reach every kernel:
the tl forward, dQ (computing delta itself), dK/dV with the preprocess kernel (varlen), the
sinks' gradient, the probabilities (return_attn_probs with dropout), the decode kernel with
appended keys, rotary, split-KV and the merge, contiguous and paged caches, the paged varlen
forward, rotary embeddings, and, on sm_90, the Gluon Hopper forward, dQ and dK/dV (dense bf16
with head dims 64 and 128 and sequence lengths that are multiples of 128), each with every
option: causal, window, softcap, ALiBi, sinks, dropout.

racecheck and Triton's warp specialisation: a warp-specialised kernel starts with Triton's own
dispatch (``gl.warp_specialize`` lowered): the default warpgroup writes each worker warp's
partition index into a few bytes of shared memory and meets the workers at ``barrier.sync 1``;
the workers read their byte after it, and the default warps write the exit state at the end.
racecheck reports these accesses as potential RAW/WAR hazards, attributed to the kernel's ``def``
line and the ``warp_specialize`` call, although the named barrier orders them. The cases
therefore include control kernels (``scripts/sanitizer_controls.py``: the attention kernels'
partitions that each store one number; a device-side tensor descriptor alone). Every tool's
reports are grouped by kernel and source line. A racecheck hazard whose two accesses lie at a
kernel's ``def`` line or a ``warp_specialize`` call is counted as Triton's dispatch, an initcheck
read at a ``make_tensor_descriptor`` call as Triton's descriptor creation; either is not an error
only when its control kernel shows the same. Anything else is an error. (Triton's descriptor
creation reads the scratch memory its allocator hands out before writing it, as the control
shows on torch.empty scratch; the attention cases get zero-filled scratch, so that initcheck
reports their own reads and its error buffer does not overflow with Triton's.)

``--only REGEX`` runs the cases whose names match (the controls among them), e.g. to rerun one
tool's findings quickly.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
NO_CACHING = {"memcheck", "initcheck"}


def find_sanitizer() -> str:
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer", shutil.which("compute-sanitizer")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    sys.exit("compute-sanitizer not found: looked for /usr/local/cuda/bin/compute-sanitizer and on PATH "
             "(it ships with the CUDA toolkit)")


def log_dir() -> Path:
    folder = Path(os.environ.get("OUT") or REPO_ROOT / "sanitize-logs")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def summarize(tool: str, output: str) -> tuple[int, list]:
    """(error count, the tool's summary lines) from a compute-sanitizer log."""
    lines = [line.strip() for line in output.splitlines() if re.search(r"(ERROR|RACECHECK) SUMMARY", line)]
    pattern = r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: .*\((\d+) errors"
    counts = [int(m.group(1) or m.group(2)) for line in lines for m in [re.search(pattern, line)] if m]
    return (max(counts) if counts else -1), lines


def run_tool(sanitizer: str, tool: str, folder: Path, seconds: int, only: str) -> bool:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tool in NO_CACHING:
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    # every report (grouped by ``classify``), without host backtraces
    command = [sanitizer, "--tool", tool, "--print-limit", str(PRINT_LIMIT), "--show-backtrace", "no",
               sys.executable, __file__, "--cases", "--only", only]
    if tool == "racecheck":
        command[3:3] = ["--racecheck-report", "hazard"]
    start = time.time()
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds)
        output, finished = result.stdout + result.stderr, "CASES DONE" in result.stdout
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        finished = False
    (folder / f"sanitize-{tool}.log").write_text(output)
    errors, lines = summarize(tool, output)
    if errors != 0:
        errors = classify(tool, output, errors)
    cases = len(re.findall(r"^CASE ", output, flags=re.M))
    state = "finished" if finished else f"DID NOT FINISH (after case {cases})"
    print(f"{tool}: {errors if errors >= 0 else '?'} errors, {cases} cases, {time.time() - start:.0f} s, {state}; "
          + " | ".join(lines), flush=True)
    return finished and errors == 0


PRINT_LIMIT = 20_000  # reports printed per tool; beyond it they cannot be classified and all count
HAZARD = re.compile(r"Potential (\w+) hazard detected at __shared__ \S+ in block")
ACCESS = re.compile(r"(?:Read|Write) Thread \S+ at (\w+)\+0x[0-9a-f]+ in ([\w.]+:\d+)")
REPORT = re.compile(r"^=+ (Uninitialized .*|Invalid .*|Barrier .*|.*error.*) *$", re.I)
LOCATION = re.compile(r"^=+ +at (\w+)\+0x[0-9a-f]+ in ([\w.]+:\d+)")


def reports(tool: str, output: str) -> dict:
    """{(what, kernel, 'file:line', ...): count} of a log's reports: racecheck's hazards by their
    two accesses, the other tools' errors by their location."""
    groups, what, locations = {}, None, []
    for line in output.splitlines():
        found = HAZARD.search(line) if tool == "racecheck" else REPORT.search(line)
        if found and "SUMMARY" not in line:
            what, locations = found.group(1).strip(), []
            continue
        found = (ACCESS if tool == "racecheck" else LOCATION).search(line)
        if found and what:
            locations.append(found.groups())
            if len(locations) == (2 if tool == "racecheck" else 1):
                key = (what, locations[0][0], *(location for _, location in locations))
                groups[key] = groups.get(key, 0) + 1
                what = None
    return groups


def source_line(location: str) -> str:
    name, line = location.rsplit(":", 1)
    for folder in (REPO_ROOT / "torch-ext" / "flash_attention" / "flash_attention_kernel", REPO_ROOT / "scripts"):
        if (folder / name).exists() and int(line) > 0:
            return (folder / name).read_text().splitlines()[int(line) - 1]
    return ""


def triton_part(tool: str, locations) -> str:
    """Which part of Triton's code generation a report lies in ('' if none): the warp-specialisation
    dispatch (racecheck, both accesses at a kernel's def line or its warp_specialize call) or a
    device-side descriptor's creation (initcheck, a make_tensor_descriptor call)."""
    lines = [source_line(location) for location in locations]
    if tool == "racecheck" and all(text.lstrip().startswith("def ") or "warp_specialize(" in text for text in lines):
        return "warp_specialize dispatch"
    if tool == "initcheck" and all("make_tensor_descriptor(" in text for text in lines):
        return "descriptor creation"
    return ""


def classify(tool: str, output: str, summary_errors: int) -> int:
    """A tool's errors after printing its reports grouped by kernel and source: those in a part
    of Triton's code generation (``triton_part``) are not counted when the control kernels show
    the same part; all count if some reports were not printed or the summary is missing."""
    groups = reports(tool, output)
    shown_by_controls = {triton_part(tool, key[2:]) for key in groups if key[1].endswith("_control")}
    counted = 0
    for key, count in sorted(groups.items(), key=lambda item: -item[1]):
        part = triton_part(tool, key[2:])
        excused = part and part in shown_by_controls
        counted += 0 if excused else count
        label = f"Triton's {part}" + ("" if excused else ", NOT in the controls") if part else "ERROR"
        print(f"  {tool} [{label}]: {count} x {key[0]} in {key[1]} at {' / '.join(key[2:])}")
    printed = sum(groups.values())
    if summary_errors < 0 or printed < summary_errors:
        print(f"  {tool}: {printed} reports parsed of {summary_errors}: every error counts")
        return max(summary_errors, printed, 1)
    return counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ", ".join(TOOLS))
    parser.add_argument("--tool-seconds", type=int, default=110, help="time limit of each tool's run")
    parser.add_argument("--cases", action="store_true", help="run the cases in this process (what each tool runs)")
    parser.add_argument("--only", default="", help="run only the cases whose names match this regular expression")
    args = parser.parse_args()
    if args.cases:
        run_cases(args.only)
        return 0
    tools = [tool for tool in args.tools.split(",") if tool]
    unknown = set(tools) - set(TOOLS)
    if unknown:
        parser.error(f"unknown tools {sorted(unknown)}; choose from {TOOLS}")
    sanitizer = find_sanitizer()
    folder = log_dir()
    start = time.time()
    plain = subprocess.run([sys.executable, __file__, "--cases", "--only", args.only], capture_output=True, text=True)
    (folder / "sanitize-plain.log").write_text(plain.stdout + plain.stderr)
    if plain.returncode != 0 or "CASES DONE" not in plain.stdout:
        print(f"the cases fail without a sanitizer:\n{plain.stderr[-4000:]}")
        return 1
    print(f"plain run (compiles every kernel): {time.time() - start:.0f} s", flush=True)
    clean = [run_tool(sanitizer, tool, folder, args.tool_seconds, args.only) for tool in tools]
    print(f"sanitize: {sum(clean)}/{len(clean)} tools clean; logs in {folder}")
    return 0 if all(clean) else 1


# --------------------------------------------------------------------------------------------
# the cases (run under each tool)


def load_package():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import build_variants
    import kernels

    return kernels.get_local_kernel(build_variants.build(out_dir=Path(tempfile.mkdtemp(prefix="fa-sanitize-"))))


def run_cases(only: str = ""):
    import torch

    fa = load_package()
    device = "cuda"
    hopper = torch.cuda.get_device_capability()[0] == 9
    names = []

    def case(name) -> bool:
        """Whether to run the case ``name`` (``--only``); prints its CASE line if so."""
        if only and not re.search(only, name):
            return False
        names.append(name)
        print(f"CASE {name}", flush=True)
        return True

    def qkv(shape_q, shape_kv, dtype, grad=True):
        return [torch.randn(shape, device=device, dtype=dtype).requires_grad_(grad)
                for shape in (shape_q, shape_kv, shape_kv)]

    def dense(name, dtype, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, **options):
        if not case(name):
            return
        q, k, v = qkv((2, seqlen_q, heads_q, head_dim), (2, seqlen_k, heads_k, head_dim), dtype)
        sinks = options.pop("sinks", False)
        if sinks:
            options["s_aux"] = torch.randn(heads_q, device=device, requires_grad=True)
        if options.pop("alibi", False):
            options["alibi_slopes"] = torch.rand(2, heads_q, device=device) * 0.3
        result = fa.flash_attn_func(q, k, v, return_attn_probs=options.get("dropout_p", 0) > 0, **options)
        out = result[0] if isinstance(result, tuple) else result
        leaves = [q, k, v] + ([options["s_aux"]] if sinks else [])
        torch.autograd.grad(out, leaves, torch.randn_like(out))

    options_sets = {
        "plain": {}, "causal": dict(causal=True), "window": dict(window_size=(37, 5)),
        "softcap_alibi": dict(causal=True, softcap=12.0, alibi=True), "sinks": dict(window_size=(40, 0), sinks=True),
        "dropout": dict(causal=True, dropout_p=0.17), "everything": dict(causal=True, window_size=(61, 0), softcap=9.0,
                                                                          alibi=True, sinks=True, dropout_p=0.2),
    }
    if hopper:  # what Triton's code generation alone shows (the module docstring), on fresh memory
        import sanitizer_controls  # (scripts/, on sys.path since load_package)

        if case("control: Triton's warp_specialize dispatch alone"):
            sanitizer_controls.warp_specialize()
        if case("control: Triton's warp_specialize dispatch around a TMA ring"):
            sanitizer_controls.warp_specialize_ring()
        if case("control: a device-side tensor descriptor alone"):
            sanitizer_controls.tensor_descriptor()
    # Triton's descriptor creation reads its scratch before writing it (the control above, on
    # torch.empty scratch): the cases' scratch is zero-filled, so that initcheck's reports (and
    # its error buffer) are the kernels' own reads
    # (the package installs its allocator per thread, the autograd thread included: patch it too)
    import triton

    launch = fa.flash_attention_kernel.launch
    launch._torch_scratch = lambda size, alignment, stream: torch.zeros(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(launch._torch_scratch)
    # tl kernels: awkward sizes, each dtype, head dims off the powers of two
    for option_name, options in options_sets.items():
        dense(f"tl fp16 d40 {option_name}", torch.float16, 37, 45, 4, 2, 40, **options)
    dense("tl bf16 d128 causal, rows without keys", torch.bfloat16, 67, 23, 3, 1, 128, causal=True)
    dense("tl fp32 d80 everything", torch.float32, 29, 51, 2, 2, 80, **options_sets["everything"])
    dense("tl fp16 d256 dropout", torch.float16, 19, 33, 2, 1, 256, dropout_p=0.3)
    dense("tl bf16 d59 window", torch.bfloat16, 130, 77, 2, 2, 59, window_size=(3, 2))
    dense("tl bf16 d96 full key tiles (warp-specialised loop where taken)", torch.bfloat16, 200, 256, 2, 2, 96,
          causal=True)
    dense("tl fp16 d1 seqlen 1", torch.float16, 1, 1, 1, 1, 1)

    # packed entry points
    if case("qkvpacked fp16 d64 causal dropout"):
        qkv_packed = torch.randn(2, 41, 3, 2, 64, device=device, dtype=torch.float16, requires_grad=True)
        out = fa.flash_attn_qkvpacked_func(qkv_packed, causal=True, dropout_p=0.1)
        torch.autograd.grad(out, qkv_packed, torch.randn_like(out))
    if case("kvpacked bf16 d72 window"):
        q = torch.randn(2, 33, 4, 72, device=device, dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 50, 2, 2, 72, device=device, dtype=torch.bfloat16, requires_grad=True)
        out = fa.flash_attn_kvpacked_func(q, kv, window_size=(7, 7))
        torch.autograd.grad(out, (q, kv), torch.randn_like(out))

    # varlen (preprocess kernel in the backward), with empty sequences, and every option
    lens_q, lens_k = [5, 0, 37, 1, 64], [0, 11, 45, 1, 70]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (lens_q, lens_k))
    for option_name in ("causal", "everything"):
        if case(f"varlen fp16 d48 {option_name}"):
            options = dict(options_sets[option_name])
            q, k, v = qkv((sum(lens_q), 4, 48), (sum(lens_k), 2, 48), torch.float16)
            if options.pop("alibi", False):
                options["alibi_slopes"] = torch.rand(4, device=device) * 0.3
            if options.pop("sinks", False):
                options["s_aux"] = torch.randn(4, device=device)
            result = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 70, return_attn_probs=True, **options)
            torch.autograd.grad(result[0], (q, k, v), torch.randn_like(result[0]))

    # paged varlen forward
    if case("paged varlen bf16 d64 causal softcap"):
        with torch.no_grad():
            pages = torch.randn(2, 12, 16, 2, 64, device=device, dtype=torch.bfloat16)
            table = torch.randperm(12, device=device)[:10].view(5, 2).to(torch.int32)
            q = torch.randn(sum(lens_q), 4, 64, device=device, dtype=torch.bfloat16)
            cu_paged = torch.tensor([0, 3, 35, 60, 61, 93], dtype=torch.int32, device=device)
            fa.flash_attn_varlen_func(q, pages[0], pages[1], cu_q, cu_paged, 64, 32, causal=True, softcap=20.0,
                                      block_table=table)

    # KV cache: decode + append + rotary + split-KV + merge; contiguous and paged; leftpad, batch_idx
    with torch.no_grad():
        for paged in (False, True):
            for num_splits in (1, 3, 0):
                if case(f"kvcache {'paged' if paged else 'contiguous'} num_splits {num_splits}"):
                    heads_q, heads_k, head_dim, capacity = 8, 2, 80, 96
                    if paged:
                        caches = torch.randn(2, 20, 16, heads_k, head_dim, device=device, dtype=torch.float16)
                        table = torch.randperm(20, device=device)[:18].view(3, 6).to(torch.int32)
                        extra = dict(block_table=table)
                    else:
                        caches = torch.randn(2, 4, capacity, heads_k, head_dim, device=device, dtype=torch.float16)
                        extra = dict(cache_batch_idx=torch.tensor([2, 0, 3], dtype=torch.int32, device=device),
                                     cache_leftpad=torch.tensor([0, 3, 1], dtype=torch.int32, device=device))
                    q = torch.randn(3, 3, heads_q, head_dim, device=device, dtype=torch.float16)
                    k, v = (torch.randn(3, 3, heads_k, head_dim, device=device, dtype=torch.float16) for _ in range(2))
                    angles = torch.rand(capacity, 16, device=device)
                    fa.flash_attn_with_kvcache(
                        q, caches[0], caches[1], k, v, angles.cos().half(), angles.sin().half(),
                        cache_seqlens=torch.tensor([0, 40, 93], dtype=torch.int32, device=device), causal=True,
                        window_size=(50, 0), softcap=15.0, alibi_slopes=torch.rand(heads_q, device=device) * 0.2,
                        s_aux=torch.randn(heads_q, device=device), num_splits=num_splits, rotary_interleaved=paged,
                        return_softmax_lse=True, **extra)
        if case("kvcache decode, no new keys, int cache_seqlens"):
            caches = torch.randn(2, 2, 77, 1, 128, device=device, dtype=torch.bfloat16)
            fa.flash_attn_with_kvcache(torch.randn(2, 1, 4, 128, device=device, dtype=torch.bfloat16), caches[0],
                                       caches[1], cache_seqlens=70)

    # rotary embeddings
    if case("rotary dense / varlen / in place / interleaved / tensor offsets"):
        x = torch.randn(2, 37, 3, 64, device=device, dtype=torch.float16)
        angles = torch.rand(80, 24, device=device)
        cos, sin = angles.cos().half(), angles.sin().half()
        fa.apply_rotary_emb(x, cos, sin, seqlen_offsets=5)
        fa.apply_rotary_emb(x, cos, sin, interleaved=True, inplace=True,
                            seqlen_offsets=torch.tensor([0, 40], dtype=torch.int32, device=device))
        fa.apply_rotary_emb(x.view(-1, 3, 64), cos, sin, cu_seqlens=torch.tensor([0, 30, 74], dtype=torch.int32,
                                                                               device=device), max_seqlen=44)

    # Gluon Hopper kernels (sm_90): dense bf16, head dims 64 and 128, full 128-row tiles
    if hopper:
        for head_dim in (64, 128):
            for option_name, options in options_sets.items():
                dense(f"gluon bf16 d{head_dim} {option_name}", torch.bfloat16, 256, 384, 4, 2, head_dim,
                      **{**options, **({"window_size": (128, 0)} if "window_size" in options else {})})
        gluon = fa.flash_attention_kernel.hopper_gluon
        assert gluon.gluon is not None, "this Triton has no Gluon: the Hopper kernels were not reached"
    else:
        print("(not an sm_90 GPU: the Gluon Hopper kernels are not reached)", flush=True)
    torch.cuda.synchronize()
    print(f"CASES DONE: {len(names)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
