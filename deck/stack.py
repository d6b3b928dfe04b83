"""The TorchRec stack: present or not, and what to install when it is not.

torch is a declared dependency of the distribution; TorchRec is not: its wheel declares the CUDA
build of fbgemm-gpu (gigabytes), which a CPU machine must not get, and pip has no way to say
"fbgemm-gpu or fbgemm-gpu-cpu". So the stack is installed beside deck by hand (README, Install;
the Makefile does it with exact pins), and what needs it checks here first: a missing piece is
a :class:`deck.errors.MissingDependencyError` naming the pip commands, not a bare
``ModuleNotFoundError`` from deep inside TorchRec. ``import deck`` and the commands that only
read checkpoints (``deck ls``, ``deck merge``, ...) need none of it.
"""

from __future__ import annotations

import importlib.util

from deck.errors import MissingDependencyError

# The pins this release is tested with (the Makefile's); fbgemm-gpu is built for one torch minor.
TORCH_PIN = "2.13.0"
FBGEMM_PIN = "1.8.0"
TORCHREC_PIN = "1.8.0"

# Import names of the stack: TorchRec, fbgemm, and TorchRec's dependencies that --no-deps skips
# (tqdm is deck's own dependency).
STACK_MODULES = ("torchrec", "fbgemm_gpu", "tensordict", "torchmetrics", "pyre_extensions")

INSTALL_STEPS = (
    f"pip install fbgemm-gpu-cpu=={FBGEMM_PIN} (with CUDA: pip install fbgemm-gpu=={FBGEMM_PIN})",
    f"pip install --no-deps torchrec=={TORCHREC_PIN}",
    "pip install tensordict torchmetrics==1.0.3 pyre-extensions",
)


def missing_stack_error(module: str, what: str) -> MissingDependencyError:
    """The error for ``what`` (e.g. ``deck.enable``) when the stack's ``module`` is missing."""
    steps = "; ".join(INSTALL_STEPS)
    return MissingDependencyError(
        f"{what} needs TorchRec {TORCHREC_PIN} and fbgemm-gpu {FBGEMM_PIN} (for torch "
        f"{TORCH_PIN}), and {module} is not installed. They are not dependencies of "
        "torchrec-deck (TorchRec's wheel asks for the multi-GB CUDA fbgemm-gpu): install them "
        f"into this environment with: {steps} (README.md, Install)"
    )


def is_stack_module(error: ModuleNotFoundError) -> bool:
    """Whether ``error`` is a missing module of the stack."""
    return (error.name or "").split(".")[0] in STACK_MODULES


def require_torchrec(what: str) -> None:
    """Raise :class:`MissingDependencyError` unless every module of the stack can be found
    (looked up, not imported: TorchRec's import takes seconds)."""
    for module in STACK_MODULES:
        if importlib.util.find_spec(module) is None:
            raise missing_stack_error(module, what)
