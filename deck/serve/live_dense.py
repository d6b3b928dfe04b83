"""The dense part of a served version: the serving model's parameters and buffers outside its
embedding collections (a DLRM's bottom and over MLPs), written from the published step's dense
state so that a version is the whole step, not new tables under the dense weights the model was
built with.

A served dense tensor is matched to the published dense state (rank 0's ``dense.safetensors``,
the trained model's state_dict keys) by its key in the serving model, behind ``prefix``. The
tensors the published state does not hold stay as built (said once, WARNING); one of another
shape or dtype refuses the version (:class:`deck.errors.IncompatibleModelError`). Only tensors
whose bytes change are written, all at once at the version's switch, while no request runs
(:meth:`deck.serve.live_gate.ServingGate.switch`): every request reads one version's dense
state, the one its rows are of.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from deck.errors import CorruptCheckpointError, IncompatibleModelError, UnsupportedError
from deck.format.manifest import CheckpointManifest, RankManifest
from deck.read.catalog import checkpoint_label
from deck.read.restore import read_state_file
from deck.serve.live_tables import is_collection
from deck.storage import Storage

logger = logging.getLogger(__name__)


@dataclass
class ServedDense:
    """The serving models' dense tensors by published key (one per served copy holding it)."""

    by_key: dict[str, list[torch.Tensor]]
    said_missing: bool = False  # the keys the published state lacks were logged

    def prepare(self, published: dict[str, torch.Tensor], where: str) -> PreparedDense:
        """The tensors of ``published`` (a step's dense state) that differ from the served
        ones, with the served values they replace. Raises IncompatibleModelError for a tensor
        of another shape or dtype, naming ``where``."""
        missing = sorted(k for k in self.by_key if k not in published)
        if missing and not self.said_missing:
            self.said_missing = True
            logger.warning(
                "deck live: %s holds no dense state for %d tensor(s) of the served model (%s%s): "
                "they stay as the model was built (check the serving model's module paths and "
                "prefix=)",
                where,
                len(missing),
                ", ".join(missing[:4]),
                ", ..." if len(missing) > 4 else "",
            )
        out = PreparedDense()
        for key, targets in self.by_key.items():
            new = published.get(key)
            if new is None:
                continue
            for t in targets:
                if t.shape != new.shape or t.dtype != new.dtype:
                    raise IncompatibleModelError(
                        f"{where}: dense tensor {key} is {tuple(new.shape)} {new.dtype}, the "
                        f"served one {tuple(t.shape)} {t.dtype}; serve a model built as trained"
                    )
            if all(same_bits(t, new) for t in targets):
                continue
            out.keys.append(key)
            out.new.append([new] * len(targets))
            out.old.append([t.detach().clone() for t in targets])
        return out

    def write(self, dense: PreparedDense, old: bool = False) -> None:
        """Write ``dense``'s new values (``old``: the values they replaced) into every copy."""
        with torch.no_grad():
            for i, key in enumerate(dense.keys):
                for c, t in enumerate(self.by_key[key]):
                    t.copy_((dense.old if old else dense.new)[i][c])


@dataclass
class PreparedDense:
    """A version's dense tensors that change: the ``new`` and the ``old`` value per key and
    served copy."""

    keys: list[str] = field(default_factory=list)
    new: list[list[torch.Tensor]] = field(default_factory=list)
    old: list[list[torch.Tensor]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.keys)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes (NaN and -0.0 included)."""
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def find_dense(models: Iterable[torch.nn.Module], prefix: str = "") -> ServedDense:
    """The dense tensors of ``models`` (their state_dicts' tensors outside their embedding
    collections, float or quantised), keyed as the trained model's state_dict (``prefix``
    before each). Raises :class:`UnsupportedError` naming the key for state that is not a
    plain tensor there (packed or quantised weights), which no version could set."""
    by_key: dict[str, list[torch.Tensor]] = {}
    for model in models:
        paths = [p for p, m in model.named_modules() if is_collection(m)]
        if "" in paths:
            continue  # the model is a collection itself: nothing dense
        skip = tuple(f"{p}." for p in paths)
        for key, value in model.state_dict(keep_vars=True).items():
            if key.startswith(skip):
                continue
            plain = type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter)
            if not plain or value.is_quantized:
                # e.g. torch's dynamic quantisation of the MLPs (packed weights): its weights
                # would stay as built under each new version's tables (a break-it finding)
                raise UnsupportedError(
                    f"served model state {key} is a {type(value).__name__}"
                    f"{' (quantised)' if plain and value.is_quantized else ''}, not a plain "
                    "tensor: a live apply cannot write it exactly from the published dense "
                    "state; serve float dense modules (quantise the embedding tables only)"
                )
            full = f"{prefix}.{key}" if prefix else key
            by_key.setdefault(full, []).append(value.data)
    return ServedDense(by_key)


def read_dense(
    storage: Storage, last: CheckpointManifest, parts: list[RankManifest]
) -> dict[str, torch.Tensor]:
    """The dense state of checkpoint ``last`` (its rank 0 part's dense file: checked, decoded).
    Raises CorruptCheckpointError naming the file when it is missing or damaged."""
    rank0 = next((p for p in parts if p.rank == 0), None)
    if rank0 is None or rank0.dense is None:
        raise CorruptCheckpointError(
            f"{checkpoint_label(last)} at {storage.uri}: rank 0's part has no dense state"
        )
    tree = read_state_file(storage, last, rank0.dense)
    return {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
