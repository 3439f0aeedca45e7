"""benchmarks/ncu_stalls.py summarises Nsight Compute's source page (``ncu --page source --csv
--print-source sass``). A synthetic page of two kernels, in that CSV's layout, checks what it reads
(CPU only, no profiler)."""

import csv

from conftest import benchmark_module

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "L1 Conflicts Shared N-Way", "L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared", "stall_barrier",
          "stall_long_sb", "stall_barrier (Not Issued)"]


def _page(path):
    rows = [["Kernel Name", "_preprocess_kernel"], HEADER,
            ["0x10", "  LDG.E R2, [R4]", "5", "8", "0", "0", "0", "1", "4", "1"],
            ["Kernel Name", "_dkdv_kernel"], HEADER,
            ["0x20", "  NOP", "50", "32", "0", "0", "0", "50", "0", "50"],
            ["0x30", "  STS.64 [R0+0x28000], R152", "30", "64", "8", "384", "512", "0", "30", "0"],
            ["0x40", "  STS.64 [R0+0x28800], R154", "20", "64", "4", "128", "256", "0", "20", "0"],
            ["0x50", "  HGMMA.64x64x16.F32.BF16 R152, gdesc[UR4]", "", "16", "", "", "", "", "", ""]]
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return path


def test_summarise_reads_one_kernels_samples_and_conflicts(tmp_path):
    stalls = benchmark_module("ncu_stalls")
    page = _page(tmp_path / "source.csv")
    (kernel,) = stalls.summarise(page, "dkdv", top=2)
    assert kernel["name"] == "_dkdv_kernel" and kernel["instructions"] == 4 and kernel["samples"] == 100
    assert (kernel["shared"], kernel["excessive"]) == (768, 512)
    assert kernel["stalls"] == {"long_sb": 0.5, "barrier": 0.5}  # (the Not Issued columns left out)
    assert [c[0] for c in kernel["conflicts"]] == ["0x30", "0x40"] and kernel["conflicts"][0][2:4] == (384, "8")
    assert [(w[0], w[2]) for w in kernel["waits"]] == [("0x20", 0.5), ("0x30", 0.3)]
    assert kernel["waits"][1][3][0] == (30, "long_sb")
    assert [k["name"] for k in stalls.summarise(page)] == ["_preprocess_kernel", "_dkdv_kernel"]
