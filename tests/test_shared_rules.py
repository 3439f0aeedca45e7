"""The rules the tl and the Gluon kernels share (flash_attention_kernel/rules.py), checked three ways.

1. The host instantiation (the same source over Python integers and numpy arrays,
   ``rules.instantiate(HOST)``) against an independent statement of what the rule must compute:
   ``band_tiles`` by brute force over positions (every visible position's tile visited exactly
   once, no other tile but one masked tile where nothing is visible, full tiles seen in full by
   every index), ``philox_rounds`` against
   test_dropout_draws' Philox-4x32 written out in numpy.
2. The tl instantiation (scores.py's) against the host one over the same grid: on the CPU
   interpreter and on a GPU (there also the mul.wide.u32 form of Philox and tanh.approx).
3. The Gluon instantiation (hopper_gluon.py's) against the host one, on a GPU whose Triton builds
   the Gluon kernels (Gluon has no interpreter).
"""

import itertools
import random
import sys
import types

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, ON_GPU, PACKAGE_SOURCE
from test_dropout_draws import philox_4x32

sys.path.insert(0, str(PACKAGE_SOURCE))
from flash_attention_kernel import rules, scores  # noqa: E402  (the source the built package copies)

try:  # the Gluon instantiation: hopper_gluon's (imported here, as the kernels' route does, only if Gluon builds)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from flash_attention_kernel import hopper_gluon
except Exception:  # (a Triton whose Gluon cannot build the Hopper kernels' module: hopper_route says so)
    gluon = None

CASES = 1024  # one program's worth of cases per probe launch


def _umulhi(a, b):
    return ((np.asarray(a, dtype=np.uint64) * np.uint64(b)) >> np.uint64(32)).astype(np.uint32)


# The host "language": what the rules call, on Python integers (band_tiles) and uint32 arrays (Philox)
HOST = types.SimpleNamespace(
    minimum=min, maximum=max, where=lambda condition, a, b: a if condition else b,
    cdiv=lambda a, b: -(-a // b), umulhi=_umulhi, static_range=range, float32=float, uint32=np.uint32,
)
HOST_RULES = rules.instantiate(HOST)

# (HAS_BELOW, HAS_ABOVE, UPPER_LOOP) as the kernels call band_tiles: the tl kernels always run the
# upper masked loop; the Gluon kernels run it only with an upper edge
BAND_FORMS = [(below, above, True) for below, above in itertools.product((False, True), repeat=2)] + \
             [(below, False, False) for below in (False, True)]
BLOCKS = (16, 64)


def _band_cases(block, upper_loop, count=CASES, seed=0):
    """(first, last, below, above, length) cases: blocks of 1 to 2 * block indices, bands from
    empty to wider than the length, edges before, across and past it; lengths multiples of the
    block where the kernel runs no upper loop (the Gluon kernels' full tiles)."""
    rng = random.Random(seed * 7919 + block)
    cases = []
    lengths = [1, 5, block - 1, block, block + 1, 3 * block - 7, 5 * block, 203]
    while len(cases) < count:
        length = rng.choice(lengths)
        if not upper_loop:
            length = max(block, -(-length // block) * block)
        first = rng.randrange(0, length + block)
        last = first + rng.choice([0, 1, block - 1, 2 * block - 1, rng.randrange(0, 2 * block)])
        below = rng.randrange(-length - block, length + block)
        above = below + rng.choice([0, 1, block, rng.randrange(0, 2 * length + 2)])
        cases.append((first, last, below, above, length))
    return cases


def _tiles(start, end, block):
    return list(range(start, end, block)) if end > start else []


def _check_band_contract(case, ranges, block, has_below, has_above, upper_loop):
    first, last, below, above, length = case
    lo, full_lo, full_hi, hi = ranges
    assert lo % block == full_lo % block == full_hi % block == 0 and lo <= full_lo <= full_hi <= hi, ranges
    if not upper_loop:
        assert full_hi == hi, f"no upper loop, yet tiles in [full_hi, hi): {ranges}"

    def seen(x, y):
        return 0 <= y < length and (not has_below or y >= x + below) and (not has_above or y <= x + above)

    visited = _tiles(lo, full_lo, block) + _tiles(full_lo, full_hi, block) + _tiles(full_hi, hi, block)
    assert len(visited) == len(set(visited)), f"a tile visited twice: {ranges}"
    needed = {y // block * block for x in range(first, last + 1) for y in range(length) if seen(x, y)}
    # (a block that sees nothing, its band past the end, may visit one masked tile: masked to -inf, it adds 0)
    assert set(visited) == needed or (not needed and len(visited) <= 1 and lo == full_lo == full_hi), \
        f"visited {sorted(visited)}, visible tiles {sorted(needed)}: {ranges}"
    for tile in _tiles(full_lo, full_hi, block):
        assert all(seen(x, y) for x in range(first, last + 1) for y in range(tile, tile + block)), \
            f"full tile {tile} not seen in full: {ranges}"


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("has_below, has_above, upper_loop", BAND_FORMS)
def test_host_band_tiles_visit_exactly_the_visible_tiles(block, has_below, has_above, upper_loop):
    for case in _band_cases(block, upper_loop, count=300):
        ranges = HOST_RULES.band_tiles(*case, block, has_below, has_above, upper_loop)
        _check_band_contract(case, ranges, block, has_below, has_above, upper_loop)


def _philox_inputs(count=CASES, seed=1):
    rng = np.random.default_rng(seed)
    counters = [rng.integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32) for _ in range(4)]
    counters[0][:4] = [0, 1, 0xFFFFFFFF, 0x80000000]
    keys = [rng.integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32) for _ in range(2)]
    return counters, keys


def test_host_philox_rounds_are_philox_4x32_7():
    counters, (k0, k1) = _philox_inputs()
    ours = HOST_RULES.philox_rounds(*counters, k0, k1, False)
    for row in range(0, CASES, 97):
        seed = int(k0[row]) | int(k1[row]) << 32
        expected = philox_4x32(seed, [c[row:row + 1] for c in counters], rounds=rules.PHILOX_ROUNDS.value)
        assert [int(word[row]) for word in ours] == [int(word[0]) for word in expected]


# -- the tl and Gluon instantiations against the host one ------------------------------------------------

def _as_int32(array):
    return torch.from_numpy(np.asarray(array, dtype=np.int64).astype(np.uint32).view(np.int32)).to(DEVICE)


def _band_inputs(block, upper_loop):
    cases = _band_cases(block, upper_loop)
    return cases, torch.tensor(cases, dtype=torch.int32, device=DEVICE).T.contiguous()


def _host_bands(cases, block, form):
    return torch.tensor([HOST_RULES.band_tiles(*case, block, *form) for case in cases], dtype=torch.int32).T


@triton.jit
def _tl_band_kernel(Cases, Out, BLOCK: tl.constexpr, HAS_BELOW: tl.constexpr, HAS_ABOVE: tl.constexpr,
                    UPPER_LOOP: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    first, last, below = tl.load(Cases + offs), tl.load(Cases + N + offs), tl.load(Cases + 2 * N + offs)
    above, length = tl.load(Cases + 3 * N + offs), tl.load(Cases + 4 * N + offs)
    lo, full_lo, full_hi, hi = scores.band_tiles(first, last, below, above, length, BLOCK, HAS_BELOW, HAS_ABOVE,
                                                 UPPER_LOOP)
    zero = offs * 0
    tl.store(Out + offs, lo + zero)
    tl.store(Out + N + offs, full_lo + zero)
    tl.store(Out + 2 * N + offs, full_hi + zero)
    tl.store(Out + 3 * N + offs, hi + zero)


@triton.jit
def _tl_philox_kernel(Counters, Keys, Out, WIDE: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, N)
    c0 = tl.load(Counters + offs).to(tl.uint32, bitcast=True)
    c1 = tl.load(Counters + N + offs).to(tl.uint32, bitcast=True)
    c2 = tl.load(Counters + 2 * N + offs).to(tl.uint32, bitcast=True)
    c3 = tl.load(Counters + 3 * N + offs).to(tl.uint32, bitcast=True)
    k0, k1 = tl.load(Keys + offs).to(tl.uint32, bitcast=True), tl.load(Keys + N + offs).to(tl.uint32, bitcast=True)
    r0, r1, r2, r3 = scores.philox_rounds(c0, c1, c2, c3, k0, k1, WIDE)
    tl.store(Out + offs, r0.to(tl.int32, bitcast=True))
    tl.store(Out + N + offs, r1.to(tl.int32, bitcast=True))
    tl.store(Out + 2 * N + offs, r2.to(tl.int32, bitcast=True))
    tl.store(Out + 3 * N + offs, r3.to(tl.int32, bitcast=True))


@triton.jit
def _tl_tanh_kernel(X, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, scores.tanh_approx(tl.load(X + offs)))


def _run_band(kernel_launch, block, form):
    cases, inputs = _band_inputs(block, form[2])
    out = torch.full((4, CASES), -7, dtype=torch.int32, device=DEVICE)  # poisoned
    kernel_launch(inputs, out)
    torch.testing.assert_close(out.cpu(), _host_bands(cases, block, form), rtol=0, atol=0)


def _run_philox(kernel_launch, wide):
    counters, keys = _philox_inputs()
    out = torch.zeros(4, CASES, dtype=torch.int32, device=DEVICE)
    kernel_launch(_as_int32(np.stack(counters)), _as_int32(np.stack(keys)), out, wide)
    expected = HOST_RULES.philox_rounds(*counters, *keys, False)
    assert (out.cpu().numpy().view(np.uint32) == np.stack(expected)).all()


def _tanh_inputs():
    x = torch.linspace(-12.0, 12.0, CASES, dtype=torch.float64)
    x[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-7, 0.3, 30.0, -300.0, float("inf")], dtype=torch.float64)
    return x.float().to(DEVICE)


def _check_tanh(out, x):
    truth = torch.tanh(x.double().cpu())
    assert torch.all((out.double().cpu() - truth).abs() <= 2 ** -10.5 * truth.abs() + 2 ** -20), \
        "tanh.approx.f32 beyond its documented 2^-11 relative error"


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("form", BAND_FORMS, ids=lambda form: "below{}_above{}_upper{}".format(*map(int, form)))
def test_tl_band_tiles_match_the_host(block, form):
    _run_band(lambda inputs, out: _tl_band_kernel[(1,)](inputs, out, block, *form, N=CASES), block, form)


# the mul.wide.u32 form is inline asm: compiled kernels only
PHILOX_WIDE = [False, True] if ON_GPU else [False]


@pytest.mark.parametrize("wide", PHILOX_WIDE, ids=lambda wide: "wide" if wide else "mul_hi_lo")
def test_tl_philox_rounds_match_the_host(wide):
    _run_philox(lambda counters, keys, out, wide: _tl_philox_kernel[(1,)](counters, keys, out, wide, N=CASES), wide)


@pytest.mark.skipif(not ON_GPU, reason="tanh.approx.f32 is inline PTX: compiled kernels only")
def test_tl_tanh_approx_within_its_error():
    x = _tanh_inputs()
    out = torch.empty_like(x)
    _tl_tanh_kernel[(1,)](x, out, N=CASES)
    _check_tanh(out, x)


if gluon is not None:
    _LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # (launched with num_warps=4)

    @gluon.jit
    def _gluon_band_kernel(Cases, Out, BLOCK: gl.constexpr, HAS_BELOW: gl.constexpr, HAS_ABOVE: gl.constexpr,
                           UPPER_LOOP: gl.constexpr, N: gl.constexpr):
        offs = gl.arange(0, N, _LAYOUT)
        first, last, below = gl.load(Cases + offs), gl.load(Cases + N + offs), gl.load(Cases + 2 * N + offs)
        above, length = gl.load(Cases + 3 * N + offs), gl.load(Cases + 4 * N + offs)
        lo, full_lo, full_hi, hi = hopper_gluon.band_tiles(first, last, below, above, length, BLOCK, HAS_BELOW,
                                                           HAS_ABOVE, UPPER_LOOP)
        zero = offs * 0
        gl.store(Out + offs, lo + zero)
        gl.store(Out + N + offs, full_lo + zero)
        gl.store(Out + 2 * N + offs, full_hi + zero)
        gl.store(Out + 3 * N + offs, hi + zero)

    @gluon.jit
    def _gluon_philox_kernel(Counters, Keys, Out, WIDE: gl.constexpr, N: gl.constexpr):
        offs = gl.arange(0, N, _LAYOUT)
        c0 = gl.load(Counters + offs).to(gl.uint32, bitcast=True)
        c1 = gl.load(Counters + N + offs).to(gl.uint32, bitcast=True)
        c2 = gl.load(Counters + 2 * N + offs).to(gl.uint32, bitcast=True)
        c3 = gl.load(Counters + 3 * N + offs).to(gl.uint32, bitcast=True)
        k0, k1 = gl.load(Keys + offs).to(gl.uint32, bitcast=True), gl.load(Keys + N + offs).to(gl.uint32, bitcast=True)
        r0, r1, r2, r3 = hopper_gluon.philox_rounds(c0, c1, c2, c3, k0, k1, WIDE)
        gl.store(Out + offs, r0.to(gl.int32, bitcast=True))
        gl.store(Out + N + offs, r1.to(gl.int32, bitcast=True))
        gl.store(Out + 2 * N + offs, r2.to(gl.int32, bitcast=True))
        gl.store(Out + 3 * N + offs, r3.to(gl.int32, bitcast=True))

    @gluon.jit
    def _gluon_tanh_kernel(X, Out, N: gl.constexpr):
        offs = gl.arange(0, N, _LAYOUT)
        gl.store(Out + offs, hopper_gluon.tanh_approx(gl.load(X + offs)))


def require_gluon_on_gpu(subject: str) -> None:
    """Skip unless Gluon probes can run (``subject`` names them, with its verb): on a GPU (Gluon
    has no interpreter), under a Triton whose Gluon builds the Hopper kernels' module
    (test_logits_rule's Gluon probes ask too)."""
    if not ON_GPU or gluon is None:
        pytest.skip(f"{subject} on a GPU only (Gluon has no interpreter), under a Triton whose Gluon builds the "
                    "Hopper kernels' module")


@pytest.fixture
def gluon_probes():
    """The Gluon probe kernels (``require_gluon_on_gpu``)."""
    require_gluon_on_gpu("the Gluon instantiation runs")
    return types.SimpleNamespace(band=_gluon_band_kernel, philox=_gluon_philox_kernel, tanh=_gluon_tanh_kernel)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("form", BAND_FORMS, ids=lambda form: "below{}_above{}_upper{}".format(*map(int, form)))
def test_gluon_band_tiles_match_the_host(gluon_probes, block, form):
    _run_band(lambda inputs, out: gluon_probes.band[(1,)](inputs, out, block, *form, N=CASES, num_warps=4),
              block, form)


@pytest.mark.parametrize("wide", [False, True], ids=["mul_hi_lo", "wide"])
def test_gluon_philox_rounds_match_the_host(gluon_probes, wide):
    _run_philox(lambda counters, keys, out, wide: gluon_probes.philox[(1,)](counters, keys, out, wide, N=CASES,
                                                                            num_warps=4), wide)


def test_gluon_tanh_approx_matches_tl(gluon_probes):
    x = _tanh_inputs()
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    gluon_probes.tanh[(1,)](x, ours, N=CASES, num_warps=4)
    _tl_tanh_kernel[(1,)](x, theirs, N=CASES)
    _check_tanh(ours, x)
    assert torch.equal(ours, theirs)
