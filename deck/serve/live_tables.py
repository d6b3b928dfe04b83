"""The tables of a built serving model that a live apply writes into, found by walking it.

A served table is one embedding table of a TorchRec collection in the serving model:

- float: ``torchrec.EmbeddingBagCollection`` / ``EmbeddingCollection`` (the table's ``weight``
  parameter, rows written as they are published);
- quantised: ``torchrec.quant.embedding_modules.EmbeddingBagCollection`` /
  ``EmbeddingCollection`` with row-wise INT8, FP16 or FP32 tables on the CPU (what
  ``torchrec.inference.modules.quantize_embeddings`` builds). Their ``weight`` buffer is a view
  of the fbgemm inference TBE's row storage; a row is written exactly as TorchRec's own
  ``quantize_state_dict`` would quantise the same float row (fbgemm's
  ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` for INT8, a cast for FP16), so a live table
  is bitwise the quantisation of the float state.

Each table is matched to deck's table key, the training model's state_dict key of its weight
(``<module path>.embedding_bags.<name>.weight``), with the serving model's own module path,
behind ``prefix`` when the serving model is a part of the trained one.

Rows are handled in a table's *stored form*: float rows for a float table; for a quantised
table the bytes of the row the TBE reads (INT8: fp16 scale and bias, then the codes; FP16/FP32:
the values' bytes), without the row's alignment padding (never written). Reading stored rows
back is how a live apply keeps what a version replaced (rollback needs no storage reads).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from deck.errors import ConfigError, IncompatibleModelError, UnsupportedError

# fbgemm's inference TBE keeps an INT8 row as [fp16 scale, fp16 bias, codes...] on the CPU
# (its reverse_qparam layout, [codes..., scale, bias], is MTIA's); quantize_state_dict produces
# [codes..., scale, bias], which assign_embedding_weights splits and stores in this order.
SCALE_BIAS_BYTES = 4


@dataclass
class ServedTable:
    """One table of one served module: ``key`` is deck's table key, ``store`` the live tensor
    rows are written into (float: the weight; quantised: the TBE's uint8 rows, unpadded part)."""

    key: str
    module: str  # the module's path in the serving model (for messages)
    name: str  # the table's name in its collection
    num_rows: int
    num_cols: int
    encoding: str  # "float" (any float dtype), "int8", "fp16", "fp32"
    store: torch.Tensor
    features: tuple[str, ...] = field(default=())

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """The stored form of float ``rows`` (n x num_cols), as TorchRec's quantize would store
        them."""
        if self.encoding == "float":
            return rows.to(self.store.dtype)
        if self.encoding == "int8":
            # Row-wise: each row's codes, scale and bias depend on that row only, so quantising
            # the changed rows alone gives the bytes quantising the whole table gives.
            q = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
                rows.float().contiguous(), 8
            )
            return torch.cat([q[:, -SCALE_BIAS_BYTES:], q[:, :-SCALE_BIAS_BYTES]], dim=1)
        if self.encoding == "fp16":
            return rows.half().contiguous().view(torch.uint8)
        return rows.float().contiguous().view(torch.uint8)  # fp32

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the stored rows ``ids``."""
        return self.store.index_select(0, ids)

    def write(self, ids: torch.Tensor, stored: torch.Tensor) -> None:
        """Write stored rows (in place: the live model reads them at its next lookup)."""
        with torch.no_grad():
            self.store.index_copy_(0, ids, stored)

    def differs(self, ids: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` hold bytes other than ``stored`` (a bool per id)."""
        old = self.store.index_select(0, ids)
        return (_bytes(old) != _bytes(stored)).any(dim=1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of each row of ``t`` (bitwise comparison: NaNs and -0.0 count as bytes)."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


@dataclass
class ServedTables:
    """Every served table, by deck's table key (a key may be served by several modules: a
    float and a quantised copy of the same model); ``feature_tables``: the table keys each input
    feature name is looked up in (several when tables of a collection share a feature)."""

    by_key: dict[str, list[ServedTable]]
    feature_tables: dict[str, tuple[str, ...]]

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {k: (ts[0].num_rows, ts[0].num_cols) for k, ts in self.by_key.items()}


def is_collection(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a collection of tables a live apply serves (float or quantised
    EmbeddingBagCollection / EmbeddingCollection)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.quant import embedding_modules as quant

    return isinstance(
        module,
        EmbeddingBagCollection
        | EmbeddingCollection
        | quant.EmbeddingBagCollection
        | quant.EmbeddingCollection,
    )


def find_tables(models: Iterable[torch.nn.Module], prefix: str = "") -> ServedTables:
    """The served tables of ``models`` (each a serving model, or a collection itself).

    Raises :class:`UnsupportedError` for a quantised table this cannot write exactly (INT4/INT2,
    scale and bias split into their own buffers, not on the CPU) and
    :class:`IncompatibleModelError` when the copies of one table disagree in shape or features,
    or no table is found."""
    from torchrec.modules.embedding_modules import (
        EmbeddingBagCollection,
        EmbeddingCollection,
    )
    from torchrec.quant import embedding_modules as quant

    by_key: dict[str, list[ServedTable]] = {}
    feature_tables: dict[str, tuple[str, ...]] = {}
    found = 0
    for model in models:
        for path, module in model.named_modules():
            if isinstance(module, EmbeddingBagCollection | quant.EmbeddingBagCollection):
                configs, holder, attr = (
                    module.embedding_bag_configs(),
                    module.embedding_bags,
                    "embedding_bags",
                )
            elif isinstance(module, EmbeddingCollection | quant.EmbeddingCollection):
                configs, holder, attr = module.embedding_configs(), module.embeddings, "embeddings"
            else:
                continue
            quantised = isinstance(module, quant.EmbeddingBagCollection | quant.EmbeddingCollection)
            base = ".".join(p for p in (prefix, path) if p)
            for cfg in configs:
                key = f"{base}.{attr}.{cfg.name}.weight" if base else f"{attr}.{cfg.name}.weight"
                table = _served(key, path, cfg, holder[cfg.name], quantised)
                found += 1
                for other in by_key.get(key, []):
                    if (other.num_rows, other.num_cols, other.features) != (
                        table.num_rows,
                        table.num_cols,
                        table.features,
                    ):
                        raise IncompatibleModelError(
                            f"table {key}: served as ({other.num_rows}, {other.num_cols}) for "
                            f"features {list(other.features)} in module {other.module!r} and as "
                            f"({table.num_rows}, {table.num_cols}) for {list(table.features)} in "
                            f"{table.module!r}; serve copies of one model"
                        )
                by_key.setdefault(key, []).append(table)
                for f in table.features:
                    if key not in feature_tables.get(f, ()):
                        feature_tables[f] = (*feature_tables.get(f, ()), key)
    if not found:
        raise IncompatibleModelError(
            "no TorchRec EmbeddingBagCollection / EmbeddingCollection (float or torchrec.quant) "
            "in the served model(s)"
        )
    return ServedTables(by_key, feature_tables)


def _served(
    key: str, path: str, cfg: object, holder: torch.nn.Module, quantised: bool
) -> ServedTable:
    from torchrec.modules.embedding_configs import DataType

    name = cfg.name  # type: ignore[attr-defined]
    rows, cols = int(cfg.num_embeddings), int(cfg.embedding_dim)  # type: ignore[attr-defined]
    features = tuple(cfg.feature_names)  # type: ignore[attr-defined]
    weight: torch.Tensor = holder.weight  # type: ignore[assignment]
    where = f"table {name!r} of module {path or '(root)'!r}"
    if not quantised:
        if tuple(weight.shape) != (rows, cols) or weight.device.type != "cpu":
            raise UnsupportedError(f"{where}: a weight of {tuple(weight.shape)} on {weight.device}")
        return ServedTable(key, path, name, rows, cols, "float", weight.data, features)
    if hasattr(holder, "weight_qscale"):
        raise UnsupportedError(
            f"{where}: scale and bias in their own buffers (quant_state_dict_split_scale_bias); "
            "build the quantised module without it"
        )
    if getattr(cfg, "num_embeddings_post_pruning", None) is not None:
        raise UnsupportedError(f"{where}: pruned tables are not served live")
    width = {
        DataType.INT8: cols + SCALE_BIAS_BYTES,
        DataType.FP16: 2 * cols,
        DataType.FP32: 4 * cols,
    }
    dt = cfg.data_type  # type: ignore[attr-defined]
    if dt not in width:
        raise UnsupportedError(f"{where}: {dt} rows are not written live (INT8, FP16, FP32 are)")
    if (
        weight.dtype != torch.uint8
        or weight.dim() != 2
        or weight.shape[0] != rows
        or weight.shape[1] < width[dt]
        or weight.device.type != "cpu"
    ):
        raise UnsupportedError(
            f"{where}: its {dt} rows are {tuple(weight.shape)} {weight.dtype} on {weight.device}, "
            f"not the CPU TBE layout (rows x >= {width[dt]} bytes)"
        )
    encoding = {DataType.INT8: "int8", DataType.FP16: "fp16", DataType.FP32: "fp32"}[dt]
    return ServedTable(key, path, name, rows, cols, encoding, weight[:, : width[dt]], features)


def request_rows(tables: ServedTables, batch: object) -> dict[str, torch.Tensor]:
    """The rows a request looks up, by table key, from its ``KeyedJaggedTensor`` (or a mapping
    of table key to ids). Features no served table reads are ignored. Raises
    :class:`deck.errors.ConfigError` naming the table for an id outside it (the gate would
    otherwise track another table's row)."""
    if isinstance(batch, Mapping):
        rows = {k: _ids(k, v) for k, v in batch.items()}
    elif all(callable(getattr(batch, a, None)) for a in ("keys", "length_per_key", "values")):
        rows = _kjt_rows(tables, batch)
    else:
        # (a break-it finding: a list was an AttributeError from inside)
        raise ConfigError(
            f"serving(batch): give the request's KeyedJaggedTensor or a mapping of table key "
            f"to ids, not {type(batch).__name__}"
        )
    shapes = tables.shapes
    for key, ids in rows.items():
        if key not in shapes:
            raise ConfigError(f"a request names table {key!r}, which is not served")
        bad = ids[(ids < 0) | (ids >= shapes[key][0])]
        if bad.numel():
            raise ConfigError(
                f"a request looks up row {int(bad[0])} of table {key!r}, which has rows 0.."
                f"{shapes[key][0] - 1}"
            )
    return rows


def _ids(key: str, values: object) -> torch.Tensor:
    """A mapping's ids of table ``key``: integers only (a break-it finding: 1.7 was row 1)."""
    ids = torch.as_tensor(values).reshape(-1)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ConfigError(f"a request's ids of table {key!r} must be integers, got {ids.dtype}")
    return ids.long()


def _kjt_rows(tables: ServedTables, batch: object) -> dict[str, torch.Tensor]:
    out: dict[str, list[torch.Tensor]] = {}
    keys = batch.keys()  # type: ignore[attr-defined]
    lengths = batch.length_per_key()  # type: ignore[attr-defined]
    values = batch.values()  # type: ignore[attr-defined]
    at = 0
    for key, n in zip(keys, lengths, strict=True):
        # (every table reading the feature: a request reads its ids in each of them)
        for table in tables.feature_tables.get(key, ()) if n else ():
            out.setdefault(table, []).append(values[at : at + n])
        at += n
    return {k: torch.cat(v).long() for k, v in out.items()}
