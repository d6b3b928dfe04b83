"""adapters/torchrec_compat.py: the one home of the torch/TorchRec/fbgemm internals deck reads."""

from __future__ import annotations

import pytest
import torch
from deck.adapters import torchrec_compat as compat
from torchrec.optim.clipping import GradientClippingOptimizer
from torchrec.optim.keyed import KeyedOptimizerWrapper

from deck.errors import UnsupportedError


def test_pinned_stack_is_the_supported_one() -> None:
    # The venv is built from the Makefile's pins: no version warning on it.
    assert {"torch", "torchrec"} <= set(compat.installed_versions())
    assert compat.unsupported_versions() == {}


def test_moved_attribute_is_an_unsupported_error_naming_it_and_the_versions() -> None:
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)  # no ``_optimizer``
    with pytest.raises(UnsupportedError) as err:
        compat.wrapped_optimizer(plain)
    msg = str(err.value)
    assert "'_optimizer'" in msg and "SGD" in msg
    assert f"torchrec {compat.installed_versions()['torchrec']}" in msg
    assert "torchrec_compat.py" in msg


def test_clipping_steps_round_trip_on_the_real_wrapper() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    inner = KeyedOptimizerWrapper({"p": p}, lambda params: torch.optim.SGD(params, lr=0.1))
    clip = GradientClippingOptimizer(inner, max_gradient=1.0)
    assert compat.wrapped_optimizer(clip) is inner
    compat.set_clipping_steps(clip, 7)
    assert compat.clipping_steps(clip) == 7
