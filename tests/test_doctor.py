"""``deck doctor`` on user setups (tests/doctor_models.py): a real 2-rank gloo DMP job that deck
restores exactly passes (exit 0); a rank-local buffer registered with ``persistent=False`` and a
data position left out of ``state=`` fail (exit 1), naming the buffer and the losses; broken
entry points and arguments are usage errors (exit 2). The capture and the bitwise comparison are
also checked on their own, on plain torch modules, for every kind of entry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deck
from deck.cli import main
from deck.doctor import DoctorSetup, run_doctor
from deck.doctor.capture import capture, compare
from deck.doctor.report import loss_differences

ROOT = Path(__file__).resolve().parent.parent
SHORT = ("--steps", "4", "--every", "2", "--more", "3")


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deck.cli", "doctor", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


# ---- the check on its own: capture and compare -----------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def _torch_setup() -> DoctorSetup:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("hidden", torch.zeros(2), persistent=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()  # momentum buffers exist
    return DoctorSetup(model=model, optimizers=[opt], train_step=lambda step: 0.0, state=Counter())


def test_compare_names_every_kind_of_difference() -> None:
    setup = _torch_setup()
    live = capture(setup)
    assert compare(live, capture(setup)) == []  # capturing changes nothing
    model, opt = setup.model, setup.optimizers[0]
    with torch.no_grad():
        model[0].weight[1, 2] += 1.0
        model[1].running_mean[0] += 0.5
        model.hidden[1] = 3.0
    opt.param_groups[0]["lr"] = 0.05
    next(iter(opt.state.values()))["momentum_buffer"][0] += 1
    torch.rand(1)  # moves the RNG
    setup.state.n = 7
    found = {(kind, name): what for kind, name, what in compare(live, capture(setup))}
    assert found[("tensor", "0.weight")] == "1 of 12 elements differ (max abs difference 1)"
    assert ("buffer", "1.running_mean") in found
    assert ("non-persistent buffer", "hidden") in found
    assert found[("dense hyperparameter", "dense[0].param_groups[0].lr")] == (
        "0.1 live vs 0.05 after the restore"
    )
    assert ("dense optimizer state", "dense[0].state.0.momentum_buffer") in found
    assert ("rng", "torch cpu") in found
    assert found[("user state", "state.n")] == "0 live vs 7 after the restore"
    assert len(found) == 7, found


def test_missing_entries_and_dtypes_differ() -> None:
    a = {("tensor", "w"): torch.zeros(2), ("tensor", "gone"): torch.zeros(1)}
    b = {("tensor", "w"): torch.zeros(2, dtype=torch.float64), ("user state", "new"): 1}
    assert compare(a, b) == [
        ("tensor", "gone", "in the live state, missing after the restore"),
        ("tensor", "w", "dtype torch.float32 live vs torch.float64 after the restore"),
        ("user state", "new", "only after the restore, not in the live state"),
    ]
    # -0.0 == 0.0 numerically, but not bitwise
    assert compare({("rng", "x"): torch.tensor([0.0])}, {("rng", "x"): torch.tensor([-0.0])})


def test_losses_compare_bitwise() -> None:
    assert loss_differences(0, 7, [0.5, 0.3], [0.5, 0.3]) == []
    (d,) = loss_differences(1, 7, [0.5, 0.3], [0.5, 0.1 + 0.2])  # one ulp apart
    assert (d.rank, d.kind, d.name) == (1, "loss", "steps 7..8")
    assert d.detail.startswith("1 of 2 losses differ, first at step 8")


# ---- usage errors: exit 2 before any rank starts ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["no_such_module_xyz:setup"], "No module named 'no_such_module_xyz'"),
        (["tests.doctor_models:no_such_function"], "no attribute 'no_such_function'"),
        (["tests.doctor_models"], "must be package.module:function"),
        (["tests.doctor_models:SPEC"], "is a ModelSpec, not a function"),
        (["tests/no_such_file.py:setup"], "no_such_file.py does not exist"),
        (["tests.doctor_models:passing", "--steps", "5", "--every", "2"], "multiple of --every"),
        (["tests.doctor_models:passing", "--more", "0"], "--more >= 1"),
    ],
)
def test_usage_errors_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["doctor", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deck doctor: ") and says in err, err


# ---- real 2-rank runs -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_setup_deck_restores_exactly_passes(tmp_path: Path) -> None:
    uri = tmp_path / "ck"
    r = _doctor("tests.doctor_models:passing", *SHORT, "--uri", str(uri))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("deck doctor: PASS: step 4 restored bitwise on 2 ranks"), lines
    assert "differences:" not in r.stdout
    assert "fused optimizer state" in lines[1] and "user state" in lines[1], lines[1]
    # triu_indices and TorchRec's _features_order_tensor, which a fresh build only gets at its
    # first forward (compared after the first step after the restore), on each rank
    assert "4 non-persistent buffer" in lines[1], lines[1]
    for phase in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):  # progress on stderr
        assert f"deck doctor: {phase}" in r.stderr, r.stderr
    # --uri keeps the checkpoints, and the doctor refuses a URI that holds some
    assert 4 in {c.step for c in deck.list_checkpoints(str(uri))}
    assert main(["doctor", "tests.doctor_models:passing", "--uri", str(uri)]) == 2
    # ... and one holding anything, or that cannot be written (break-it findings: a folder of
    # the user's own files was written into; an unwritable one was a "difference", exit 1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    assert main(["doctor", "tests.doctor_models:passing", "--uri", str(mine)]) == 2
    assert main(["doctor", "tests.doctor_models:passing", "--uri", "/proc/nope"]) == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_a_hidden_rank_local_buffer_fails() -> None:
    r = _doctor("tests.doctor_models:hidden_buffer", *SHORT, "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert not report["passed"] and report["verdict"].startswith("deck doctor: FAIL: 4 differences")
    found = {(d["kind"], d["name"], d["rank"]) for d in report["differences"]}
    assert found == {
        ("non-persistent buffer", "over_arch.calibration", 0),
        ("non-persistent buffer", "over_arch.calibration", 1),
        ("loss", "steps 5..7", 0),
        ("loss", "steps 5..7", 1),
    }
    assert all(len(r) == 3 for r in report["losses"] + report["losses_after_restore"])


@pytest.mark.slow
def test_user_state_left_out_fails_on_the_losses() -> None:
    # The file-path form of the entry point, through the library call.
    report = run_doctor(
        str(ROOT / "tests" / "doctor_models.py") + ":left_out_state",
        steps=4,
        every=2,
        more=3,
        progress=False,
    )
    assert not report.passed
    # Every saved entry restored bitwise: only training on tells.
    assert [(d.kind, d.rank) for d in report.differences] == [("loss", 0), ("loss", 1)]
    assert report.differences[0].detail.startswith("3 of 3 losses differ, first at step 5")
    assert report.checked["user state"] == 0 and report.checked["tensor"] > 0
    text = report.text().splitlines()
    assert text[-1] == "deck doctor: FAIL: 2 differences (loss on ranks 0,1)"
    assert any("data loader position" in line for line in text)
    # With the state bitwise equal, the advice names every class of state that can explain it.
    advice = next(line for line in text if line.startswith("  loss:"))
    for cls in ("held by a kernel", "random number generators", "enable(state=...)"):
        assert cls in advice, advice


@pytest.mark.slow
def test_a_scheduled_combined_optimizer_in_a_plain_loop_passes(tmp_path: Path) -> None:
    """The fused kernel's own learning rate lags param_groups in this loop order: the
    doctor compares it (a kernel hyperparameter) and the restore gives it back exactly."""
    r = _doctor("tests.doctor_models:scheduled_combined", *SHORT, "--uri", str(tmp_path / "c"))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert "kernel hyperparameter" in lines[1], lines[1]
    assert lines[-1].startswith("deck doctor: PASS"), lines


@pytest.mark.slow
def test_an_entry_point_returning_no_setup_is_a_usage_error() -> None:
    r = _doctor("tests/doctor_models.py:not_a_setup", *SHORT)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "returned tuple; it must return a deck.DoctorSetup" in r.stderr, r.stderr
