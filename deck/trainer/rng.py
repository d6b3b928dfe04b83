"""Every torch random number generator state of this process, saved and put back by value."""

from __future__ import annotations

import logging
from typing import Any

import torch

from deck.errors import IncompatibleModelError

logger = logging.getLogger(__name__)


def capture_rng() -> dict[str, Any]:
    """This process's torch RNG states: the CPU generator and, where CUDA is initialised, every
    device's (copies: training on does not change them)."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(saved: dict[str, Any], where: str) -> None:
    """Put back states :func:`capture_rng` returned, so the next random draws are the ones the
    saving process made next. CUDA states are put back when this process has as many devices;
    otherwise they are left as they are (logged): a restore onto other hardware cannot replay
    them. Raises :class:`IncompatibleModelError` naming ``where`` for a malformed record."""
    cpu = saved.get("cpu")
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise IncompatibleModelError(f"{where}: the saved CPU RNG state is not a byte tensor")
    torch.set_rng_state(cpu)
    cuda = saved.get("cuda")
    if cuda is None:
        return
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    else:
        logger.warning(
            "deck: %s saved the RNG states of %d CUDA device(s), this process has %d: "
            "they are not restored",
            where,
            len(cuda),
            torch.cuda.device_count() if torch.cuda.is_available() else 0,
        )
