"""Dense optimizer state with parameters that never got a gradient (no state): saving and
restoring gives exactly the saved subset, for plain torch optimizers and TorchRec's
KeyedOptimizerWrapper, whatever state the optimizer held before the load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from deck.adapters.torchrec_optim import algorithm_class
from torchrec.optim.keyed import KeyedOptimizerWrapper

from deck.errors import IncompatibleModelError
from deck.format import treecodec
from deck.model import edits_logged_at, optimizer_record
from deck.testing.dist_harness import run_ranks
from deck.trainer.fitting import load_optimizer


class _Net(torch.nn.Module):
    """A used linear layer and a parameter the forward never touches (like TorchRec's
    ``TestDenseArch.dummy_param``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 3)
        self.dummy_param = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def _train(net: _Net, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(s))
        opt.zero_grad()
        loss = net(x)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _saved(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What deck writes for a dense optimizer, through its on-disk encoding (no pickle)."""
    saved = optimizer_record(opt, algorithm_class(opt))
    return treecodec.decode(treecodec.encode(saved, "test"), "test")  # type: ignore[no-any-return]


def _flat(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        f"{k}.{n}": v.detach().clone()
        for k, st in sd["state"].items()
        for n, v in st.items()
        if isinstance(v, torch.Tensor)
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def _keyed(net: _Net, factory: Any) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(dict(net.named_parameters()), factory)


FACTORIES = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),
    # Adagrad makes state for every parameter up front: the unused one has state too.
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


@pytest.mark.parametrize("keyed", [True, False], ids=["KeyedOptimizerWrapper", "torch"])
@pytest.mark.parametrize("before", ["empty", "all-params-have-state"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_restore_gives_exactly_the_saved_subset(
    keyed: bool, before: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    factory = FACTORIES[name]
    live = _Net(0)
    opt: torch.optim.Optimizer = (
        _keyed(live, factory) if keyed else factory(list(live.parameters()))
    )
    _train(live, opt, range(3))
    want = _flat(opt.state_dict())
    # Keyed by name (KeyedOptimizerWrapper) or by position (torch).
    unused = (
        "dummy_param."
        if keyed
        else f"{[n for n, _ in live.named_parameters()].index('dummy_param')}."
    )
    unused_has_state = any(k.startswith(unused) for k in want)
    assert want and unused_has_state == (name == "adagrad")
    saved = _saved(opt)
    params = {k: v.detach().clone() for k, v in live.state_dict().items()}

    fresh = _Net(1)
    opt2: torch.optim.Optimizer = (
        _keyed(fresh, factory) if keyed else factory(list(fresh.parameters()))
    )
    if before == "all-params-have-state":
        # The optimizer already holds state for every parameter, the unused one included.
        for p in fresh.parameters():
            p.grad = torch.ones_like(p)
        opt2.step()
        assert len(opt2.state) == 3
    grads = [p.grad for p in fresh.parameters()]
    with caplog.at_level(logging.WARNING, logger="deck"):
        load_optimizer(opt2, saved, "0", algorithm_class(opt2))
    assert not caplog.records, caplog.text  # built as saved: nothing to say
    assert [p.grad for p in fresh.parameters()] == grads  # the load leaves gradients alone
    assert _same(want, _flat(opt2.state_dict()))
    assert (fresh.dummy_param in opt2.state) == unused_has_state  # none saved, none now
    fresh.load_state_dict(params)
    # Training on gives the same losses, and the same state, as never stopping.
    assert _train(fresh, opt2, range(3, 6)) == _train(live, opt, range(3, 6))
    assert _same(_flat(opt.state_dict()), _flat(opt2.state_dict()))


def test_saved_state_for_a_parameter_the_model_lacks_is_refused() -> None:
    live = _Net(0)
    opt = _keyed(live, FACTORIES["adam"])
    _train(live, opt, range(2))
    saved = _saved(opt)
    saved["state_dict"]["state"]["gone.weight"] = saved["state_dict"]["state"]["lin.bias"]
    opt2 = _keyed(_Net(1), FACTORIES["adam"])
    with pytest.raises(IncompatibleModelError, match=r"gone\.weight"):
        load_optimizer(opt2, saved, "0", algorithm_class(opt2))


EDITED = "replace what the optimizer was built with"


def test_an_edited_hyperparameter_is_replaced_by_the_checkpoints_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job restarted with another lr: the checkpoint's lr is what it trains with (so a
    schedule resumes), and a WARNING says the edit was replaced and how to make one (a
    break-it run: the edit was dropped without a word)."""
    live = _Net(0)
    opt = FACTORIES["adam"](list(live.parameters()))
    _train(live, opt, range(2))
    saved = _saved(opt)
    edited = torch.optim.Adam(list(_Net(1).parameters()), lr=0.5, weight_decay=1e-3)
    with caplog.at_level(logging.WARNING, logger="deck"):
        load_optimizer(edited, saved, "0", algorithm_class(edited))
    assert edited.param_groups[0]["lr"] == 0.01
    assert [r.getMessage() for r in caplog.records if EDITED in r.getMessage()] == [
        "deck: optimizer 0, param group 0: the checkpoint's lr=0.01 replace what the optimizer "
        "was built with (lr=0.5): hyperparameters are restored with the state, so that a "
        "schedule resumes; to change one, set it after the restore"
    ]


def test_under_a_wrapper_that_sets_the_lr_an_edit_is_an_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TorchRec's WarmupOptimizer moves the lr from its own base each step: a restore of its
    job always finds an lr other than the one built, so it says so at INFO, not as a WARNING
    on every restore."""
    live = _Net(0)
    opt = FACTORIES["adam"](list(live.parameters()))
    _train(live, opt, range(2))
    saved = _saved(opt)
    warmed = torch.optim.Adam(list(_Net(1).parameters()), lr=0.001, weight_decay=1e-3)
    with caplog.at_level(logging.INFO, logger="deck"), edits_logged_at(logging.INFO):
        load_optimizer(warmed, saved, "0", algorithm_class(warmed))
    said = [r for r in caplog.records if EDITED in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], caplog.text


@pytest.mark.parametrize("base_lr", [0.01, 0.3], ids=["as-saved", "edited"])
def test_a_schedulers_progress_is_not_an_edit(
    base_lr: float, caplog: pytest.LogCaptureFixture
) -> None:
    live = _Net(0)
    opt = FACTORIES["adam"](list(live.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        _train(live, opt, range(1))
        sched.step()
    saved = _saved(opt)
    fresh = torch.optim.Adam(list(_Net(1).parameters()), lr=base_lr, weight_decay=1e-3)
    torch.optim.lr_scheduler.StepLR(fresh, step_size=1, gamma=0.5)
    with caplog.at_level(logging.WARNING, logger="deck"):
        load_optimizer(fresh, saved, "0", algorithm_class(fresh))
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.01 * 0.5**3
    said = [r.getMessage() for r in caplog.records if EDITED in r.getMessage()]
    assert len(said) == (base_lr != 0.01), said
    assert all("initial_lr=0.01" in m and "initial_lr=0.3" in m for m in said), said


@pytest.mark.parametrize("keyed", [True, False], ids=["KeyedOptimizerWrapper", "torch"])
@pytest.mark.parametrize(
    ("saved_as", "built_as"),
    [
        ("adagrad", lambda p: torch.optim.Adam(p, lr=0.01)),
        # Same state keys: torch loads it without a word, and the saved param groups would
        # make the AdamW an Adam (decoupled weight decay off).
        ("adam", lambda p: torch.optim.AdamW(p, lr=0.01)),
        ("sgd-momentum", lambda p: torch.optim.Adam(p, lr=0.01)),
    ],
    ids=["adagrad-to-adam", "adam-to-adamw", "sgd-to-adam"],
)
def test_another_optimizer_class_is_refused_saying_what_to_do(
    keyed: bool, saved_as: str, built_as: Any
) -> None:
    def build(net: _Net, factory: Any) -> torch.optim.Optimizer:
        return _keyed(net, factory) if keyed else factory(list(net.parameters()))

    live = _Net(0)
    opt = build(live, FACTORIES[saved_as])
    _train(live, opt, range(2))
    other = build(_Net(1), built_as)
    with pytest.raises(IncompatibleModelError, match="build the optimizer the job saved with") as e:
        load_optimizer(other, _saved(opt), "0 (step 2 at /ck)", algorithm_class(other))
    assert "step 2 at /ck" in str(e.value) and algorithm_class(other) in str(e.value)


def test_a_checkpoint_written_before_classes_were_kept_still_loads() -> None:
    live = _Net(0)
    opt = torch.optim.Adam(list(live.parameters()), lr=0.01)
    _train(live, opt, range(2))
    saved = _saved(opt)
    del saved["class"]
    fresh = _Net(1)
    opt2 = torch.optim.Adam(list(fresh.parameters()), lr=0.01)
    load_optimizer(opt2, saved, "0", algorithm_class(opt2))
    assert _same(_flat(opt2.state_dict()), _flat(opt.state_dict()))


class _Twins(torch.nn.Module):
    """Two parameters of one shape: a plain optimizer given them in another order loads each
    one's state into the other without an error."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(3))
        self.b = torch.nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x).sum() + (self.b * x * x).sum()


def _names(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str | None]]:
    """What the adapter records (Optimizers.param_names)."""
    names = {id(p): n for n, p in net.named_parameters()}
    return [[names.get(id(p)) for p in g["params"]] for g in opt.param_groups]


def _steps(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for s in steps:
        opt.zero_grad()
        loss = net(torch.randn(3, generator=torch.Generator().manual_seed(s)))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_plain_optimizer_given_its_parameters_in_another_order_restores_by_name(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Break-it finding: a plain torch optimizer keys its state by position; a model built
    with two parameters of one shape handed over in the other order (a refactor, towers built
    in another order) got each one's state in the other, silently, and trained on to other
    losses. The state now goes by the parameters' names."""
    factory = FACTORIES[name]
    live = _Twins(0)
    opt = factory([live.a, live.b])
    _steps(live, opt, range(3))
    record = optimizer_record(opt, algorithm_class(opt), _names(live, opt))
    saved = treecodec.decode(treecodec.encode(record, "test"), "test")
    fresh = _Twins(1)
    fresh.load_state_dict(live.state_dict())
    opt2 = factory([fresh.b, fresh.a])
    with caplog.at_level(logging.INFO, logger="deck"):
        load_optimizer(opt2, saved, "0", algorithm_class(opt2), _names(fresh, opt2))
    assert "by parameter name" in caplog.text
    for mine, theirs in [(live.a, fresh.a), (live.b, fresh.b)]:
        assert opt.state[mine].keys() == opt2.state[theirs].keys()
        for k, v in opt.state[mine].items():
            assert torch.equal(v, opt2.state[theirs][k]), k
    assert _steps(fresh, opt2, range(3, 6)) == _steps(live, opt, range(3, 6))


def test_a_plain_optimizer_over_other_parameters_is_refused_naming_them() -> None:
    live = _Twins(0)
    opt = FACTORIES["adam"]([live.a, live.b])
    _steps(live, opt, range(2))
    saved = optimizer_record(opt, algorithm_class(opt), [["a", "b"]])
    opt2 = FACTORIES["adam"]([live.a, live.b])
    with pytest.raises(IncompatibleModelError, match=r"saved only: \['b'\].*only: \['c'\]"):
        load_optimizer(opt2, saved, "0", algorithm_class(opt2), [["c", "a"]])


class _WithSparseEmbedding(torch.nn.Module):
    """An EmbeddingBagCollection beside a plain ``nn.Embedding(sparse=True)`` in the dense
    part (small categorical features), the latter trained by ``SparseAdam``."""

    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.over = torch.nn.Linear(8 + 4, 1)

    def forward(self, kjt: Any, cat: torch.Tensor) -> torch.Tensor:
        pooled = self.ebc(kjt).to_dict()["f0"]
        return self.over(torch.cat([pooled, self.emb(cat)], 1)).sum()


def _sparse_job(seed: int) -> tuple[Any, list[torch.optim.Optimizer], Any]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.keyed import CombinedOptimizer
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])
        ],
        device=torch.device("meta"),
    )
    model = DistributedModelParallel(_WithSparseEmbedding(ebc), device=torch.device("cpu"))
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    sparse = {k: p for k, p in params.items() if k.endswith("emb.weight")}
    dense = {k: p for k, p in params.items() if k not in sparse}
    opts: list[torch.optim.Optimizer] = [
        CombinedOptimizer(
            [model.fused_optimizer, KeyedOptimizerWrapper(dense, lambda p: torch.optim.Adam(p))]
        ),
        KeyedOptimizerWrapper(sparse, lambda p: torch.optim.SparseAdam(p, lr=0.01)),
    ]

    def train(step: int) -> float:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 20, (8,), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], ids, torch.full((4,), 2))
        for o in opts:
            o.zero_grad()
        loss = model(kjt, torch.randint(0, 10, (4,), generator=g))
        loss.backward()
        for o in opts:
            o.step()
        return float(loss.detach())

    return model, opts, train


def _sparse_adam_job(rank: int, world_size: int, uri: str) -> None:
    import deck
    from deck.demo import capture_state, diff_states

    config = deck.DeckConfig(uri=uri, delta_every_steps=2, lease_ttl_s=None)
    model, opts, train = _sparse_job(0)
    with deck.enable(model, opts, config) as ck:
        ck.step(0)
        for step in range(1, 5):
            train(step)
            ck.step(step)
        live = [capture_state(model, o, full=True) for o in opts]
        more = [train(step) for step in (5, 6)]
    model, opts, train = _sparse_job(1)
    with deck.enable(model, opts, config) as ck:
        assert ck.restore() == 4  # (before: SparseAdam's RuntimeError from the state's making)
        for o, want in zip(opts, live, strict=True):
            assert not diff_states(want, capture_state(model, o, full=True))
        assert [train(step) for step in (5, 6)] == more


def test_a_keyed_sparse_adam_over_a_sparse_embedding_restores(tmp_path: Path) -> None:
    """A break-it finding: a ``KeyedOptimizerWrapper`` around ``SparseAdam`` was accepted at
    ``enable`` and every restore failed with a torch traceback: the keyed optimizer's state is
    made by a zero-gradient step, which SparseAdam refuses when the gradient is dense. The
    gradients of ``nn.Embedding(sparse=True)`` weights are made sparse for that step."""
    run_ranks(_sparse_adam_job, str(tmp_path / "ck"), world_size=1)


def test_a_state_the_zero_gradient_step_cannot_make_is_refused_saying_so() -> None:
    """Where the step that makes a keyed optimizer's state fails (SparseAdam's parameter not
    known to have sparse gradients), the load raises IncompatibleModelError, not torch's
    traceback, and leaves the gradients as they were."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = KeyedOptimizerWrapper({"emb": emb.weight}, lambda p: torch.optim.SparseAdam(p))
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    saved = _saved(opt)
    fresh = torch.nn.Embedding(10, 4, sparse=True)
    opt2 = KeyedOptimizerWrapper({"emb": fresh.weight}, lambda p: torch.optim.SparseAdam(p))
    with pytest.raises(IncompatibleModelError, match="zero-gradient step"):
        load_optimizer(opt2, saved, "0", algorithm_class(opt2))
    assert fresh.weight.grad is None
    load_optimizer(opt2, saved, "0", algorithm_class(opt2), sparse_grads={id(fresh.weight)})
    assert _same(_flat(opt.state_dict()), _flat(opt2.state_dict()))
