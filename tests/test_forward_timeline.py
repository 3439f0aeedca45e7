"""benchmarks/forward_timeline.py adds clock64 probes to a copy of the Gluon forward and sums up what
they record. On the CPU: its probes still find their places in the kernel (each anchor once, so a
change to hopper_forward.py that moves one fails here, not on the device), and a synthetic
timeline of known intervals reads back as those intervals."""

import pytest
import torch

from conftest import PACKAGE_SOURCE, benchmark_module


@pytest.fixture(scope="module")
def timeline():
    return benchmark_module("forward_timeline")


def test_probes_find_their_places_in_the_forward_kernel(timeline):
    source = (PACKAGE_SOURCE / "flash_attention_kernel" / "hopper_forward.py").read_text()
    probed = timeline.probed_source(source)
    assert all(f"_mark(slot, {slot} + WG * 5" in probed for slot in range(1, 6))
    assert probed.count("TIMELINE") == 2 and "Timeline," in probed
    with pytest.raises(ValueError, match="the epilogue's store"):
        timeline.probed_source(source.replace("store_chunks(Out + out_base", "store_rows(Out + out_base"))


def test_summary_reads_each_interval(timeline):
    # two SMs, two programs each: per warpgroup start, Q (+100), first P (+300), last P V (+tiles
    # x 1000), end (+50); the second warpgroup 20 cycles later; the next program 40 after the last end
    rows = []
    for sm in (0, 1):
        clock = 10_000 * sm
        for tiles in (4, 6):
            row = [sm] + [0] * 15
            for w, delay in ((0, 0), (1, 20)):
                start = clock + delay
                row[1 + 5 * w: 6 + 5 * w] = [start, start + 100, start + 400, start + 400 + (tiles - 1) * 1000,
                                             start + 450 + (tiles - 1) * 1000]
            row[11] = tiles
            rows.append(row)
            clock = row[10] + 40
    summary = timeline.summarise(torch.tensor(rows))
    assert summary["q_wait"] == 100 and summary["first_tile"] == 300 and summary["epilogue"] == 50
    assert summary["per_tile"] == 1000 and summary["end_skew"] == 20 and summary["gap"] == 40
    assert summary["total"] == (3470 + 5470) / 2  # (the programs' 470 + (tiles - 1) x 1000, 4 and 6 tiles)
    assert summary["busy"] == pytest.approx((3470 + 5470) / (3470 + 40 + 5470))
