"""What ``deck doctor`` asks of the user: a :class:`DoctorSetup` built by their entry point."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deck.errors import DoctorError

# DeckConfig fields the doctor sets itself (from --uri and --every).
DOCTOR_FIELDS = ("uri", "delta_every_steps")


@dataclass
class DoctorSetup:
    """Your training job as ``deck doctor`` runs it; your entry point builds one on every rank,
    after the gloo process group is up (``torch.distributed`` is initialised), and is called
    again for the fresh build that the checkpoint is restored into.

    - ``model``: your TorchRec ``DistributedModelParallel`` (a plain one: the doctor enables deck
      itself, so not a ``deck.DeckDistributedModelParallel``).
    - ``optimizers``: your dense optimizer(s) exactly as you pass them to ``deck.enable`` (a torch
      optimizer, a TorchRec ``KeyedOptimizerWrapper`` / ``CombinedOptimizer``, a list of them).
    - ``train_step``: ``train_step(step) -> loss``: one training step of this rank (its batch of
      ``step``, forward, backward, optimizer step); returns the loss (a float or a 0-dim tensor).
      The doctor calls it with steps 1, 2, ... and, after the restore, again with the steps that
      follow the restored one: a job that derives its batches from anything but ``step`` must
      save that position in ``state``.
    - ``state``: your user state as you pass it to ``deck.enable(state=...)`` (an object with
      ``state_dict()``/``load_state_dict()`` or a ``(get, set)`` pair), or None.
    - ``config``: ``DeckConfig`` fields to set (``staging``, ``full_every_steps``, ...); the doctor
      sets ``uri`` and ``delta_every_steps`` itself.
    """

    model: Any
    optimizers: Any
    train_step: Callable[[int], Any]
    state: Any = None
    config: Mapping[str, Any] = field(default_factory=dict)


def normalize_entry(entry: str) -> str:
    """``entry`` with a file path made absolute (spawned ranks resolve it from any directory).

    Raises :class:`DoctorError` when ``entry`` is not ``package.module:function`` or
    ``path/to/file.py:function``."""
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr:
        raise DoctorError(
            f"entry point {entry!r} must be package.module:function or path/to/file.py:function "
            "(a function returning a deck.DoctorSetup)"
        )
    if _is_file(target):
        target = str(Path(target).resolve())
    return f"{target}:{attr}"


def load_entry(entry: str) -> Callable[[], Any]:
    """The function ``entry`` names, imported (a module from the current directory or
    ``sys.path``, or a ``.py`` file). Raises :class:`DoctorError` naming the entry point and why
    it could not be loaded."""
    target, _, attr = normalize_entry(entry).rpartition(":")
    try:
        module = _import_file(target) if _is_file(target) else _import_module(target)
        fn = functools.reduce(getattr, attr.split("."), module)
    except DoctorError:
        raise
    except Exception as e:
        raise DoctorError(
            f"cannot load entry point {entry!r}: {type(e).__name__}: {e} (is the module importable "
            "from the current directory, or the file path right?)"
        ) from e
    if not callable(fn):
        raise DoctorError(f"entry point {entry!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def build_setup(entry: str) -> DoctorSetup:
    """Call ``entry`` and check what it returned. Raises :class:`DoctorError` when it is not a
    usable :class:`DoctorSetup`; exceptions of the user's function propagate."""
    setup = load_entry(entry)()
    if not isinstance(setup, DoctorSetup):
        raise DoctorError(
            f"entry point {entry!r} returned {type(setup).__name__}; it must return a "
            "deck.DoctorSetup(model=..., optimizers=..., train_step=...)"
        )
    if not callable(setup.train_step):
        raise DoctorError(f"{entry}: DoctorSetup.train_step must be a function train_step(step)")
    from deck.trainer.wrapper import DeckDistributedModelParallel

    if isinstance(setup.model, DeckDistributedModelParallel):
        raise DoctorError(
            f"{entry}: the model is a deck.DeckDistributedModelParallel; the doctor enables deck "
            "itself: return a plain torchrec DistributedModelParallel"
        )
    taken = sorted(set(DOCTOR_FIELDS) & set(setup.config))
    if taken:
        raise DoctorError(
            f"{entry}: DoctorSetup.config sets {taken}: the doctor sets these itself "
            "(set the doctor's uri and every instead)"
        )
    return setup


def _is_file(target: str) -> bool:
    return target.endswith(".py") or os.sep in target


def _import_module(name: str) -> Any:
    # Like `python -m` and uvicorn: the current directory's modules are importable.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(name)


def _import_file(path: str) -> Any:
    if not os.path.isfile(path):
        raise DoctorError(f"entry point file {path} does not exist")
    # One module per file (its path's hash in the name): two entry files may share a name.
    name = f"deck_doctor_entry_{Path(path).stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DoctorError(f"entry point file {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and spawned ranks look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
