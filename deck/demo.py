"""The main job: train a small DLRM on 2 gloo CPU ranks with delta checkpoints, restore the
latest step into a freshly built model, verify it bitwise, and print a summary.

    python -m deck.demo [--out DIR] [--steps N] [--rows R] ...

The builders here (model, Zipf batches, a full-state capture using TorchRec's own APIs) are also
what the tests use, so the demo and the tests exercise the same training loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deck
from deck.errors import MissingDependencyError
from deck.processes import end_rank, init_process_group, meeting_file
from deck.stack import require_torchrec
from deck.units import human_bytes

try:  # before the TorchRec imports: not a declared dependency (deck.stack)
    require_torchrec("the demo (python -m deck.demo)")
except MissingDependencyError as e:
    if __name__ != "__main__":
        raise
    print(f"deck demo: {e}", file=sys.stderr)  # one line, no traceback
    sys.exit(2)  # as the deck command's errors that stop it

from deck.adapters.torchrec_optim import fused_kernels

logger = logging.getLogger("deck.demo")


@dataclass
class ModelSpec:
    """Shape of the demo model and workload."""

    num_tables: int = 8
    rows: int = 100_000
    dim: int = 64
    batch: int = 1024  # per rank
    pooling: int = 2  # ids per feature per sample (mean)
    zipf_a: float = 1.2
    collection: str = "ebc"  # "ebc" (EmbeddingBagCollection, DLRM) or "ec" (EmbeddingCollection)
    sharding: str | None = None  # force one sharding type for every table (None: planner's choice)
    data_parallel_tables: tuple[int, ...] = ()
    fused_optimizer: str = "EXACT_ROWWISE_ADAGRAD"
    dense_optimizer: str = "adagrad"  # "adagrad" or "adam"
    fused_params: dict[str, Any] = field(default_factory=dict)  # more fbgemm TBE options
    seed: int = 0
    dense_hidden: int = 32  # width of the DLRM's dense and over arches' hidden layer


def build_model(
    spec: ModelSpec, seed: int | None = None, dmp: Callable[..., Any] | None = None
) -> tuple[Any, Any]:
    """A DMP model (DLRM over an EmbeddingBagCollection, or an EmbeddingCollection model) and its
    dense optimizer. Needs an initialised process group. ``seed`` sets the initial weights;
    ``dmp`` replaces the ``DistributedModelParallel`` class (same arguments), e.g. a
    ``functools.partial`` of ``deck.DeckDistributedModelParallel`` with its ``deck_config``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(spec.seed if seed is None else seed)
    names = [f"t{i}" for i in range(spec.num_tables)]
    fused = {
        "optimizer": getattr(EmbOptimType, spec.fused_optimizer),
        "learning_rate": 0.05,
        "eps": 1e-8,
        **spec.fused_params,
    }
    if spec.collection == "ebc":
        tables_b = [
            EmbeddingBagConfig(
                name=n, embedding_dim=spec.dim, num_embeddings=spec.rows, feature_names=[f"f{i}"]
            )
            for i, n in enumerate(names)
        ]
        module: torch.nn.Module = DLRM(
            embedding_bag_collection=EmbeddingBagCollection(
                tables=tables_b, device=torch.device("meta")
            ),
            dense_in_features=13,
            dense_arch_layer_sizes=[spec.dense_hidden, spec.dim],
            over_arch_layer_sizes=[spec.dense_hidden, 1],
            dense_device=torch.device("cpu"),
        )
        sharder: Any = EmbeddingBagCollectionSharder(fused_params=fused)
    else:
        tables_e = [
            EmbeddingConfig(
                name=n, embedding_dim=spec.dim, num_embeddings=spec.rows, feature_names=[f"f{i}"]
            )
            for i, n in enumerate(names)
        ]
        module = SequenceModel(
            EmbeddingCollection(tables=tables_e, device=torch.device("meta")), spec.dim
        )
        sharder = EmbeddingCollectionSharder(fused_params=fused)
    constraints = {}
    for i, n in enumerate(names):
        if i in spec.data_parallel_tables:
            constraints[n] = ParameterConstraints(
                sharding_types=["data_parallel"], compute_kernels=["dense"]
            )
        elif spec.sharding:
            kw = {"min_partition": max(4, spec.dim // 2)} if "column" in spec.sharding else {}
            constraints[n] = ParameterConstraints(
                sharding_types=[spec.sharding], compute_kernels=["fused"], **kw
            )
    ws = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=ws, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(module, [sharder], dist.GroupMember.WORLD)
    model = (dmp or DistributedModelParallel)(
        module, device=torch.device("cpu"), sharders=[sharder], plan=plan
    )
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    if spec.dense_optimizer == "adam":
        dense = KeyedOptimizerWrapper(
            params, lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-4)
        )
    else:
        dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.02))
    return model, dense


class SequenceModel(torch.nn.Module):
    """A small model over an EmbeddingCollection: mean of each feature's sequence, then an MLP."""

    def __init__(self, ec: torch.nn.Module, dim: int):
        super().__init__()
        self.ec = ec
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(13 + dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        out = self.ec(kjt)
        pooled = torch.stack(
            [torch.segment_reduce(jt.values(), "sum", lengths=jt.lengths()) for jt in out.values()]
        ).sum(0)
        return self.mlp(torch.cat([dense, pooled], dim=1))


def make_batch(spec: ModelSpec, step: int, rank: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a pure function of (seed, step, rank), so a restored job
    sees exactly the data the uninterrupted one saw. Ids follow a Zipf law per table."""
    from torchrec import KeyedJaggedTensor

    rng = np.random.default_rng([spec.seed, step, rank])
    b = spec.batch
    lengths = rng.integers(1, 2 * spec.pooling, size=(spec.num_tables, b))
    n = int(lengths.sum())
    ids = (rng.zipf(spec.zipf_a, size=n) - 1) % spec.rows
    # Scatter hot ids over the table (a fixed odd multiplier is a bijection mod a power of two and
    # spreads well otherwise), so hot rows are not all in the first shard of a row-wise plan.
    ids = (ids * 0x9E3779B1) % spec.rows
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(spec.num_tables)],
        values=torch.from_numpy(ids.astype(np.int64)),
        lengths=torch.from_numpy(lengths.reshape(-1).astype(np.int32)),
    )
    dense = torch.from_numpy(rng.standard_normal((b, 13), dtype=np.float32))
    labels = torch.from_numpy((rng.random(b) < 0.3).astype(np.float32))
    return dense, kjt, labels


def looked_up_rows(
    spec: ModelSpec, tables: set[str], steps: range, world_size: int
) -> dict[str, set[int]]:
    """The rows of each table in ``tables`` (named ``t<i>``) that the batches of ``steps`` on
    every rank look up: what a tracker of those steps must have seen."""
    out: dict[str, set[int]] = {t: set() for t in tables}
    for step in steps:
        for r in range(world_size):
            _, kjt, _ = make_batch(spec, step, r)
            for i, key in enumerate(kjt.keys()):
                if f"t{i}" in out:
                    out[f"t{i}"].update(kjt[key].values().tolist())
    return out


def train_step(model: Any, dense_opt: Any, spec: ModelSpec, step: int) -> float:
    """One training step; returns the loss."""
    dense, kjt, labels = make_batch(spec, step, dist.get_rank())
    logits = model(dense, kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    dense_opt.zero_grad()
    loss.backward()
    dense_opt.step()
    return float(loss.detach())


class TrainState:
    """The user's training state: step, RNG, and loss history (a Stateful object)."""

    def __init__(self) -> None:
        self.step = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": list(self.losses), "rng": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.losses = list(sd["losses"])
        torch.set_rng_state(sd["rng"])


def state_leaves(prefix: str, v: Any) -> list[tuple[str, Any]]:
    """The leaves of a nested state (dicts, lists, tuples) by name (keys joined with ".",
    indices as ``[i]``): a sharded tensor as it is (anything with ``local_shards``), a tensor
    as a detached copy, a number as a float64 tensor; anything else is left out."""
    if hasattr(v, "local_shards"):
        return [(prefix, v)]
    if isinstance(v, torch.Tensor):
        return [(prefix, v.detach().clone())]
    if isinstance(v, (int, float)):
        return [(prefix, torch.tensor(v, dtype=torch.float64))]
    if isinstance(v, dict):
        return [leaf for k, x in v.items() for leaf in state_leaves(f"{prefix}.{k}", x)]
    if isinstance(v, (list, tuple)):
        return [leaf for i, x in enumerate(v) for leaf in state_leaves(f"{prefix}[{i}]", x)]
    return []


def capture_state(
    model: Any, dense_opt: Any, user: TrainState | None = None, *, full: bool = False
) -> dict[str, torch.Tensor]:
    """Copy of everything a restore must reproduce, read with TorchRec's own APIs (independent of
    deck's adapter): table shards, fused optimizer states, dense params, dense optimizer state.
    ``full`` adds what a plain state_dict leaves out: the hyperparameters of every param group
    (fused and dense) and the torch RNG state. (Persistent buffers are in the state_dict, every
    rank's own; non-persistent ones are derived, e.g. TorchRec's lazily built feature order.)"""
    out: dict[str, torch.Tensor] = {}

    def put(prefix: str, state: Any) -> None:
        for name, v in state_leaves(prefix, state):
            if not hasattr(v, "local_shards"):  # (a ShardedTensor is a Tensor too)
                out[name] = v
            else:
                for s in v.local_shards():
                    out[f"{name}@{list(s.metadata.shard_offsets)}"] = s.tensor.detach().clone()

    put("model", model.state_dict())
    put("fused", model.fused_optimizer.state_dict())
    put("dense_opt", dense_opt.state_dict())
    if full:
        for name, opt in (("fused", model.fused_optimizer), ("dense_opt", dense_opt)):
            groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
            put(f"{name}.param_groups", groups)
        for i, tbe in enumerate(fused_kernels(model.fused_optimizer)):
            # What the fused backward reads: the TBE's own rate and optimizer arguments.
            put(f"kernel[{i}].lr", tbe.learning_rate_tensor)
            put(f"kernel[{i}].args", list(tbe.optimizer_args))
        put("rng", torch.get_rng_state())
    if user is not None:
        put("user", user.state_dict())
    return out


def diff_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of entries that differ bitwise (or exist in only one)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(
                x.view(torch.uint8) if x.dtype.is_floating_point and x.dim() else x,
                y.view(torch.uint8) if y.dtype.is_floating_point and y.dim() else y,
            )
        ):
            bad.append(k)
    return bad


def train_with_checkpoints(
    ckpt: Any, model: Any, dense_opt: Any, spec: ModelSpec, user: TrainState, last_step: int
) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 0..``last_step`` (step 0 trains nothing), ``ckpt.step`` after each; returns the live
    state (:func:`capture_state`) of every step that took a checkpoint, and flushes."""
    live = {}
    for step in range(last_step + 1):
        if step:
            train_step(model, dense_opt, spec, step)
            user.step = step
        if ckpt.step(step) is not None:
            live[step] = capture_state(model, dense_opt, user)
    ckpt.flush()
    return live


# ---- the demo job ------------------------------------------------------------------------------


@dataclass
class DemoArgs:
    out: str
    steps: int
    delta_every: int
    spec: ModelSpec
    compare_dcp: bool


def _demo_worker(rank: int, world_size: int, where: str, args: DemoArgs, result_file: str) -> None:
    # TorchRec / fbgemm emit deprecation and planner warnings on every run; the demo's output is
    # its summary.
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("torch.fx").setLevel(logging.ERROR)  # TorchRec's tracing check, each run
    init_process_group(rank, world_size, where)
    say = _progress if rank == 0 else _quiet
    spec = args.spec
    say(f"building the model on {world_size} ranks")
    model, dense_opt = build_model(spec)
    user = TrainState()
    config = deck.DeckConfig(uri=args.out, delta_every_steps=args.delta_every)
    losses = []
    t_train = 0.0

    def committed(e: deck.CheckpointEvent) -> None:
        if e.state == "committed":
            say(f"  step {e.step:>4}/{args.steps}: {e.kind} committed ({human_bytes(e.bytes)})")

    say(f"training {args.steps} steps, a checkpoint every {args.delta_every}")
    with deck.enable(model, [dense_opt], config, state=user, on_checkpoint=committed) as ckpt:
        for step in range(0, args.steps + 1):
            if step > 0:
                t0 = time.perf_counter()
                losses.append(train_step(model, dense_opt, spec, step))
                t_train += time.perf_counter() - t0
                user.step = step
                user.losses.append(losses[-1])
            ckpt.step(step)
        if args.steps % args.delta_every:  # the last step is what the restore is compared with
            ckpt.save("delta", step=args.steps)
        live = capture_state(model, dense_opt, user, full=True)
        ckpt.flush()  # background uploads and commits
        history = ckpt.history
    dist.barrier()
    dcp_s = float("nan")
    if args.compare_dcp:
        import torch.distributed.checkpoint as dcp

        say("timing torch.distributed.checkpoint.save of the same model, for comparison")
        dcp_dir = args.out.rstrip("/") + "-dcp-baseline"
        t0 = time.perf_counter()
        dcp.save(
            {"model": model.state_dict(), "optim": dense_opt.state_dict()}, checkpoint_id=dcp_dir
        )
        dist.barrier()
        dcp_s = time.perf_counter() - t0
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)
    # A fresh model with other initial weights, restored from the latest checkpoint.
    say("restoring the latest step into a fresh model and comparing it with the live one")
    model2, dense_opt2 = build_model(spec, seed=spec.seed + 1000)
    user2 = TrainState()
    t0 = time.perf_counter()
    with deck.enable(model2, [dense_opt2], config, state=user2) as ckpt2:
        restored = ckpt2.restore()
    restore_s = time.perf_counter() - t0
    bad = diff_states(live, capture_state(model2, dense_opt2, user2, full=True))
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(
                {
                    "restored": restored,
                    "mismatches": bad[:20],
                    "history": [h.snapshot() for h in history],
                    "dcp_save_s": dcp_s,
                    "restore_s": restore_s,
                    "train_step_s": t_train / max(1, args.steps),
                },
                f,
            )
    dist.barrier()
    end_rank()


def run_demo(args: DemoArgs, world_size: int = 2) -> dict[str, Any]:
    """Run the demo on ``world_size`` spawned ranks; returns rank 0's summary."""
    fd, result_file = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        with meeting_file() as where:
            mp.spawn(_demo_worker, args=(world_size, where, args, result_file), nprocs=world_size)
        with open(result_file) as f:
            return dict(json.load(f))
    finally:
        os.unlink(result_file)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _progress(line: str) -> None:
    print(line, flush=True)


def _quiet(line: str) -> None:
    pass


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m deck.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default=None,
        help="checkpoint directory, new or empty (default: a fresh folder under the temp dir)",
    )
    p.add_argument("--steps", type=_positive, default=60, help="training steps (60)")
    p.add_argument(
        "--delta-every", type=_positive, default=10, help="a checkpoint every N steps (10)"
    )
    p.add_argument("--tables", type=_positive, default=8, help="embedding tables (8)")
    p.add_argument("--rows", type=_positive, default=250_000, help="rows per table (250000)")
    p.add_argument("--dim", type=_positive, default=64, help="embedding dimension (64)")
    p.add_argument("--batch", type=_positive, default=1024, help="batch size per rank (1024)")
    p.add_argument(
        "--no-dcp", action="store_true", help="skip the torch.distributed.checkpoint comparison"
    )
    a = p.parse_args(argv)
    if (
        a.out is not None
        and os.path.exists(a.out)
        and (not os.path.isdir(a.out) or os.listdir(a.out))
    ):
        # The demo ends by printing `rm -rf` of its folder: never one holding anything else
        p.error(f"--out {a.out} exists and is not an empty folder: give a new or empty one")
    out = a.out or tempfile.mkdtemp(prefix="deck-demo-")
    spec = ModelSpec(num_tables=a.tables, rows=a.rows, dim=a.dim, batch=a.batch)
    print(
        f"deck demo: DLRM {a.tables} tables x {a.rows} rows x {a.dim} dim on 2 gloo ranks, "
        f"{a.steps} steps, delta every {a.delta_every} -> {out}",
        flush=True,
    )
    t0 = time.perf_counter()
    r = run_demo(
        DemoArgs(
            out=out, steps=a.steps, delta_every=a.delta_every, spec=spec, compare_dcp=not a.no_dcp
        )
    )
    hist = r["history"]
    fulls = [h for h in hist if h["kind"] == "full"]
    deltas = [h for h in hist if h["kind"] == "delta"]
    print(
        f"{'step':>6} {'kind':>6} {'rows':>9} {'bytes':>11} {'chunks':>6} {'stall s':>8} {'durable s':>9} {'commit s':>8}"
    )
    for h in hist:
        durable = "-" if h["durable_local_s"] is None else f"{h['durable_local_s']:.3f}"
        committed = "-" if h["committed_s"] is None else f"{h['committed_s']:.3f}"
        print(
            f"{h['step']:>6} {h['kind']:>6} {h['rows']:>9} {human_bytes(h['bytes']):>11} {h['chunks']:>6} "
            f"{h['stall_s']:>8.3f} {durable:>9} {committed:>8}"
        )
    print(
        "stall: training blocked; durable: fsynced locally; commit: manifest written (from snapshot start)"
    )
    if fulls and deltas:
        full_b = fulls[0]["bytes"]
        med_delta_b = float(np.median([h["bytes"] for h in deltas]))
        med_delta_s = float(np.median([h["stall_s"] for h in deltas]))
        print(
            f"bytes per delta (median) / full: {human_bytes(med_delta_b)} / {human_bytes(full_b)} = {med_delta_b / full_b:.3f}"
        )
        print(
            f"stall per delta (median): {med_delta_s:.3f} s; train step {r['train_step_s']:.3f} s"
        )
        if r["dcp_save_s"] == r["dcp_save_s"]:
            print(
                f"torch.distributed.checkpoint.save of the same model: {r['dcp_save_s']:.3f} s "
                f"-> delta stall is {med_delta_s / r['dcp_save_s']:.3f}x of it"
            )
    print(f"restore of step {r['restored']} into a fresh model: {r['restore_s']:.2f} s")
    if r["mismatches"]:
        print(
            f"VERIFY FAILED: {len(r['mismatches'])} state entries differ, e.g. {r['mismatches'][:5]}"
        )
        return 1
    print(
        f"verified: restored state is bitwise equal to the live model at step {r['restored']} "
        "(weights, optimizer states and hyperparameters, dense params and buffers, dense "
        "optimizer, RNG, user state, on every rank)"
    )
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    where = shlex.quote(os.path.abspath(out))
    deck_cli = shlex.quote(os.path.join(os.path.dirname(sys.executable), "deck"))
    print(
        f"\nthe checkpoints are in {out} ({human_bytes(_size(out))}); look at them with\n"
        f"  {deck_cli} ls {where}          (also: deck show / verify / lineage / history;"
        " docs/quickstart.md, section 4)\n"
        f"and remove them with\n  rm -rf {where}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
