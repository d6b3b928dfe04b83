"""The native extension (``kernels/_native.c``) is built: without it deck runs on its torch/numpy
fallbacks and every native-only kernel test skips, so the missing build is named here."""

import os
import subprocess
import sys

import pytest
from deck.kernels import native


def test_the_native_kernels_are_built() -> None:
    assert native.native_built(), (
        "the native kernels deck.kernels._native are not built (pip install -e . needs a C "
        "compiler); deck runs on its torch/numpy fallbacks and the native tests skip"
    )
    assert native._built.__name__ == "deck.kernels._native"


@pytest.mark.native_only
def test_deck_native_off_runs_the_fallbacks_everywhere() -> None:
    """``DECK_NATIVE=off`` (read at import) makes a built extension act as missing, so a whole
    process (a trainer, the test suite) runs on the fallbacks; a value it does not know is a
    ConfigError naming the variable rather than a silent choice."""
    probe = (
        "from deck.kernels import native; "
        "print(native.native_built(), native.native_available(), native.native_module())"
    )

    def run(value: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, native.NATIVE_ENV: value}
        return subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )

    off = run("off")
    assert off.returncode == 0 and off.stdout.split() == ["True", "False", "None"], off
    on = run("on")
    assert on.returncode == 0 and on.stdout.split()[:2] == ["True", "True"], on
    bad = run("maybe")
    assert bad.returncode != 0 and "DECK_NATIVE='maybe'" in bad.stderr, bad.stderr


@pytest.mark.native_only
def test_use_native_switches_the_callers_path() -> None:
    saved = native._native
    try:
        native.use_native(False)
        assert native.native_module() is None and not native.native_available()
        native.use_native(True)
        assert native.native_module() is native._built
    finally:
        native._native = saved
