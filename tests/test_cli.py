"""The command line as a user runs it: compile (summary figures, passes, report, IR dumps), logits with and
without passes, and one clear error (exit 2, no traceback) for bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from beamc.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_compile_reproduces_the_seed_figures(capsys):
    assert main(["compile", str(ROOT / "models/beam.yaml"), "--passes", "none"]) == 0
    out = capsys.readouterr().out
    assert "total 501.3B, active per token 23.4B" in out
    assert "43 sliding-window (window 512, RoPE) + 9 full (NoPE)" in out
    assert "36 KiB/token on the full layers; 36 GiB for a 2^20-token context" in out
    assert "18 KiB/token on the full layers; 18 GiB for a 2^20-token context" in out
    assert "sliding+sparse  x40" in out and "full+sparse     x9" in out and "sliding+dense   x3" in out


def test_compile_tp8_report_lists_fewer_than_13_ops_per_moe_layer(capsys):
    assert main(["compile", str(ROOT / "models/beam.yaml"), "--tp", "8", "--report"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel rank 0 of 8" in out and "kv heads 1" in out
    assert "in launch order: 9 ops" in out
    assert "boundary 104" in out and "qk_norm_rope 43, qk_norm_ssmax 9, sigmoid_gate 52" in out


def test_compile_dumps_ir_before_and_after_each_pass(tmp_path, capsys):
    assert main(["compile", str(ROOT / "models/beam-tiny.yaml"), "--dump-ir", str(tmp_path),
                 "--disable", "fold_small"]) == 0
    files = sorted(p.name for p in (tmp_path / "decode").iterdir())
    assert "lowered.txt" in files and "00-norm_residual_norm.before.txt" in files
    assert "06-dense_swiglu.after.dot" in files and not any("fold_small" in f for f in files)
    assert "boundary(" in (tmp_path / "decode" / "00-norm_residual_norm.after.txt").read_text()


def test_logits_same_bits_with_and_without_passes(tmp_path, tiny_ckpt_nvfp4, capsys):
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"sequences": [list(range(1, 40)), [7, 8, 9]], "decode_steps": 3}))
    outs = {}
    for passes in ("none", "all"):
        out = tmp_path / f"{passes}.safetensors"
        assert main(["logits", str(ROOT / "models/beam-tiny.yaml"), "--checkpoint", str(tiny_ckpt_nvfp4),
                     "--input", str(batch), "-o", str(out), "--tp", "2", "--dtype", "bf16",
                     "--passes", passes]) == 0
        outs[passes] = load_file(out)
    assert set(outs["none"]) == {"prefill.0.tokens", "prefill.0.logits", "prefill.1.tokens", "prefill.1.logits",
                                 "decode.tokens", "decode.logits"}
    assert outs["none"]["decode.logits"].shape == (3, 2, 512)
    for k in outs["none"]:
        assert (outs["none"][k] == outs["all"][k]).all()


@pytest.mark.parametrize("argv, message", [
    (["compile", "models/nope.yaml"], "spec file not found"),
    (["compile", "models/beam.yaml", "--tp", "3"], "--tp: 3 does not divide vocab_size = 151936"),
    (["compile", "models/beam.yaml", "--passes", "bogus"], "unknown pass 'bogus'"),
    (["logits", "models/beam-tiny.yaml", "--checkpoint", "/nonexistent", "--input", "x.json", "-o", "o.st"],
     "input file not found"),
])
def test_bad_input_is_one_message_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_script_runs_the_main_job():
    r = subprocess.run([sys.executable, "-m", "beamc.cli", "compile", "models/beam-tiny.yaml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Beam-tiny" in r.stdout and "verified" in r.stdout


def test_unwritable_outputs_are_one_message(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert main(["compile", str(ROOT / "models/beam-tiny.yaml"), "--dump-ir", str(blocker / "ir")]) == 2
    err = capsys.readouterr().err
    assert "--dump-ir: cannot create directory" in err and "Traceback" not in err
