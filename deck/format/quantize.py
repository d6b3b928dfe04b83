"""Row-wise quantised encodings of the weight state in delta chunks (Check-N-Run style).

A consumer that does not need exact state (a publisher feeding serving) can write the ``weight``
segment of its chunks as ``fp16``, ``bf16`` or ``int8`` (one signed byte per value and one fp32
scale per row: symmetric, ``scale = absmax(row) / 127``). Optimizer states stay exact: they are
small next to the weights (rowwise Adagrad: one value per row) and quantising them would change
how training continues from a restore, which is what they are kept for.

Error bounds per element ``x`` of the source (float32), dequantised value ``y``:

- ``fp16``: ``|x - y| <= max(|x| * 2**-11, 2**-25)``; values beyond +-65504 cannot be stored and
  are refused (``ConfigError``: use ``bf16`` or ``int8``).
- ``bf16``: ``|x - y| <= max(|x| * 2**-8, 2**-133)``.
- ``int8``: ``|x - y| <= absmax(row) / 254`` (half a quantisation step) plus float32 rounding
  (below ``absmax(row) * 2**-22``); an all-zero row is exact.

Rows holding NaN or infinity are refused for every encoding (they would poison the row's scale).
"""

from __future__ import annotations

from typing import cast, get_args

import torch

from deck.errors import ConfigError, IncompatibleModelError, MergeError
from deck.format.manifest import Encoding

ENCODINGS: tuple[str, ...] = get_args(Encoding)
# Only the model's values are quantised; optimizer states are kept exact (see module docstring).
QUANTIZED_STATES = ("weight",)
_STORED = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
_FP16_MAX = 65504.0


class QuantizedStateError(IncompatibleModelError, MergeError):
    """Quantised state was found where exact state is required: a restore without
    ``allow_quantized=True``, or a merge (merged checkpoints must not pass approximate rows off
    as exact ones). Raised before anything is changed by the call that found it."""


# What a refusal of quantised state says to do (restore, export and the chunk reader alike)
QUANTIZED_ADVICE = (
    "(a publish URI written with PublishConfig.quantize): restore or export the checkpoint URI, "
    "whose chain is exact; only a follower takes approximate rows, when asked (`deck follow "
    "--allow-quantized`, LiveConfig(allow_quantized=True))"
)


def check_encoding(encoding: str | None) -> Encoding | None:
    """``encoding`` as an :data:`Encoding` (None = exact); raises ConfigError for other names."""
    if encoding is None:
        return None
    if encoding not in ENCODINGS:
        raise ConfigError(f"quantize={encoding!r} is not one of {list(ENCODINGS)} (or None: exact)")
    return cast(Encoding, encoding)


def stored_dtype(encoding: Encoding) -> torch.dtype:
    """The dtype the encoded values are stored as."""
    return _STORED[encoding]


def scale_name(state: str) -> str:
    """Name of the per-row fp32 scale segment of an int8-encoded state."""
    return f"{state}.scale"


def encode_rows(
    src: torch.Tensor, encoding: Encoding, what: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode rows ``src`` (``rows x cols`` floats): the stored values and, for int8, the per-row
    fp32 scale. ``what`` names the table in errors. Guarantees the bound in the module docstring."""
    if src.numel() and not bool(torch.isfinite(src).all()):
        raise ConfigError(f"{what}: weight rows hold NaN or infinity; they cannot be quantised")
    if encoding == "fp16":
        if src.numel() and float(src.abs().max()) > _FP16_MAX:
            raise ConfigError(
                f"{what}: weights exceed the fp16 range (+-{_FP16_MAX:g}); use quantize='bf16' "
                "or 'int8'"
            )
        return src.to(torch.float16), None
    if encoding == "bf16":
        return src.to(torch.bfloat16), None
    x = src.to(torch.float32)
    scale = x.abs().amax(dim=1) / 127.0 if x.shape[1] else x.new_zeros(x.shape[0])
    # All-zero rows keep scale 0 (decode to exact zeros); divide them by 1 instead.
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / div.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def decode_rows(
    values: torch.Tensor, scale: torch.Tensor | None, encoding: Encoding, dtype: torch.dtype
) -> torch.Tensor:
    """The dequantised rows, as ``dtype`` (the source dtype recorded in the chunk)."""
    if encoding == "int8":
        assert scale is not None  # the chunk record's validator requires the scale segment
        return (values.to(torch.float32) * scale.unsqueeze(1)).to(dtype)
    return values.to(dtype)
