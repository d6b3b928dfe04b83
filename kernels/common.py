"""What every jagged-unique module shares: the error, the method names, the accepted dtypes and
the result of one algorithm before conversion to the caller's dtypes."""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from deck.errors import DeckError

__all__ = [
    "LENGTH_DTYPES",
    "METHODS",
    "NUMPY_DTYPES",
    "VALUE_DTYPES",
    "KernelInputError",
    "Method",
    "Unique",
]

Method = Literal["auto", "bitmap", "sort"]

VALUE_DTYPES = (torch.int64, torch.int32)
LENGTH_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
METHODS = ("auto", "bitmap", "sort")
NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


class KernelInputError(DeckError, ValueError):
    """The input to a deck kernel is malformed (dtype, shape, negative or out-of-range ids)."""


class Unique(NamedTuple):
    """Result of one algorithm before conversion to the caller's dtypes."""

    values: torch.Tensor
    lengths: torch.Tensor | list[int]
    inverse: torch.Tensor | None
    first: torch.Tensor | None
