"""benchmarks/triton_parity.py compares two runs of the grid (two Triton releases) point by point.
Synthetic runs with known ratios check its table, median, lowest point and the points below the
bar (CPU only, no kernel)."""

import json

import pytest

from conftest import benchmark_module


@pytest.fixture(scope="module")
def parity():
    return benchmark_module("triton_parity")


def _run(triton, rates):
    """Rows of a run: one per (seqlen, direction), at the given TFLOP/s."""
    return [dict(dtype="bf16", head_dim=128, causal=True, seqlen=seqlen, direction=direction, kernels="default",
                 triton=triton, tflops=rate) for (seqlen, direction), rate in rates.items()]


def test_compare_ratios_median_lowest_and_below_bar(parity):
    base = _run("3.6.0", {(2048, "fwd"): 500.0, (2048, "bwd"): 400.0, (4096, "fwd"): 600.0, (4096, "bwd"): 450.0})
    new = _run("3.9.0", {(2048, "fwd"): 475.0, (2048, "bwd"): 404.0, (4096, "fwd"): 600.0,
                         (8192, "fwd"): 1.0})  # (a point the base lacks is left out)
    lines, median, (lowest, at), below = parity.compare(base, new, bar=0.97)
    assert len(lines) == 2 + 3
    assert median == pytest.approx(1.0) and lowest == pytest.approx(0.95)
    assert dict(zip(parity.POINT, at))["seqlen"] == 2048 and len(below) == 1
    assert "| 0.950 |" in lines[2]


def test_compare_needs_a_shared_point(parity):
    with pytest.raises(ValueError, match="share no point"):
        parity.compare(_run("3.6.0", {(2048, "fwd"): 1.0}), _run("3.9.0", {(4096, "fwd"): 1.0}))


def test_command_line_compare(parity, tmp_path, capsys):
    paths = []
    for name, rate in (("base", 400.0), ("new", 392.0)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in _run(name, {(2048, "bwd"): rate})))
        paths.append(str(path))
    parity.main(["--compare", *paths])
    printed = capsys.readouterr().out
    assert "median 0.980, lowest 0.980" in printed and "0 of 1 points below 0.97" in printed


def test_several_runs_a_side_take_each_points_median(parity, tmp_path, capsys):
    paths = {}
    for name, rates in (("base1", (400.0, 500.0)), ("base2", (410.0, 520.0)), ("base3", (390.0, 510.0)),
                        ("new1", (380.0, 505.0)), ("new2", (384.0, 495.0))):
        path = tmp_path / f"{name}.jsonl"
        rows = _run(name, {(2048, "bwd"): rates[0], (4096, "bwd"): rates[1]})
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        paths[name] = str(path)
    parity.main(["--compare", ",".join(paths[n] for n in ("base1", "base2", "base3")),
                 ",".join(paths[n] for n in ("new1", "new2"))])
    printed = capsys.readouterr().out
    # medians: base 400 / 510, new 382 / 500 -> 0.955 and 0.980
    assert "| 0.955 |" in printed and "| 0.980 |" in printed and "1 of 2 points below 0.97" in printed
