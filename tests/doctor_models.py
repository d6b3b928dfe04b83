"""Entry points for tests/test_doctor.py: user setups as ``deck doctor`` takes them (a function
returning a ``deck.DoctorSetup``), built with torch's and TorchRec's public APIs (the demo's DLRM
and batches). One deck restores exactly; two hide state from deck, so the doctor must fail."""

from __future__ import annotations

from typing import Any

import torch

from deck.demo import ModelSpec, build_model, train_step
from deck.doctor import DoctorSetup

# table_wise: the planner would make tables this small data_parallel. Two tables per rank, so
# TorchRec's sharded EBC creates its _features_order_tensor buffer at the first forward.
SPEC = ModelSpec(num_tables=4, rows=200, dim=8, batch=32, sharding="table_wise")


class Loader:
    """The user's data position: which batch comes next (independent of the step number, as a
    real data loader's is), with the state_dict a restore needs."""

    def __init__(self) -> None:
        self.position = 0

    def next_seed(self) -> int:
        self.position += 1
        return 1000 + self.position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])


def _setup(with_loader_state: bool) -> DoctorSetup:
    model, dense = build_model(SPEC)
    loader = Loader()
    return DoctorSetup(
        model=model,
        optimizers=[dense],
        train_step=lambda step: train_step(model, dense, SPEC, loader.next_seed()),
        state=loader if with_loader_state else None,
    )


def passing() -> DoctorSetup:
    """A DLRM whose data position is given to deck as user state: restores exactly."""
    return _setup(with_loader_state=True)


def left_out_state() -> DoctorSetup:
    """The same job with the loader's position left out of ``state=``: after a restore the batches
    start over, so the losses differ while every saved tensor matches."""
    return _setup(with_loader_state=False)


def hidden_buffer() -> DoctorSetup:
    """A calibration of the logits kept in a buffer registered with ``persistent=False`` (so not in
    ``state_dict()``), updated by every training forward from this rank's batch (so rank-local:
    TorchRec's data-parallel wrapper does not broadcast buffers), scaling the loss."""
    setup = _setup(with_loader_state=True)
    over = setup.model.module.over_arch
    over.register_buffer("calibration", torch.zeros(1), persistent=False)

    def calibrate(module: torch.nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
        if module.training:
            with torch.no_grad():
                module.calibration.mul_(0.5).add_(out.detach().mean())
        return out * (1 + module.calibration)

    over.register_forward_hook(calibrate)
    return setup


def scheduled_combined() -> DoctorSetup:
    """TorchRec's DLRM recipe in a plain loop: ``CombinedOptimizer([fused, dense])`` under
    ``StepLR``, stepped as forward; zero_grad; backward; step; scheduler step. The fused kernel
    then runs each forward with the rate of the last zero_grad()/step(), one schedule step
    behind param_groups: a restore must give the kernel back its own rate."""
    from torchrec.optim.keyed import CombinedOptimizer

    model, dense = build_model(SPEC)
    opt = CombinedOptimizer([model.fused_optimizer, dense])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    loader = Loader()

    def step(_: int) -> float:
        loss = train_step(model, opt, SPEC, loader.next_seed())
        sched.step()
        return loss

    class State:
        def state_dict(self) -> dict[str, Any]:
            return {"loader": loader.state_dict(), "sched": sched.state_dict()}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            loader.load_state_dict(sd["loader"])
            sched.load_state_dict(sd["sched"])

    return DoctorSetup(model=model, optimizers=[opt], train_step=step, state=State())


def not_a_setup() -> Any:
    """A broken entry point: returns the model and optimizer instead of a DoctorSetup."""
    return build_model(SPEC)
