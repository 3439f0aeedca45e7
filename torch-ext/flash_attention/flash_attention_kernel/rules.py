"""The rules the tl kernels and the Hopper Gluon kernels share, each written once.

A Gluon kernel cannot call a ``@triton.jit`` function, nor a tl kernel a ``@gluon.jit`` one, but
both front ends compile the same Python. A rule here is a plain function written in tl, using
only names that Gluon's language also defines (minimum, maximum, where, cdiv, umulhi,
inline_asm_elementwise, static_range, the dtypes), and ``instantiate(language, jit)`` compiles
every rule with the name ``tl`` bound to ``language``: scores.py takes
``instantiate(triton.language, triton.jit)``, hopper_gluon.py ``instantiate(gl, gluon.jit)``, when
the Gluon kernels are first needed (this module imports no Gluon). The rules of one instantiation
call each other in their own language. (The name stays ``tl`` so that the tl instantiation's
source is plain tl wherever it is read again: torch.compile's inductor copies each kernel's
source and its callees' into a module of its own that imports triton.language as tl.)

The rules:

* ``band_tiles``: which tiles a block of indices visits under a band of sequence positions (the
  causal and window masks): the forward's and dQ kernel's key tiles, the dK/dV kernel's query
  tiles, in every tl and Gluon kernel and the decode kernel.
* ``tanh_approx``: the GPU's tanh.approx.f32, the softcap's tanh on 2-byte inputs.
* ``philox_rounds``: the rounds of Philox-4x32 (dropout's draws), with each product's halves from
  one mul.wide.u32 where asked.

The tests check each rule three ways (tests/test_shared_rules.py): its host instantiation (the
same source over Python integers and numpy) against an independent statement of what it must
compute (brute force over positions; Philox written out in numpy; math.tanh), and the tl and Gluon
instantiations against the host one over a grid of cases (tl on the interpreter as on a GPU,
Gluon on a GPU). tests/test_tile_ranges.py and tests/test_dropout_draws.py check the kernels'
callers of them.
"""

import types

import triton.language as tl

# Philox-4x32 as tl.philox runs it: its round multipliers and key increments, 7 rounds (7 rather
# than Random123's 10 for speed; 7 pass BigCrush: docs/design.md)
PHILOX_ROUNDS = tl.constexpr(7)
PHILOX_ROUND_A, PHILOX_ROUND_B = tl.constexpr(0xD2511F53), tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A, PHILOX_KEY_B = tl.constexpr(0x9E3779B9), tl.constexpr(0xBB67AE85)

_RULES = []


def _rule(function):
    """Register ``function`` (written in tl, whose name ``instantiate`` binds) for ``instantiate``."""
    _RULES.append(function)
    return function


def instantiate(language, jit=None) -> types.SimpleNamespace:
    """Every rule compiled by ``jit`` (triton.jit or gluon.jit) with ``tl`` bound to ``language``
    (triton.language or Gluon's language), in one namespace, so that rules calling rules stay in
    it. Without ``jit`` the rules stay plain Python over ``language``'s functions and the
    constants' values: the tests' host reference (tests/test_shared_rules.py), the same source
    on integers."""
    namespace = dict(globals(), tl=language)
    if jit is None:
        namespace.update({name: value.value for name, value in globals().items() if isinstance(value, tl.constexpr)})
    for function in _RULES:
        copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__)
        copy.__doc__, copy.__module__, copy.__qualname__ = function.__doc__, function.__module__, function.__qualname__
        namespace[function.__name__] = copy if jit is None else jit(copy)
    return types.SimpleNamespace(**{function.__name__: namespace[function.__name__] for function in _RULES})


@_rule
def band_tiles(first, last, below, above, length, BLOCK: tl.constexpr, HAS_BELOW: tl.constexpr,
               HAS_ABOVE: tl.constexpr, UPPER_LOOP: tl.constexpr):
    """Tile ranges over [0, length) for the indices first..last, index x seeing the band
    [x + below, x + above] (each edge only where it exists): (lo, full_lo, full_hi, hi), where
    [lo, full_lo) crosses the lower edge, [full_lo, full_hi) is seen in full and [full_hi, hi)
    crosses the upper edge or the end of ``length``; lo, full_lo, full_hi are multiples of BLOCK
    and lo <= full_lo <= full_hi <= hi. Without a lower edge lo = full_lo = 0 (constants).

    Where no tile is full, every visible tile goes to the range the caller masks: [full_hi, hi)
    if it runs a masked loop there (UPPER_LOOP: every tl kernel, whose last tile may be ragged),
    else [lo, full_lo) (the Gluon kernels without an upper edge, whose ``length`` is a multiple
    of BLOCK: they leave that loop out)."""
    lo = 0
    full_lo = 0
    hi = length
    full_hi = length
    if HAS_ABOVE:
        hi = tl.minimum(tl.maximum(last + above + 1, 0), length)
        full_hi = tl.minimum(tl.maximum(first + above + 1, 0), length)
    full_hi = (full_hi // BLOCK) * BLOCK
    if HAS_BELOW:
        lo = (tl.minimum(tl.maximum(first + below, 0), length) // BLOCK) * BLOCK
        full_lo = tl.cdiv(tl.minimum(tl.maximum(last + below, 0), length), BLOCK) * BLOCK
        no_full_tile = full_lo >= full_hi
        if UPPER_LOOP:
            full_lo = tl.where(no_full_tile, lo, full_lo)
            full_hi = tl.where(no_full_tile, lo, full_hi)
        else:
            full_lo = tl.where(no_full_tile, hi, full_lo)
            full_hi = tl.where(no_full_tile, hi, full_hi)
    return lo, full_lo, full_hi, hi


@_rule
def tanh_approx(x):
    """tanh of fp32 ``x`` by the GPU's tanh.approx.f32: one special-function op, relative error
    2^-11 (flash-attn's choice for 2-byte inputs)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                       pack=1)


@_rule
def wide_by_round_a(x):
    """(high, low) words of x * PHILOX_ROUND_A by one mul.wide.u32 (mul.hi and mul.lo take two;
    the constant is spelled out: the asm is a literal)."""
    return tl.inline_asm_elementwise("{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }",
                                       "=r,=r,r", [x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@_rule
def wide_by_round_b(x):
    """(high, low) words of x * PHILOX_ROUND_B by one mul.wide.u32."""
    return tl.inline_asm_elementwise("{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }",
                                       "=r,=r,r", [x], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)


@_rule
def philox_rounds(c0, c1, c2, c3, k0, k1, WIDE: tl.constexpr):
    """Philox-4x32-7 of the uint32 counters (c0, c1, c2, c3) and key (k0, k1), tensors or scalars
    that broadcast (a counter constant along a dimension costs nothing there in the first round),
    as tl.philox computes it. WIDE: each product after the first round (whose operands may be
    scalars, which the asm does not take; their products are loop-invariant anyway) from one
    mul.wide.u32 instead of mul.hi and mul.lo."""
    c0, c1, c2, c3 = (tl.umulhi(c2, PHILOX_ROUND_B) ^ c1 ^ k0, c2 * PHILOX_ROUND_B,
                      tl.umulhi(c0, PHILOX_ROUND_A) ^ c3 ^ k1, c0 * PHILOX_ROUND_A)
    for _ in tl.static_range(PHILOX_ROUNDS - 1):
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
        if WIDE:
            high_b, low_b = wide_by_round_b(c2)
            high_a, low_a = wide_by_round_a(c0)
        else:
            high_b, low_b = tl.umulhi(c2, PHILOX_ROUND_B), c2 * PHILOX_ROUND_B
            high_a, low_a = tl.umulhi(c0, PHILOX_ROUND_A), c0 * PHILOX_ROUND_A
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
    return c0, c1, c2, c3
