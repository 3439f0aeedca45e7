"""direct_launch.DirectKernel's key, without a GPU: a stand-in kernel records which launches go
through JITFunction.run (a compile or cache lookup) and which straight to the compiled launcher,
with tuple arguments as the kernels take them (docs/design.md#kernel-signatures)."""

from types import SimpleNamespace

import pytest
import torch

from conftest import ON_GPU


class _StandInKernel:
    """Parameters A, strides (tuple), n (not specialised), group (tuple: tensor, int), X
    (constexpr); ``kernel[grid](*args)`` records a slow launch and returns a compiled kernel whose
    ``run`` records direct ones."""

    def __init__(self):
        def param(name, constexpr=False, specialize=True):
            return SimpleNamespace(name=name, is_constexpr=constexpr, do_not_specialize=not specialize)

        self.params = [param("A"), param("strides"), param("n", specialize=False), param("group"),
                       param("X", constexpr=True)]
        self.__name__ = "stand_in"
        self.slow, self.direct = [], []
        self.compiled = SimpleNamespace(function=None, packed_metadata=None,
                                        run=lambda *launch_args: self.direct.append(launch_args))

    def __getitem__(self, grid):
        def launch(*args, **keywords):
            self.slow.append(args)
            return self.compiled
        return launch


@pytest.fixture
def direct(fa, monkeypatch):
    if ON_GPU:
        pytest.skip("the stand-in's CPU tensors and stream")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    kernel = _StandInKernel()
    return kernel, fa.flash_attention_kernel.direct_launch.DirectKernel(kernel)


def test_tuple_arguments_key_their_elements(direct):
    kernel, launcher = direct
    x, y = torch.zeros(8), torch.zeros(8)

    def launch(a, strides, n, group):
        launcher[(1,)](a, strides, n, group, X=3)

    launch(x, (64, 16, 1), 5, (y, 32))
    launch(torch.zeros(8), (64, 16, 1), 7, (torch.zeros(8), 32))  # same facts: direct
    assert len(kernel.slow) == 1 and len(kernel.direct) == 1
    _, strides, n, group, constexpr = kernel.direct[0][-5:]  # (the launcher takes the tuples as they are)
    assert (strides, n, type(group), group[1], constexpr) == ((64, 16, 1), 7, tuple, 32, 3)
    launch(x, (64, 16, 2), 5, (y, 32))  # a stride inside a tuple
    launch(x, (64, 16, 1), 5, (y, 48))  # an int of a tuple holding a tensor
    launch(x, (64, 16, 1), 5, (y.double(), 32))  # a tuple's tensor's dtype
    launch(x, (64, 16, 1), 5, (y[1:], 32))  # its alignment
    launch(x, (64, 16, 1), 5, (y, 32.0))  # an element's type
    assert len(kernel.slow) == 6 and len(kernel.direct) == 1
    launch(x, (64, 16, 1), 5, (y, 32))
    assert len(kernel.slow) == 6 and len(kernel.direct) == 2
