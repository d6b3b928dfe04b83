"""Serving models and from-scratch references for the live apply tests (a DLRM's tables, float
and TorchRec-quantised)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from deck.demo import ModelSpec
from deck.model import TableShard
from deck.read.lineage import cheapest_chain, lineage_graph
from deck.read.restore import apply_chain
from deck.storage import LocalStorage

EBC = "sparse_arch.embedding_bag_collection"
KINDS = ("float", "int8", "fp16")


def table_configs(spec: ModelSpec) -> list[Any]:
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=spec.dim, num_embeddings=spec.rows, feature_names=[f"f{i}"]
        )
        for i in range(spec.num_tables)
    ]


def serving_models(spec: ModelSpec, seed: int = 123) -> dict[str, torch.nn.Module]:
    """An unsharded DLRM (random tables: the live apply brings them to a step) and its int8
    and fp16 quantised copies, as TorchRec's inference quantize builds them."""
    from torchrec import EmbeddingBagCollection
    from torchrec.inference.modules import quantize_embeddings
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(seed)
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=table_configs(spec)),
        dense_in_features=13,
        dense_arch_layer_sizes=[32, spec.dim],
        over_arch_layer_sizes=[32, 1],
    )
    return {
        "float": dlrm,
        "int8": quantize_embeddings(copy.deepcopy(dlrm), dtype=torch.qint8, inplace=False),
        "fp16": quantize_embeddings(copy.deepcopy(dlrm), dtype=torch.float16, inplace=False),
    }


def collection(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_submodule(EBC)


def reference(pub: str, step: int, spec: ModelSpec) -> dict[str, torch.nn.Module]:
    """The step's tables built from scratch: deck's restore (its cheapest chain applied with
    ``apply_chain`` into a fresh EmbeddingBagCollection), and TorchRec's quantize of that."""
    from torchrec import EmbeddingBagCollection
    from torchrec.inference.modules import quantize_embeddings

    storage = LocalStorage(pub)
    chain = cheapest_chain(lineage_graph(storage), step)
    ebc = EmbeddingBagCollection(tables=table_configs(spec))
    shards = [
        TableShard.whole(
            f"{EBC}.embedding_bags.{c.name}.weight",
            {"weight": ebc.embedding_bags[c.name].weight.data},
            replicated=True,
        )
        for c in table_configs(spec)
    ]
    apply_chain(storage, chain, shards, {s.table: (spec.rows, spec.dim) for s in shards})
    holder = torch.nn.ModuleDict({"e": ebc})
    return {
        "float": ebc,
        "int8": quantize_embeddings(copy.deepcopy(holder), dtype=torch.qint8, inplace=False)["e"],
        "fp16": quantize_embeddings(copy.deepcopy(holder), dtype=torch.float16, inplace=False)["e"],
    }


def state_diff(kind: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """``kind:key`` of each tensor of ``want`` whose bytes (or dtype, shape) differ in ``got``."""
    bad = []
    for k, w in want.items():
        g = got[k]
        same = g.dtype == w.dtype and g.shape == w.shape
        if not same or not torch.equal(
            g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)
        ):
            bad.append(f"{kind}:{k}")
    return bad


def bitwise_diff(served: dict[str, torch.nn.Module], ref: dict[str, torch.nn.Module]) -> list[str]:
    """Tables whose bytes differ between the served models and the references."""
    bad = []
    for kind in KINDS:
        got = collection(served[kind]).state_dict()
        want = ref[kind].state_dict()
        assert set(got) == set(want), (kind, set(got) ^ set(want))
        bad += state_diff(kind, got, want)
    return bad


def requests(spec: ModelSpec, n: int = 6, batch: int = 4) -> list[Any]:
    """A fixed request set (Zipf ids, like training's)."""
    from deck.demo import make_batch

    small = copy.deepcopy(spec)
    small.batch = batch
    return [make_batch(small, 1000 + i, 0)[1] for i in range(n)]


def dense_inputs(spec: ModelSpec, n: int = 6, batch: int = 4) -> list[torch.Tensor]:
    """The dense features of :func:`requests`' batches."""
    from deck.demo import make_batch

    small = copy.deepcopy(spec)
    small.batch = batch
    return [make_batch(small, 1000 + i, 0)[0] for i in range(n)]


def dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s dense state (its state_dict's plain tensors outside the tables):
    of a trained DMP, what ``restore`` gives the dense part at this step."""
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if (type(v) is torch.Tensor or isinstance(v, torch.nn.Parameter))
        and not k.startswith(f"{EBC}.")
    }


def dense_diff(served: dict[str, torch.nn.Module], want: dict[str, torch.Tensor]) -> list[str]:
    """``kind:key`` of each dense tensor of the served models whose bytes differ from ``want``
    (every served dense tensor must be in ``want``)."""
    bad = []
    for kind in KINDS:
        got = dense_state(served[kind])
        assert got and set(got) == set(want), (kind, set(got) ^ set(want))
        bad += state_diff(kind, got, want)
    return bad


def score(
    dlrm: torch.nn.Module,
    dense_x: torch.Tensor,
    kjt: Any,
    tables: torch.nn.Module,
    dense: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The answer of DLRM ``dlrm`` (a float serving DLRM) for ``dense_x`` and ``kjt`` with the
    collection ``tables`` and the dense state ``dense`` (from-scratch references of a step)."""
    dlrm.load_state_dict(dense, strict=False)
    dlrm.sparse_arch.embedding_bag_collection = tables  # type: ignore[union-attr]
    with torch.no_grad():
        return dlrm(dense_x, kjt)


def lookup(model: torch.nn.Module, kjt: Any) -> torch.Tensor:
    """A request's answer: the pooled embeddings of its ids (what the DLRM's dense part
    consumes)."""
    with torch.no_grad():
        return collection(model)(kjt).values().clone()


def until(check: Any) -> None:
    """Wait (up to a minute) for ``check()`` to hold: another thread reaching its wait."""
    import time

    for _ in range(60_000):
        if check():
            return
        time.sleep(0.001)
    raise AssertionError("never reached")
