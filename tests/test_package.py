"""deck installs like a package: ``python -m build`` makes an sdist and, from it, a wheel; the
wheel installs into a fresh virtual environment and runs there (``import deck``, ``deck
--version``, the demo's short mode), with deck coming from the wheel, not this checkout.

The fresh environment sees the pinned stack (torch, fbgemm-gpu-cpu, TorchRec, ...) through a
``.pth`` line naming a folder of links to this environment's site-packages entries, minus
deck's own: its editable finder and ``.pth`` and its ``dist-info``. A plain path line in a
``.pth`` puts that folder on ``sys.path`` without running the ``.pth`` files inside it, so
nothing can bring the checkout back in; the commands run outside the checkout, and the test
checks ``deck.__file__`` lies inside the fresh environment. TorchRec's links are added only
after deck's answer without them (the error naming the pip commands) is checked.

Without TorchRec (not a declared dependency), what needs it names the pip commands
(``deck.stack``): checked in the fresh venv and, quickly, in this one with TorchRec hidden.

The build runs without isolation (``--no-isolation``: the build backend from the dev extras,
``setuptools`` and ``wheel``), so nothing is downloaded; about 25 s in all on the project's
2-core VM, most of it the demo (two gloo ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from deck.version import __version__

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(sysconfig.get_paths()["purelib"])  # this environment's site-packages
# What a source distribution is built from (everything else of the checkout stays out, and a
# kernels/_native*.so built here for the editable install cannot slip into the wheel).
SOURCES = ("pyproject.toml", "README.md", "deck", "kernels", "adapters")
TORCHREC = ("torchrec",)  # entries of the stack hidden at first (with their dist-info)


def _run(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _clean_env() -> dict[str, str]:
    """The environment without anything that points Python at this checkout or this venv."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_NO_INDEX"] = "1"  # everything the wheel needs must already be in the stack
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _is_deck_entry(name: str) -> bool:
    low = name.lower()
    return low.startswith(("__editable__", "torchrec_deck-", "deck-")) or low == "deck"


def _is_torchrec_entry(name: str) -> bool:
    low = name.lower()
    return low in TORCHREC or any(low.startswith(f"{m}-") for m in TORCHREC)


def _link_stack(stack: Path, want: bool) -> list[str]:
    """Link into ``stack`` every entry of this site-packages but deck's (``want``: TorchRec's
    entries only, else everything but them). Returns the names linked."""
    linked = []
    for entry in sorted(SITE.iterdir()):
        name = entry.name
        if _is_deck_entry(name) or name == "__pycache__" or name.endswith(".pth"):
            continue
        if _is_torchrec_entry(name) != want:
            continue
        (stack / name).symlink_to(entry)
        linked.append(name)
    return linked


def _source_modules() -> set[str]:
    """Every module of the checkout as the wheel should hold it (deck.kernels = kernels/, ...)."""
    homes = {
        "deck": ROOT / "deck",
        "deck/kernels": ROOT / "kernels",
        "deck/adapters": ROOT / "adapters",
    }
    found = set()
    for prefix, folder in homes.items():
        for f in folder.rglob("*.py"):
            rel = f.relative_to(folder)
            if "__pycache__" in rel.parts:
                continue
            if prefix == "deck" and rel.parts[0] in ("kernels", "adapters"):
                continue  # not deck's (none there today: deck.kernels is kernels/)
            found.add(f"{prefix}/{rel.as_posix()}")
    return found


@pytest.mark.slow
def test_sdist_and_wheel_build_install_and_run_in_a_fresh_venv(tmp_path: Path) -> None:
    env = _clean_env()
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=skip)
        else:
            shutil.copy2(path, src / name)

    # 1. sdist, then the wheel built from the unpacked sdist (build's default): the sdist builds
    dist = tmp_path / "dist"
    r = _run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
        tmp_path,
        env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,) = dist.glob("torchrec_deck-*.tar.gz")
    (wheel,) = dist.glob("torchrec_deck-*.whl")
    assert sdist.name == f"torchrec_deck-{__version__}.tar.gz"  # the version of deck/version.py
    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"kernels/_native.c", "pyproject.toml", "README.md", "deck/py.typed"} <= in_sdist
    with zipfile.ZipFile(wheel) as z:
        in_wheel = set(z.namelist())
        metadata = z.read(f"torchrec_deck-{__version__}.dist-info/METADATA").decode()
    # Every module of the checkout, the compiled kernels (not their source) and the marker
    missing = _source_modules() - in_wheel
    assert not missing, f"modules left out of the wheel (pyproject's packages list?): {missing}"
    assert any(n.startswith("deck/kernels/_native.") and n.endswith(".so") for n in in_wheel)
    assert "deck/kernels/_native.c" not in in_wheel and "deck/py.typed" in in_wheel
    assert "Requires-Dist: torch<2.14,>=2.13" in metadata, metadata
    assert "torchrec" not in metadata.split("Requires-Dist: torch<", 1)[1].split("Provides")[0]

    # 2. A fresh venv that sees the stack (without TorchRec for now) but not this deck
    venv = tmp_path / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    assert r.returncode == 0, r.stderr
    python = venv / "bin" / "python"
    fresh_site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            tmp_path,
            env,
        ).stdout.strip()
    )
    stack = tmp_path / "stack"
    stack.mkdir()
    linked = _link_stack(stack, want=False)
    assert "torch" in linked and "fbgemm_gpu" in linked, linked
    (fresh_site / "deck_test_stack.pth").write_text(f"{stack}\n")
    work = tmp_path / "work"  # the current folder of every command: not the checkout
    work.mkdir()
    r = _run([str(python), "-c", "import deck"], work, env)
    assert r.returncode != 0 and "No module named 'deck'" in r.stderr, r.stderr

    # 3. Install the wheel: its dependencies must all be satisfied by the stack (no index)
    r = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-cache-dir",
            str(wheel),
        ],
        work,
        env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    probe = (
        "import json, importlib.metadata, deck, deck.kernels.native as n\n"
        "print(json.dumps({'file': deck.__file__, 'version': deck.__version__,\n"
        "  'dist': importlib.metadata.version('torchrec-deck'), 'native': n.native_built(),\n"
        "  'native_file': n._built.__file__ if n._built else None}))\n"
    )
    r = _run([str(python), "-c", probe], work, env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert Path(got["file"]).is_relative_to(venv), got  # deck came from the wheel
    assert Path(got["native_file"]).is_relative_to(venv), got  # compiled from the sdist's C
    assert got["version"] == got["dist"] == __version__ and got["native"], got
    assert (Path(got["file"]).parent / "py.typed").is_file()

    r = _run([str(venv / "bin" / "deck"), "--version"], work, env)
    assert r.returncode == 0 and __version__ in r.stdout, r.stdout + r.stderr

    # 4. Without TorchRec: what needs it names the pip commands; import deck does not need it
    r = _run([str(python), "-c", "import deck; deck.enable"], work, env)
    assert r.returncode != 0 and "MissingDependencyError" in r.stderr, r.stderr
    assert "pip install --no-deps torchrec==1.8.0" in r.stderr, r.stderr
    r = _run([str(python), "-m", "deck.demo", "--steps", "1"], work, env)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "pip install fbgemm-gpu-cpu==1.8.0" in r.stderr, r.stderr

    # 5. With TorchRec: the demo's short mode trains, checkpoints, restores and verifies
    assert _link_stack(stack, want=True), "no torchrec in this environment's site-packages"
    out = tmp_path / "demo"
    small = ["--tables", "2", "--rows", "2000", "--dim", "8", "--batch", "64", "--no-dcp"]
    small += ["--delta-every", "2"]
    r = _run(
        [str(python), "-m", "deck.demo", *small, "--steps", "4", "--out", str(out)],
        work,
        env,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verified: restored state is bitwise equal" in r.stdout, r.stdout
    assert f"{venv}/bin/deck ls" in r.stdout, r.stdout  # the demo names the wheel's command


# Hides TorchRec from the import system of the interpreter it runs in, as if not installed.
HIDE_TORCHREC = """
import importlib.machinery, sys
class _Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "torchrec":
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [_Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def test_without_torchrec_what_needs_it_names_the_pip_commands(tmp_path: Path) -> None:
    """TorchRec is not a declared dependency: without it, import deck and the reading commands
    work, and each way in that needs it raises MissingDependencyError (a DeckError) naming the
    pip commands; the deck command says it in one line, exit 2."""
    code = HIDE_TORCHREC + (
        "import json, deck\n"
        "from deck.cli import main\n"
        "out = {}\n"
        "for name in ('enable', 'DeckDistributedModelParallel', 'run_doctor'):\n"
        "    try:\n"
        "        getattr(deck, name)\n"
        "    except deck.MissingDependencyError as e:\n"
        "        out[name] = str(e)\n"
        "try:\n"
        "    deck.load(None, [], sys.argv[1])\n"
        "except deck.MissingDependencyError as e:\n"
        "    out['load'] = str(e)\n"
        "out['doctor'] = main(['doctor', 'my_setup:make'])\n"
        "out['ls'] = main(['ls', sys.argv[1]])\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("enable", "DeckDistributedModelParallel", "run_doctor", "load"):
        assert f"deck.{name} needs TorchRec 1.8.0" in got[name], got
        assert "pip install --no-deps torchrec==1.8.0" in got[name], got[name]
        assert "pip install fbgemm-gpu-cpu==1.8.0" in got[name], got[name]
    assert got["doctor"] == 2 and got["ls"] == 2, got  # ls: an empty folder, nothing there
    doctor_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("deck doctor:")]
    assert len(doctor_lines) == 1 and "torchrec is not installed" in doctor_lines[0], r.stderr
