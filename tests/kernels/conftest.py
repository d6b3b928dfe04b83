"""Every kernel test runs twice: against the C extension (``kernels/_native.c``) and against the
torch/numpy fallbacks an install without a C compiler runs (``deck.kernels.native.use_native``),
so CI, which has the compiler, tests both. A test of the extension's own interface (its argument
checks, its journal, calls of ``native._native``) is marked ``native_only`` and is not
collected for the fallback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from deck.kernels import native


# Module scope: the switch is flipped once per module and backend (pytest groups the tests by
# it), and hypothesis tests may use it (a function-scoped fixture would fail its health check).
@pytest.fixture(autouse=True, scope="module", params=["native", "fallback"])
def kernel_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The kernels' backend for this module's tests: ``native`` or ``fallback``."""
    if request.param == "native" and not native.native_built():
        # tests/kernels/test_native.py fails naming the missing build; the rest skip.
        pytest.skip("the C kernel is not built")
    saved = native._native
    native.use_native(request.param == "native")
    try:
        yield request.param
    finally:
        native._native = saved


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``native_only`` test is not collected for the fallback backend (it tests the C
    extension itself; the fallback has no such interface): not a skip, there is nothing to run."""
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("kernel_backend") if callspec is not None else None
        native_only = item.get_closest_marker("native_only") is not None
        (drop if backend == "fallback" and native_only else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
