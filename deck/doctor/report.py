"""What ``deck doctor`` found: every difference (rank, kind, name, what), the losses of both runs,
the text report ending in one verdict line, and its JSON form."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from deck.doctor.capture import (
    BUFFER,
    DENSE_HYPER,
    DENSE_STATE,
    FUSED_HYPER,
    FUSED_STATE,
    HIDDEN_BUFFER,
    KERNEL_HYPER,
    RNG,
    TENSOR,
    USER,
)

LOSS = "loss"  # losses after the restore vs the uninterrupted run's
RESTORE = "restore"  # the restore did not load the checkpointed step
DECK_ERROR = "deck error"  # deck raised while enabling, checkpointing or restoring

# What to do about each kind of difference (the text report's last lines).
_OPTIMIZER_HINT = (
    "an optimizer's state differs after the restore: pass every optimizer (TorchRec wrappers "
    "included) to deck.enable; if they all are, this is a deck defect: report it with this output"
)
HINTS = {
    # (a break-it finding: a train_step writing rows outside lookups was told "a deck defect")
    TENSOR: "in model.state_dict() but not restored bitwise: if train_step writes table rows "
    "outside a lookup (a max-norm clamp, rows re-initialised by hand), deck does not see them: "
    "name them with ck.mark_rows(table, ids) in your job (README, Limits); else a deck defect: "
    "report it with this output",
    BUFFER: "a buffer in model.state_dict() not restored bitwise: deck saves one copy of the dense "
    "state unless it keeps rank-local buffers per rank; report it with this output",
    HIDDEN_BUFFER: "registered with persistent=False, so model.state_dict() leaves it out and deck "
    "never sees it: register it persistent, or save it through enable(state=...)",
    FUSED_STATE: _OPTIMIZER_HINT,
    FUSED_HYPER: _OPTIMIZER_HINT,
    DENSE_STATE: _OPTIMIZER_HINT,
    DENSE_HYPER: _OPTIMIZER_HINT,
    RNG: "torch's random number generator is not where the uninterrupted run had it: deck "
    "restores it with DeckConfig.save_rng (on by default); with it off, save "
    "torch.get_rng_state() in your state",
    USER: "your state's load_state_dict() (or set) does not put back what state_dict() (or get) "
    "returned",
    KERNEL_HYPER: "a hyperparameter the embedding kernel (fbgemm's TBE) holds apart from "
    "param_groups: its learning_rate_tensor (TorchRec copies param_groups[0]['lr'] into it only "
    "in the fused optimizer's zero_grad()/step()) or optimizer_args (update_hyper_parameters): "
    "deck restores them as the kernel held them; report it with this output",
    LOSS: "training on from the restore differs from never stopping although everything above "
    "was restored bitwise: what drives training lies outside the state this check captures. "
    "The classes of state that can explain it: (1) hyperparameters held by a kernel or module "
    "apart from param_groups and state_dict (a custom kernel's learning rate or step counter); "
    "(2) random number generators other than torch's default ones (numpy, Python's random, a "
    "torch.Generator of your own, a data loader worker's seed); (3) training state not passed "
    "to enable(state=...) (DoctorSetup.state): a data loader position, a counter or schedule "
    "of your own. Save each through enable(state=...)",
    RESTORE: "the restore did not load the step that was checkpointed",
    DECK_ERROR: "deck could not checkpoint or restore this setup: see the error",
}


@dataclass(frozen=True)
class Difference:
    """One thing that is not bitwise equal after the restore, on one rank."""

    rank: int
    kind: str  # a kind of deck.doctor.capture (tensor, buffer, ...), or loss, restore, deck error
    name: str  # the tensor / optimizer field / hyperparameter / buffer / RNG / user-state entry
    detail: str  # what differs


@dataclass
class DoctorReport:
    """The outcome of one ``deck doctor`` run. ``passed`` only when no difference was found:
    every captured entry bitwise equal on every rank and every loss after the restore bitwise
    equal to the uninterrupted run's."""

    entry: str
    ranks: int
    steps: int
    every: int
    more: int
    uri: str | None  # where the checkpoints are; None: a temporary folder, removed
    checked: dict[str, int] = field(default_factory=dict)  # entries compared, all ranks
    differences: list[Difference] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)  # per rank, never stopped
    losses_after_restore: list[list[float]] = field(default_factory=list)  # per rank

    @property
    def passed(self) -> bool:
        return not self.differences

    def verdict(self) -> str:
        """One line: ``deck doctor: PASS ...`` or ``deck doctor: FAIL: N differences (...)``."""
        first, last = self.steps + 1, self.steps + self.more
        if self.passed:
            return (
                f"deck doctor: PASS: step {self.steps} restored bitwise on {self.ranks} ranks "
                f"({sum(self.checked.values())} entries compared, all ranks) and steps {first}..{last} gave "
                "the losses of never stopping"
            )
        by_kind: dict[str, set[int]] = defaultdict(set)
        for d in self.differences:
            by_kind[d.kind].add(d.rank)
        what = "; ".join(
            f"{kind} on rank{'s' if len(r) > 1 else ''} {','.join(map(str, sorted(r)))}"
            for kind, r in by_kind.items()
        )
        n = len(self.differences)
        return f"deck doctor: FAIL: {n} difference{'s' if n != 1 else ''} ({what})"

    def text(self, limit: int = 50) -> str:
        """The human report: what ran, what was compared, each difference (at most ``limit``
        lines), what to do, and the verdict as the last line."""
        lines = [
            f"deck doctor {self.entry}: {self.ranks} gloo ranks, steps 1..{self.steps} with a "
            f"checkpoint every {self.every}, restore of step {self.steps} into a fresh build, "
            f"steps {self.steps + 1}..{self.steps + self.more} trained on both",
            "compared (all ranks): "
            + (
                ", ".join(f"{n} {kind}" for kind, n in self.checked.items() if n)
                or "nothing (the run stopped before the capture)"
            ),
        ]
        if self.differences:
            lines.append("differences:")
            width = max(len(d.kind) for d in self.differences)
            lines += [
                f"  rank {d.rank}  {d.kind:<{width}}  {d.name}: {d.detail}"
                for d in self.differences[:limit]
            ]
            if len(self.differences) > limit:
                lines.append(f"  ... and {len(self.differences) - limit} more (--json lists all)")
            lines.append("what to do:")
            kinds = dict.fromkeys(d.kind for d in self.differences)
            lines += [f"  {kind}: {_hint(kind, len(kinds))}" for kind in kinds]
        lines.append(self.verdict())
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (``passed`` and ``verdict`` included)."""
        out = asdict(self)
        out["passed"] = self.passed
        out["verdict"] = self.verdict()
        return out


def _hint(kind: str, kinds: int) -> str:
    if kind == LOSS and kinds > 1:  # the state that differs is the likelier cause
        return "fix the differences above first: losses follow from the state they train on"
    return HINTS[kind]


def loss_differences(
    rank: int, first_step: int, before: list[float], after: list[float]
) -> list[Difference]:
    """A :class:`Difference` when the losses after the restore are not bitwise those of the
    uninterrupted run (``before``), naming the first step that differs."""
    bad = [
        i
        for i in range(max(len(before), len(after)))
        if i >= len(before) or i >= len(after) or before[i].hex() != after[i].hex()
    ]
    if not bad:
        return []
    i = bad[0]
    a = repr(before[i]) if i < len(before) else "none"
    b = repr(after[i]) if i < len(after) else "none"
    return [
        Difference(
            rank,
            LOSS,
            f"steps {first_step}..{first_step + max(len(before), len(after)) - 1}",
            f"{len(bad)} of {len(before)} losses differ, first at step {first_step + i}: {a} "
            f"never stopping vs {b} after the restore",
        )
    ]
