"""``deck doctor``: check that deck restores *your* model exactly, before you rely on it.

Your entry point (``package.module:function`` or ``path/to/file.py:function``) returns a
:class:`DoctorSetup` (model, dense optimizers, ``train_step(step)``, user state) on every rank.
:func:`run_doctor` spawns N gloo CPU ranks, trains K steps with deck (a checkpoint every E),
captures the live state at step K with torch's and TorchRec's own APIs, trains M steps on, then
builds a fresh setup, restores step K with deck, compares bitwise and trains the same M steps.
The :class:`DoctorReport` names every difference per rank (tensor, buffer, optimizer state,
hyperparameter, RNG, user state, losses) and ends in one verdict line.

This is an application of deck (it runs training processes), like the demo: it may import the
trainer and the adapters; nothing in deck's layers imports it.
"""

from deck.doctor.report import Difference, DoctorReport
from deck.doctor.run import run_doctor
from deck.doctor.setup import DoctorSetup

__all__ = ["Difference", "DoctorReport", "DoctorSetup", "run_doctor"]
