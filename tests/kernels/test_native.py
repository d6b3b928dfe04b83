"""The native extension (``kernels/_native.c``) is built: without it deck runs on its torch/numpy
fallbacks and every native-only kernel test skips, so the missing build is named here."""

from deck.kernels import native


def test_the_native_kernels_are_built() -> None:
    assert native.native_available(), (
        "the native kernels deck.kernels._native are not built (pip install -e . needs a C "
        "compiler); deck runs on its torch/numpy fallbacks and the native tests skip"
    )
    assert native.native_module().__name__ == "deck.kernels._native"
