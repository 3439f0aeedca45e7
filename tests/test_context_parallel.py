"""Long context across ranks on the engines people use, with this package standing in for
flash-attn (install_as_flash_attn): ring-flash-attn (ring, zigzag ring, llama3 varlen),
yunchang (Ulysses, its ring) and, experimental, PyTorch's context_parallel running this kernel
(kernels_in_torch_context_parallel), two ranks, no change to the engines' code. Every rank's shard of the
output and of every gradient is checked against the whole problem on one rank (context_parallel.py
says how). Two GPUs run it over NCCL; elsewhere two CPU processes over gloo, through Triton's
interpreter."""

import pytest

from conftest import skip_unless_interpreter_runs
from context_parallel import CASES, ranks_on_gpus, run_ranks


@pytest.mark.parametrize("case", CASES)
def test_engine_on_two_ranks_matches_one(build_dir, case):
    if not ranks_on_gpus(2):  # (a one-GPU host's image: Triton 3.6 beside NumPy 2.4; two GPUs run the case)
        skip_unless_interpreter_runs("fewer GPUs than ranks: the ranks are CPU ranks through the interpreter")
    reports = run_ranks(case, build_dir, world_size=2)
    failures = {rank: report for rank, report in reports.items() if report != "ok"}
    assert not failures, "\n".join(f"rank {rank}:\n{report}" for rank, report in failures.items())
