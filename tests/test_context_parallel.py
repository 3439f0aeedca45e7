"""Long context across ranks on the engines people use, with this package standing in for
flash-attn (install_as_flash_attn): ring-flash-attn (ring, zigzag ring, llama3 varlen),
yunchang (Ulysses, its ring) and, experimental, PyTorch's context_parallel running this kernel
(kernels_in_torch_context_parallel), two ranks, no change to the engines' code. Every rank's shard of the
output and of every gradient is checked against the whole problem on one rank (context_parallel.py
says how). Two GPUs run it over NCCL; elsewhere two CPU processes over gloo, through Triton's
interpreter."""

import pytest

from context_parallel import CASES, ranks_on_gpus, run_ranks


@pytest.mark.parametrize("case", CASES)
def test_engine_on_two_ranks_matches_one(build_dir, case):
    if not ranks_on_gpus(2):
        import numpy
        import triton
        from triton_matrix import interpreter_runs  # (scripts/, on sys.path from conftest)
        if not interpreter_runs(triton.__version__):  # (a one-GPU host's image: Triton 3.6 beside NumPy 2.4)
            pytest.skip(f"CPU ranks need the interpreter, and Triton {triton.__version__}'s cannot run these "
                        f"kernels beside NumPy {numpy.__version__}; two GPUs or a newer Triton run this case")
    reports = run_ranks(case, build_dir, world_size=2)
    failures = {rank: report for rank, report in reports.items() if report != "ok"}
    assert not failures, "\n".join(f"rank {rank}:\n{report}" for rank, report in failures.items())
