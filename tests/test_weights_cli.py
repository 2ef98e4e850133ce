"""`rlpipe weights` diff/apply/verify on safetensors files, run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]


def weights(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run `python -m apps.weights_cli weights ...` and capture its output."""
    command = [sys.executable, "-m", "apps.weights_cli", "weights", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """BASE and NEW safetensors files: bf16 weights with a few percent changed, plus extras."""
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(50_000, generator=gen) * 0.02
    step = torch.randn(50_000, generator=gen).sign() * 3e-6
    fp8 = torch.randn(64, generator=gen).to(torch.float8_e4m3fn)
    base = {"w": master.to(torch.bfloat16), "fp8": fp8, "gone": torch.zeros(3)}
    new = {"w": (master + step).to(torch.bfloat16), "fp8": fp8, "ids": torch.arange(9)}
    paths = {"base": tmp_path / "base.safetensors", "new": tmp_path / "new.safetensors"}
    save_file(base, paths["base"])
    save_file(new, paths["new"])
    return {**paths, "delta": tmp_path / "d.rlpd", "out": tmp_path / "out.safetensors"}


def test_diff_apply_verify_reproduces_new_bit_for_bit(files: dict[str, Path]) -> None:
    diff = weights("diff", files["base"], files["new"], "-o", files["delta"], "--base-version", "4")
    assert diff.returncode == 0, diff.stderr
    assert files["delta"].stat().st_size < files["new"].stat().st_size / 5
    apply = weights("apply", files["base"], files["delta"], "-o", files["out"])
    assert apply.returncode == 0, apply.stderr
    verify = weights("verify", files["out"], files["new"])
    assert verify.returncode == 0 and "OK" in verify.stdout
    out, new = load_file(files["out"]), load_file(files["new"])
    assert out.keys() == new.keys()
    assert torch.equal(out["w"].view(torch.int16), new["w"].view(torch.int16))


def test_snapshot_applies_without_a_base(files: dict[str, Path]) -> None:
    assert weights("snapshot", files["new"], "-o", files["delta"]).returncode == 0
    assert weights("apply", "-", files["delta"], "-o", files["out"]).returncode == 0
    assert weights("verify", files["out"], files["new"]).returncode == 0


def test_verify_reports_the_first_difference_with_exit_1(files: dict[str, Path]) -> None:
    result = weights("verify", files["base"], files["new"])
    assert result.returncode == 1
    assert "w: " in result.stdout and "differ, first at flat index" in result.stdout
    assert "missing tensor 'ids'" in result.stdout and "MISMATCH" in result.stdout


def test_wrong_base_exits_3_without_traceback(files: dict[str, Path]) -> None:
    assert weights("diff", files["base"], files["new"], "-o", files["delta"]).returncode == 0
    result = weights("apply", files["new"], files["delta"], "-o", files["out"])
    assert result.returncode == 3
    assert "wrong base" in result.stderr and "Traceback" not in result.stderr
    assert not files["out"].exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_delta_exits_4_without_traceback(files: dict[str, Path], damage: str) -> None:
    assert weights("diff", files["base"], files["new"], "-o", files["delta"]).returncode == 0
    blob = bytearray(files["delta"].read_bytes())
    if damage == "truncate":
        blob = blob[: len(blob) - 100]
    else:
        blob[-50] ^= 0xFF  # inside the last chunk's payload
    files["delta"].write_bytes(bytes(blob))
    result = weights("apply", files["base"], files["delta"], "-o", files["out"])
    assert result.returncode == 4, result.stderr
    assert "corrupt delta" in result.stderr and "Traceback" not in result.stderr


def test_unreadable_input_exits_2(files: dict[str, Path], tmp_path: Path) -> None:
    missing = weights("diff", tmp_path / "nope.safetensors", files["new"], "-o", files["delta"])
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    bad = weights("verify", garbage, files["new"])
    assert bad.returncode == 2 and "header" in bad.stderr
