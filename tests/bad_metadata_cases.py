"""Calls with wrong metadata values in default mode (no FLASH_ATTENTION_CHECK_INPUTS), each run in a
process of its own by tests/test_bad_metadata.py: an access outside a tensor can abort the Triton
interpreter (heap corruption, segfault), which must fail one test, not kill the test runner.

    python tests/bad_metadata_cases.py BUILD_DIR CASE      (prints CONTAINED when the case passes)

Every tensor a kernel reads or writes is a view into a larger buffer whose rows around the view
hold NaN, so a stray read surfaces as a non-finite output and a stray write as a changed border.
A case checks that the call returns, that the outputs of the rows its clamped sequences cover are
finite, and that every border is untouched (checks.py states what default mode returns).
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sizes import DEVICE, ON_GPU  # noqa: E402

TOKENS = 200 if ON_GPU else 16  # packed tokens of a varlen call
HEADS, DIM = 2, 32
PAD = 8  # NaN rows on each side of every view
N = TOKENS
VARLEN_CU = {  # cu_seqlens values of a 2-sequence batch over N tokens
    "end past the tokens": [0, 5, N + 24],
    "end just past the tokens": [0, 5, N + 4],
    "last sequence past the tokens": [0, N - 2, N + 24],
    "negative entry": [0, -7, 3],
    "decreasing": [0, N, 3],
    "all past the tokens": [N + 5, N + 10, N + 20],
    "negative start": [-10, 5, N],
}
MAX_SEQLEN = N // 2  # shorter than some of the sequences above, as a wrong max_seqlen would be


def bordered(*shape, dim=0):
    """(buffer, view): a random fp32 tensor ``shape`` inside a NaN buffer PAD wider on each side
    of dims 0 .. ``dim``."""
    padded = [n + 2 * PAD if i <= dim else n for i, n in enumerate(shape)]
    buffer = torch.full(padded, float("nan"), device=DEVICE)
    view = buffer[tuple(slice(PAD, PAD + n) for n in shape[:dim + 1])]
    view.copy_(torch.randn(shape, device=DEVICE))
    return buffer, view


def assert_border_untouched(name, buffer, dim=0):
    inside = torch.zeros(buffer.shape, dtype=torch.bool, device=buffer.device)
    inside[tuple(slice(PAD, buffer.shape[i] - PAD) for i in range(dim + 1))] = True
    assert torch.isnan(buffer[~inside]).all(), f"{name}: a write landed outside the tensor"


def clamped_spans(cu, total, longest):
    """Rows [first, first + min(length, longest)) of each sequence as the kernels clamp it."""
    spans = []
    for a, b in zip(cu, cu[1:]):
        first = min(max(a, 0), total)
        end = min(max(b, first), total)
        spans.append((first, first + min(end - first, longest)))
    return spans


def assert_finite_rows(name, x, spans):
    for first, end in spans:
        assert torch.isfinite(x[first:end]).all(), f"{name}: rows [{first}, {end}) are not finite"


def varlen(fa, cu_values, causal=False, backward=False):
    cu = torch.tensor(cu_values, dtype=torch.int32, device=DEVICE)
    buffers, (q, k, v) = zip(*(bordered(N, HEADS, DIM) for _ in range(3)))
    q, k, v = (x.requires_grad_(backward) for x in (q, k, v))
    out = fa.flash_attn_varlen_func(q, k, v, cu, cu, MAX_SEQLEN, MAX_SEQLEN, causal=causal)
    spans = clamped_spans(cu_values, N, MAX_SEQLEN)
    assert_finite_rows("out", out, spans)
    if backward:
        out.backward(torch.randn_like(out))
        for name, x in zip("qkv", (q, k, v)):
            assert_finite_rows(f"d{name}", x.grad, spans)
    for name, buffer in zip("qkv", buffers):
        assert_border_untouched(name, buffer)


def probabilities(fa):
    """S_dmask (batch, heads, max_seqlen_q, max_seqlen_k) of sequences longer than max_seqlen."""
    cu = torch.tensor([0, 3, N], dtype=torch.int32, device=DEVICE)
    q, k, v = (bordered(N, HEADS, DIM)[1] for _ in range(3))
    out, _, probs = fa.flash_attn_varlen_func(q, k, v, cu, cu, MAX_SEQLEN, MAX_SEQLEN, dropout_p=0.25,
                                              return_attn_probs=True)
    assert probs.shape == (2, HEADS, MAX_SEQLEN, MAX_SEQLEN) and torch.isfinite(probs).all()
    assert_finite_rows("out", out, clamped_spans([0, 3, N], N, MAX_SEQLEN))


def rotary(fa, cu_values=None, offsets=None):
    """apply_rotary_emb in place on a bordered x: varlen with wrong cu_seqlens, or dense with a
    negative offsets tensor."""
    cos, sin = (bordered(N, DIM // 4)[1] for _ in range(2))
    if cu_values is not None:
        buffer, x = bordered(N, HEADS, DIM)
        cu = torch.tensor(cu_values, dtype=torch.int32, device=DEVICE)
        fa.apply_rotary_emb(x, cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=MAX_SEQLEN)
        assert_finite_rows("x", x, clamped_spans(cu_values, N, MAX_SEQLEN))
        out = fa.apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=MAX_SEQLEN)
        assert_finite_rows("out", out, clamped_spans(cu_values, N, MAX_SEQLEN))
    else:
        buffer, x = bordered(2, N, HEADS, DIM)
        fa.apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=torch.tensor(offsets, device=DEVICE))
        assert torch.isfinite(x).all()
    assert_border_untouched("x", buffer)


CAPACITY = 32


def kvcache(fa, num_splits, cache_seqlens, cache_batch_idx=None, cache_leftpad=None, rotary=False, causal=False):
    """A contiguous cache (batch_cache, CAPACITY, heads, dim) with NaN borders around both its
    batch and its sequence dims; 3 new keys appended."""
    batch = len(cache_seqlens)
    buffers, caches = zip(*(bordered(batch + 1, CAPACITY, HEADS, DIM, dim=1) for _ in range(2)))
    q = torch.randn(batch, 2, HEADS, DIM, device=DEVICE)
    k, v = (torch.randn(batch, 3, HEADS, DIM, device=DEVICE) for _ in range(2))
    tables = {}
    if rotary:
        tables = dict(zip(("rotary_cos", "rotary_sin"), (bordered(CAPACITY, DIM // 4)[1] for _ in range(2))))

    def index(values):
        return None if values is None else torch.tensor(values, dtype=torch.int32, device=DEVICE)

    out = fa.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=index(cache_seqlens),
                                     cache_batch_idx=index(cache_batch_idx or list(range(batch))),
                                     cache_leftpad=index(cache_leftpad), num_splits=num_splits, causal=causal,
                                     **tables)
    assert torch.isfinite(out).all(), "out is not finite"
    for name, buffer in zip(("k_cache", "v_cache"), buffers):
        assert_border_untouched(name, buffer, dim=1)


def paged_kvcache(fa, num_splits, table, cache_seqlens):
    """A paged cache with NaN pages around it; 3 new keys appended."""
    buffers, caches = zip(*(bordered(4, 16, HEADS, DIM) for _ in range(2)))
    batch = len(table)
    q = torch.randn(batch, 1, HEADS, DIM, device=DEVICE)
    k, v = (torch.randn(batch, 3, HEADS, DIM, device=DEVICE) for _ in range(2))
    out = fa.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32,
                                                                                  device=DEVICE),
                                     block_table=torch.tensor(table, dtype=torch.int32, device=DEVICE),
                                     num_splits=num_splits)
    assert torch.isfinite(out).all(), "out is not finite"
    for name, buffer in zip(("k_cache", "v_cache"), buffers):
        assert_border_untouched(name, buffer)


def paged_prefill(fa, table, cu_k_values, requires_grad=False):
    """flash_attn_varlen_func over a paged cache with NaN pages around it: out-of-range table
    entries and key counts past max_seqlen_k (and past the table's pages). The output must be that
    of the table clamped into the cache and the key counts clamped into [0, max_seqlen_k], which
    shows that no table entry past a row's max_seqlen_k keys was read."""
    buffers, caches = zip(*(bordered(4, 16, HEADS, DIM) for _ in range(2)))
    q = torch.randn(8, HEADS, DIM, device=DEVICE, requires_grad=requires_grad)
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    max_seqlen_k = 16 * len(table[0])

    def call(table, cu_k_values):
        return fa.flash_attn_varlen_func(q, *caches, cu_q, torch.tensor(cu_k_values, dtype=torch.int32, device=DEVICE),
                                         5, max_seqlen_k,
                                         block_table=torch.tensor(table, dtype=torch.int32, device=DEVICE))

    out = call(table, cu_k_values)
    assert torch.isfinite(out).all(), "out is not finite"
    for name, buffer in zip(("k_cache", "v_cache"), buffers):
        assert_border_untouched(name, buffer)
    lengths = [max(min(b, 2 ** 31 - 1) - max(a, 0), 0) for a, b in zip(cu_k_values, cu_k_values[1:])]
    clamped_cu = [0] + [sum(min(n, max_seqlen_k) for n in lengths[:i + 1]) for i in range(len(lengths))]
    clamped_table = [[min(max(page, 0), 3) for page in row] for row in table]
    assert torch.equal(out, call(clamped_table, clamped_cu)), "out differs from the clamped metadata's"


CASES = {
    **{f"varlen fwd, {name}": (varlen, dict(cu_values=cu)) for name, cu in VARLEN_CU.items()},
    **{f"varlen causal fwd+bwd, {name}": (varlen, dict(cu_values=cu, causal=True, backward=True))
       for name, cu in VARLEN_CU.items()},
    "probabilities, sequences past max_seqlen": (probabilities, {}),
    "rotary varlen, last sequence past the tokens": (rotary, dict(cu_values=VARLEN_CU["last sequence past the tokens"])),
    "rotary varlen, negative entry": (rotary, dict(cu_values=VARLEN_CU["negative entry"])),
    "rotary, negative offsets": (rotary, dict(offsets=[-5, -N - 3])),
    **{f"kvcache {name}, {splits} split(s)": (kvcache, dict(num_splits=splits, **kwargs))
       for splits in (1, 3) for name, kwargs in {
           "cache_seqlens past capacity": dict(cache_seqlens=[100, 5], rotary=True, causal=True),
           "negative cache_seqlens": dict(cache_seqlens=[-3, 5], rotary=True, causal=True),
           "new keys overflow": dict(cache_seqlens=[30, 2 ** 31 - 2]),
           "cache_batch_idx outside": dict(cache_seqlens=[4, 5], cache_batch_idx=[7, -1]),
           "cache_leftpad outside": dict(cache_seqlens=[4, 5], cache_leftpad=[-5, 100]),
       }.items()},
    **{f"paged kvcache, table entries outside, {splits} split(s)": (
        paged_kvcache, dict(num_splits=splits, table=[[-1, 99], [3, 2 ** 31 - 1]], cache_seqlens=[20, 100]))
       for splits in (1, 3)},
    "paged prefill, table entries and key counts outside": (
        paged_prefill, dict(table=[[0, -1], [99, 2]], cu_k_values=[0, 20, 500])),
    "paged prefill, negative key counts, q requires grad": (
        paged_prefill, dict(table=[[0, 1], [2, 3]], cu_k_values=[0, -40, 7], requires_grad=True)),
}


def main(build_dir: str, case: str) -> None:
    import kernels

    fa = kernels.get_local_kernel(Path(build_dir))
    function, kwargs = CASES[case]
    torch.manual_seed(0)
    function(fa, **kwargs)
    print("CONTAINED")


if __name__ == "__main__":
    assert os.environ.get("FLASH_ATTENTION_CHECK_INPUTS", "0") != "1", "these cases test the default mode"
    main(*sys.argv[1:])
