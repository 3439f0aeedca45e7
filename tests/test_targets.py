"""benchmarks/targets.py reads bench_flash_attention.py's summary.csv and says which performance
targets hold. A synthetic summary with known ratios checks its verdicts (CPU only, no kernel)."""

import csv

import pytest

from conftest import benchmark_module

FIELDS = ["direction", "dtype", "head_dim", "causal", "seqlen", "triton-fa", "sdpa-flash", "sdpa-cudnn",
          "sdpa-efficient", "flex"]


@pytest.fixture(scope="module")
def targets():
    return benchmark_module("targets")


def _summary(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _row(direction, head_dim, seqlen, ours, flash, cudnn, flex="n/a", causal=True):
    return {"direction": direction, "dtype": "bf16", "head_dim": head_dim, "causal": causal, "seqlen": seqlen,
            "triton-fa": ours, "sdpa-flash": flash, "sdpa-cudnn": cudnn, "sdpa-efficient": 100.0, "flex": flex}


def _verdicts(text):
    """target label -> (worst ratio text, points met, holds) from the report's target table."""
    table = text.split("| target |")[1].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table)}


def test_hopper_targets_and_missing_peers(targets, tmp_path):
    rows = [_row("fwd", 128, 2048, 630.0, 400.0, 600.0, flex=500.0),  # 1.05x CUDNN: holds
            _row("fwd", 128, 16384, 700.0, 500.0, 680.0, flex=600.0),  # 1.03x CUDNN: misses 1.05
            _row("bwd", 128, 4096, 500.0, 400.0, 500.0),  # 1.0x CUDNN: holds; flex n/a
            _row("bwd", 64, 2048, 380.0, 300.0, 400.0, flex="")]  # 0.95x CUDNN: holds
    verdicts = _verdicts(targets.report(targets.read(_summary(tmp_path / "s.csv", rows))))
    assert verdicts["42: fwd >= 1.05x CUDNN, d128, N >= 2k"] == ["1.03 (fwd bf16 d128 causal N=16384)", "1/2", "no"]
    assert verdicts["42: bwd >= 1.0x CUDNN, d128, N >= 2k"][1:] == ["1/1", "yes"]
    assert verdicts["42: bwd >= 0.95x CUDNN, d64, N >= 2k"][1:] == ["1/1", "yes"]
    assert verdicts["42: fwd >= 1.0x CUDNN, d64, N >= 2k"] == ["no point", "0/0", "n/a"]
    assert verdicts["4: fwd ahead of Flex, everywhere"][1:] == ["2/2", "yes"]
    assert verdicts["4: bwd ahead of Flex, everywhere"] == ["no point", "0/0", "n/a"]  # (no flex number)


def test_ampere_odd_head_dims_and_baseline(targets, tmp_path):
    rows = [_row("fwd", 128, 2048, 300.0, 300.0, 250.0), _row("bwd", 64, 4096, 190.0, 200.0, 150.0),
            _row("fwd", 96, 2048, 270.0, 280.0, 240.0), _row("fwd", 192, 2048, 250.0, 280.0, 240.0),
            _row("fwd", 256, 2048, 200.0, 210.0, 190.0)]
    baseline = [_row("fwd", 128, 2048, 309.0, 300.0, 250.0), _row("bwd", 64, 4096, 190.0, 200.0, 150.0),
                _row("fwd", 128, 8192, 999.0, 1.0, 1.0)]  # (a point only the baseline has: left out)
    summary = targets.read(_summary(tmp_path / "s.csv", rows))
    text = targets.report(summary, "ampere", targets.read(_summary(tmp_path / "b.csv", baseline)))
    verdicts = _verdicts(text)
    assert verdicts["42: fwd >= 1.0x SDPA FLASH (FA2), d64/d128, N >= 2k"][1:] == ["1/1", "yes"]
    assert verdicts["42: bwd >= 0.95x SDPA FLASH (FA2), d64/d128, N >= 2k"][1:] == ["1/1", "yes"]
    # d96 at 270 / 300 = 0.90 of d128 holds; d192 at 250 / 200 of d256 holds; d256 has no larger one
    assert verdicts["42: d80/96/192 >= 0.85x the next power of two's TFLOP/s"][1:] == ["2/2", "yes"]
    assert verdicts["42: within 3% of the baseline's TFLOP/s"] == ["0.97 (fwd bf16 d128 causal N=2048)", "2/2",
                                                                    "yes"]
