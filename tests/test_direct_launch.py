"""The direct launch's key (flash_attention_kernel/direct_launch.py) tells apart every pair of calls
Triton would compile apart, and only where it must.

The direct launch calls a compiled kernel again when a launch's key equals that of an earlier
one, so a key that missed a fact Triton specialises on would run a kernel compiled for other
arguments. The key is one expression generated per signature (``_ArgumentKinds``); these tests
check it on CPU tensors, on a stand-in kernel signature with every kind of argument: tensors
(dtype and 16-byte alignment), an int Triton specialises (by value), an int it does not (by range:
int32 or not), a float and None (by value), a host tensor descriptor, and keyword values by value
or, for other types (Gluon layouts), by identity.
"""

from dataclasses import dataclass

import pytest
import torch


@dataclass
class TensorDescriptor:  # (the fields direct_launch reads of Triton's and Gluon's TensorDescriptor)
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list


class Layout:  # a keyword value keyed by identity, as a Gluon layout is
    pass


@pytest.fixture
def direct_launch(fa):
    return fa.flash_attention_kernel.direct_launch


def _key(direct_launch, args, keywords):
    signature = (tuple(map(type, args)), tuple(keywords), tuple(map(type, keywords.values())))
    # specialised: x, y, n (by value), m (not: do_not_specialize), scale, maybe, desc
    kinds = direct_launch._ArgumentKinds(*signature, [True, True, True, False, True, True, True])
    return (signature, *kinds.key(args, keywords)), kinds


def _call(x=None, y=None, n=64, m=7, scale=0.5, maybe=None, desc=None, **keywords):
    x = torch.zeros(64, dtype=torch.bfloat16) if x is None else x
    y = torch.zeros(64, dtype=torch.float32) if y is None else y
    desc = TensorDescriptor(x, [64], [1], [16]) if desc is None else desc
    return (x, y, n, m, scale, maybe, desc), {"BLOCK": 16, "layout": keywords.pop("layout", LAYOUT), **keywords}


LAYOUT = Layout()


def test_equal_calls_have_equal_keys(direct_launch):
    key, _ = _key(direct_launch, *_call())
    again, _ = _key(direct_launch, *_call())  # (other tensors at other addresses, same facts)
    assert key == again and hash(key) == hash(again)


@pytest.mark.parametrize("change", [
    "dtype", "alignment", "specialised int", "int past int32", "float", "None", "descriptor shape",
    "descriptor alignment", "constexpr", "keyword by identity", "keyword name"])
def test_each_fact_changes_the_key(direct_launch, change):
    storage = torch.zeros(80, dtype=torch.bfloat16)
    changed = {
        "dtype": lambda: _call(x=torch.zeros(64, dtype=torch.float16)),
        "alignment": lambda: _call(x=storage[1:65]),  # (2 bytes past a 16-byte boundary)
        "specialised int": lambda: _call(n=65),
        "int past int32": lambda: _call(m=2 ** 31),
        "float": lambda: _call(scale=0.25),
        "None": lambda: _call(maybe=3),
        "descriptor shape": lambda: _call(desc=TensorDescriptor(torch.zeros(64, dtype=torch.bfloat16), [32], [1], [16])),
        "descriptor alignment": lambda: _call(desc=TensorDescriptor(storage[1:65], [64], [1], [16])),
        "constexpr": lambda: _call(BLOCK=32),
        "keyword by identity": lambda: _call(layout=Layout()),
        "keyword name": lambda: _call(OTHER=16),
    }[change]
    assert _key(direct_launch, *_call())[0] != _key(direct_launch, *changed())[0]


def test_unspecialised_ints_are_keyed_by_range_only(direct_launch):
    assert _key(direct_launch, *_call(m=7))[0] == _key(direct_launch, *_call(m=2 ** 31 - 1))[0]
    assert _key(direct_launch, *_call(m=-2 ** 31))[0] != _key(direct_launch, *_call(m=-2 ** 31 - 1))[0]


def test_descriptors_getter(direct_launch):
    args, keywords = _call()
    _, kinds = _key(direct_launch, args, keywords)
    assert kinds.descriptors(args) == (args[6],)


def test_launch_facts_kept_by_a_template_key_its_copies_as_their_own_fields_do(direct_launch):
    """hopper_gluon copies a checked template descriptor onto each call's tensor; the facts the
    template holds (with_launch_facts) give its copies the key their fields would."""
    template = direct_launch.with_launch_facts(TensorDescriptor(torch.zeros(64, dtype=torch.bfloat16), [64], [1], [16]))
    for tensor in (torch.ones(64, dtype=torch.bfloat16), torch.zeros(80, dtype=torch.bfloat16)[1:65]):
        copy = TensorDescriptor(tensor, template.shape, template.strides, template.block_shape)
        copy.__dict__.update(template.__dict__, base=tensor)
        plain = TensorDescriptor(tensor, template.shape, template.strides, template.block_shape)
        assert direct_launch._descriptor_key(copy) == direct_launch._descriptor_key(plain)
