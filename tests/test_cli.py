"""The command line as a user runs it: compile (summary figures, passes, report, IR dumps), logits with and
without passes, and one clear error (exit 2, no traceback) for bad input."""
from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from beamc.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "models/beam-tiny.yaml")


def one_error(err: str, where: str | None = None) -> str:
    """The stderr of a refused command: exactly one line `beamc: error: <where>: ...`, no traceback."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("beamc: error: "), err
    if where is not None:
        assert lines[0].startswith(f"beamc: error: {where}: "), err
    return lines[0]


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
    assert "in launch order: 7 ops" in out and "attention_gate 52" in out and "qk_attention 52" in out
    assert "boundary 104" in out and "qk_norm_rope 43, qk_norm_ssmax 9, sigmoid_gate 52" in out


def test_compile_report_of_a_spec_without_moe_layers_and_of_another_model(tmp_path, capsys):
    """--report on a dense-only spec describes its first layer (no traceback), and the measured per-pass effects,
    which are Beam's, are printed for Beam only."""
    import yaml

    assert main(["compile", str(ROOT / "models/beam.yaml"), "--tp", "8", "--report"]) == 0
    assert ("measured effect of each pass" in capsys.readouterr().out) == any(
        (ROOT / "bench/results").glob("ablation-*.json"))
    data = yaml.safe_load((ROOT / "models/beam.yaml").read_text())
    data["name"] = "dense-only"
    data["layers"]["dense_first"] = data["num_layers"]
    (tmp_path / "dense.yaml").write_text(yaml.safe_dump(data))
    assert main(["compile", str(tmp_path / "dense.yaml"), "--tp", "8", "--report"]) == 0
    out, err = capsys.readouterr()
    assert "ops left in layer 0 (sliding+dense; the spec has no MoE layer)" in out and not err
    assert "measured effect of each pass" not in out


def test_compile_dumps_ir_before_and_after_each_pass(tmp_path, capsys):
    assert main(["compile", str(ROOT / "models/beam-tiny.yaml"), "--dump-ir", str(tmp_path),
                 "--disable", "fold_small"]) == 0
    files = sorted(p.name for p in (tmp_path / "decode").iterdir())
    assert "lowered.txt" in files and "00-norm_residual_norm.before.txt" in files
    assert "06-dense_swiglu.after.dot" in files and not any("fold_small" in f for f in files)
    assert "boundary(" in (tmp_path / "decode" / "00-norm_residual_norm.after.txt").read_text()
    n = sum(1 for phase in ("prefill", "decode") for _ in (tmp_path / phase).iterdir())
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        f"wrote IR dumps to {tmp_path / 'prefill'}, {tmp_path / 'decode'}: {n} files")


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
    (["compile", "models/beam.yaml", "--tp", "3"], "--tp: 3 does not divide "),
    (["compile", "models/beam.yaml", "--passes", "bogus"], "unknown pass 'bogus'"),
    (["logits", "models/beam-tiny.yaml", "--checkpoint", "/nonexistent", "--input", "x.json", "-o", "o.st"],
     "input file not found"),
    (["compile", "models/beam-tiny.yaml", "--tp", "0"], "--tp: must be >= 1, got 0"),
    (["compile", "models/beam-tiny.yaml", "--tp", "-1"], "--tp: must be >= 1, got -1"),
    (["compile", "models/beam-tiny.yaml", "--rank", "9"], "--rank: must be in [0, 1), got 9"),
    (["compile", "models/beam-tiny.yaml", "--tp", "2", "--rank", "-1"], "--rank: must be in [0, 2), got -1"),
    (["compile", "/dev/zero"], "/dev/zero: not a regular file, expected a spec YAML file"),
    (["compile", "models"], "models: is a directory, expected a spec YAML file"),
    (["import-hf", "models/beam.yaml/config.json"], "config file not found"),
    (["init-weights", "models/beam-tiny.yaml", "-o", "/proc/x/ck"],
     "-o: cannot create directory /proc/x/ck: No such file or directory"),
    (["init-weights", "models/beam-tiny.yaml", "-o", "models/beam.yaml"], "exists and is not a directory"),
    (["compile", "models/beam-tiny.yaml", "--set", "attention_decode.NUM_WARPS=8"],
     "--set: template overrides shape the generated package, and none is written (add -o DIR)"),
    (["compile", "models/beam-tiny.yaml", "--set", "attention_decode.WARPS=8", "-o", "{tmp}/pkg"],
     "--set attention_decode.WARPS: template attention_decode reads no constant 'WARPS'"),
    (["compile", "models/beam-tiny.yaml", "--set", "warps=8", "-o", "{tmp}/pkg"],
     "--set 'warps=8': not of the form TEMPLATE.CONSTANT=VALUE"),
])
def test_bad_input_is_one_message_and_exit_2(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert message in one_error(capsys.readouterr().err)


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


# ---- bad input, refused before any compute: one line `beamc: error: <where>: <what> (<fix>)`, exit 2 ----

@pytest.fixture
def no_compute(monkeypatch):
    """`beamc logits` fails the test if it gets as far as compiling, running or writing: every check comes first."""
    import beamc.logits

    def computed(*a, **kw):
        raise AssertionError("bad input reached compute")

    for name in ("compile_graphs", "run_logits", "save_file"):
        monkeypatch.setattr(beamc.logits, name, computed)


@pytest.fixture
def batch(tmp_path) -> Path:
    p = tmp_path / "batch.json"
    p.write_text(json.dumps({"sequences": [[1, 2, 3]], "decode_steps": 1}))
    return p


def _logits(ckpt, batch, out, *extra) -> list[str]:
    return ["logits", TINY, "--checkpoint", str(ckpt), "--input", str(batch), "-o", str(out), *map(str, extra)]


@pytest.mark.parametrize("out, extra, where, message", [
    ("DIR", [], "-o", "is a directory, expected a file path"),
    ("/proc/x.safetensors", [], "-o", "cannot write /proc/x.safetensors: No such file or directory"),
    ("/proc/x/o.safetensors", [], "-o", "cannot create directory /proc/x: No such file or directory"),
    ("FILE/sub/o.safetensors", [], "-o", "is not a directory"),
    ("o.safetensors", ["--tp", "0"], "--tp", "must be >= 1, got 0"),
    ("o.safetensors", ["--tp", "-1"], "--tp", "must be >= 1, got -1"),
    ("o.safetensors", ["--tp", "3"], "--tp", "3 does not divide"),
    ("o.safetensors", ["--device", "potato"], "--device", "unknown device 'potato' (use cpu, cuda or cuda:N)"),
    ("o.safetensors", ["--device", "cuda:x"], "--device", "unknown device 'cuda:x' (use cpu, cuda or cuda:N)"),
    ("o.safetensors", ["--device", "meta"], "--device", "'meta' is not supported (use cpu, cuda or cuda:N)"),
    ("o.safetensors", ["--dtype", "f16"], "--dtype", "f16: this spec computes in bfloat16 (dtypes.activations)"),
])
def test_logits_bad_arguments(out, extra, where, message, tmp_path, batch, tiny_ckpt_nvfp4, no_compute, capsys):
    (tmp_path / "FILE").write_text("")
    out = str(tmp_path) if out == "DIR" else out.replace("FILE", str(tmp_path / "FILE"))
    assert main(_logits(tiny_ckpt_nvfp4, batch, out, *extra)) == 2
    assert message in one_error(capsys.readouterr().err, where)
    assert not (tmp_path / "o.safetensors").exists()


def test_logits_device_that_is_not_there(tmp_path, batch, tiny_ckpt_nvfp4, no_compute, capsys, monkeypatch):
    import torch

    argv = _logits(tiny_ckpt_nvfp4, batch, tmp_path / "o.safetensors", "--device", "cuda:7")
    if torch.cuda.device_count() <= 7:  # this machine, whatever it has
        assert main(argv) == 2
        one_error(capsys.readouterr().err, "--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(argv) == 2
    assert one_error(capsys.readouterr().err, "--device").endswith(
        "cuda:7 does not exist: this machine has 1 CUDA device(s) (use cpu, cuda or cuda:0..cuda:0)")


def test_logits_write_failure_of_any_type_is_one_message(tmp_path, batch, tiny_ckpt_nvfp4, capsys, monkeypatch):
    """safetensors reports I/O failures as its own SafetensorError, not OSError."""
    import torch
    from safetensors import SafetensorError

    import beamc.logits

    def fail(*a, **kw):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })\nmore")

    monkeypatch.setattr(beamc.logits, "compile_graphs", lambda *a, **kw: None)  # the write is what is tested
    monkeypatch.setattr(beamc.logits, "run_logits", lambda *a, **kw: {"x": torch.zeros(1)})
    monkeypatch.setattr(beamc.logits, "save_file", fail)
    out = tmp_path / "o.safetensors"
    assert main(_logits(tiny_ckpt_nvfp4, batch, out)) == 2
    assert one_error(capsys.readouterr().err, "-o") == (
        f"beamc: error: -o: cannot write {out}: Error while serializing: IoError(Os {{ code: 28, kind: StorageFull }})"
        " (choose another path)")


def test_spec_too_large_is_refused_before_reading_it_all(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\nname: big\n")
    assert main(["compile", str(big)]) == 2
    assert "larger than 1 MiB" in one_error(capsys.readouterr().err, str(big))


def _deny(monkeypatch, target: Path) -> None:
    """Make `target` unreadable. chmod 000 is enough for other users; root reads anyway, so there open() of it also
    fails with EACCES, as the kernel answers everyone else."""
    target.chmod(0)
    if os.geteuid() != 0:
        return
    real_open = builtins.open

    def open_(file, *a, **kw):
        if isinstance(file, (str, os.PathLike)) and Path(file).resolve() == target.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr(builtins, "open", open_)


def _unreadable_case(kind: str, tmp_path: Path, batch: Path, ckpt: Path) -> tuple[list[str], Path, str]:
    """(argv, file to make unreadable, where) for one kind of input file."""
    if kind == "spec":
        spec = tmp_path / "spec.yaml"
        shutil.copy(TINY, spec)
        return ["compile", str(spec)], spec, "spec"
    if kind == "config.json":
        cfg = tmp_path / "config.json"
        shutil.copy(ckpt / "config.json", cfg)
        return ["import-hf", str(cfg)], cfg, "config"
    if kind == "batch.json":
        return _logits(ckpt, batch, tmp_path / "o.safetensors"), batch, "--input"
    copy = shutil.copytree(ckpt, tmp_path / "ckpt")  # model.safetensors of a checkpoint
    return _logits(copy, batch, tmp_path / "o.safetensors"), copy / "model.safetensors", "--checkpoint"


UNREADABLE = ["spec", "config.json", "batch.json", "model.safetensors"]


@pytest.mark.parametrize("kind", UNREADABLE)
def test_unreadable_file_is_one_message(kind, tmp_path, batch, tiny_ckpt_nvfp4, no_compute, capsys, monkeypatch):
    argv, target, where = _unreadable_case(kind, tmp_path, batch, tiny_ckpt_nvfp4)
    _deny(monkeypatch, target)
    assert main(argv) == 2
    assert one_error(capsys.readouterr().err, where) == (
        f"beamc: error: {where}: cannot read {target}: Permission denied (check the file's permissions)")


@pytest.mark.parametrize("kind", UNREADABLE)
def test_input_file_that_is_a_directory_is_one_message(kind, tmp_path, batch, tiny_ckpt_nvfp4, no_compute, capsys):
    argv, target, where = _unreadable_case(kind, tmp_path, batch, tiny_ckpt_nvfp4)
    target.unlink()
    target.mkdir()  # a directory named like the file: unreadable as a file for root too
    assert main(argv) == 2
    err = one_error(capsys.readouterr().err)
    assert "is a directory" in err.lower() and str(target) in err


def _without_root_powers(tmp_path: Path) -> list[str]:
    """A command prefix under which file permissions apply: none for a normal user; for root, setpriv dropping the
    capabilities that bypass them (the test skips where that is not possible)."""
    if os.geteuid() != 0:
        return []
    probe = tmp_path / "probe"
    probe.write_text("")
    probe.chmod(0)
    cmd = [shutil.which("setpriv") or "setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    try:
        works = (subprocess.run([*cmd, "true"], capture_output=True).returncode == 0
                 and subprocess.run([*cmd, "cat", str(probe)], capture_output=True).returncode != 0)
    except OSError:
        works = False
    probe.unlink()
    if not works:
        pytest.skip("root, and setpriv cannot drop the capabilities that bypass file permissions")
    return cmd


_RUN_MANY = """
import contextlib, io, json, sys
from beamc.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        results.append([main(argv), err.getvalue()])
print(json.dumps(results))
"""


def test_permission_denied_for_real(tmp_path, batch, tiny_ckpt_nvfp4):
    """The same refusals with the kernel saying no: unreadable inputs, read-only output directories."""
    prefix = _without_root_powers(tmp_path)
    cases = []
    for kind in UNREADABLE:
        d = tmp_path / kind.replace(".", "_")
        d.mkdir()
        b = d / "batch.json"
        shutil.copy(batch, b)
        argv, target, where = _unreadable_case(kind, d, b, tiny_ckpt_nvfp4)
        target.chmod(0)
        cases.append((argv, f"beamc: error: {where}: cannot read {target}: Permission denied"))
    ro = tmp_path / "read-only"
    ro.mkdir()
    cases += [
        (["init-weights", TINY, "-o", str(ro)], f"beamc: error: -o: cannot write in {ro}: Permission denied"),
        (["init-weights", TINY, "-o", str(ro / "new")], f"beamc: error: -o: cannot create directory {ro / 'new'}"),
        (_logits(tiny_ckpt_nvfp4, batch, ro / "o.st"), f"beamc: error: -o: cannot write {ro / 'o.st'}: Permission"),
        (["compile", TINY, "--dump-ir", str(ro)], f"beamc: error: --dump-ir: cannot write in {ro}: Permission denied"),
        (["import-hf", str(tiny_ckpt_nvfp4), "-o", str(ro / "s.yaml")],
         f"beamc: error: -o: cannot write {ro / 's.yaml'}: Permission denied"),
    ]
    ro.chmod(0o555)
    r = subprocess.run([*prefix, sys.executable, "-c", _RUN_MANY, json.dumps([a for a, _ in cases])], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for (argv, expected), (rc, err) in zip(cases, json.loads(r.stdout)):
        assert rc == 2, (argv, err)
        assert one_error(err).startswith(expected), (argv, err)
    assert list(ro.iterdir()) == []  # nothing was written, not even a probe file


# ---- init-weights: a non-empty directory needs --overwrite; what was written is said ----

def test_init_weights_refuses_a_non_empty_directory(tmp_path, capsys):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["init-weights", TINY, "-o", str(out)]) == 2
    assert one_error(capsys.readouterr().err, "-o") == (
        f"beamc: error: -o: {out} is not empty (pass --overwrite to replace the checkpoint in it, or choose "
        "another -o)")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    assert main(["init-weights", TINY, "-o", str(out), "--overwrite", "--experts", "bf16"]) == 0
    size = sum(p.stat().st_size for p in out.iterdir() if p.name != "notes.txt")
    mib = f"{size / 2**20:.1f} MiB"
    assert capsys.readouterr().out == f"wrote {out}: 2 files (1 safetensors), {mib}, experts bf16\n"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


def test_init_weights_into_a_read_only_directory(tmp_path, capsys, monkeypatch):
    import beamc.errors

    def read_only(*a, **kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(beamc.errors.tempfile, "TemporaryFile", read_only)  # the write probe, as root never fails it
    assert main(["init-weights", TINY, "-o", str(tmp_path)]) == 2
    assert one_error(capsys.readouterr().err, "-o") == (
        f"beamc: error: -o: cannot write in {tmp_path}: Permission denied (choose another path)")
    assert list(tmp_path.iterdir()) == []


def test_import_hf_says_where_it_wrote_and_stdout_is_only_yaml(tmp_path, tiny_ckpt_nvfp4, capsys):
    cfg = tiny_ckpt_nvfp4 / "config.json"
    out = tmp_path / "spec.yaml"
    assert main(["import-hf", str(cfg), "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}: the spec of {tiny_ckpt_nvfp4.name} (from {cfg})\n"
    assert main(["import-hf", str(cfg)]) == 0
    assert capsys.readouterr().out == out.read_text()  # piped: the YAML and nothing else
    assert main(["import-hf", str(cfg), "-o", str(tmp_path)]) == 2
    assert one_error(capsys.readouterr().err, "-o") == (
        f"beamc: error: -o: {tmp_path} is a directory, expected a file path (give a file name inside it)")


# ---- the README documents every flag, and the torch note comes before the commands that need it ----

def test_readme_documents_the_command_line():
    import argparse

    from beamc.cli import _parser

    readme = (ROOT / "README.md").read_text()
    commands = ["pip install -e . && beamc compile models/beam.yaml", 'pip install -e ".[test]" && python -m pytest']
    assert all(c in readme for c in commands)
    assert readme.index("pip install torch") < min(readme.index(c) for c in commands)
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for a in p._actions:
            if a.option_strings and a.dest != "help":
                assert a.help, f"{name} {a.option_strings[-1]} has no help text"
                assert a.option_strings[-1] in readme or a.option_strings[0] in readme, \
                    f"README does not mention {name} {a.option_strings[-1]}"


def test_a_float16_spec_runs_in_f16_and_refuses_bf16(tmp_path, capsys):
    """A float16 model (its weights stored in several dtypes) computes in float16: `--dtype f16` runs it through
    the interpreter (logits and generate), bf16 is refused in one message naming the spec's dtype."""
    import yaml

    from safetensors.torch import load_file

    data = yaml.safe_load((ROOT / "models/beam-tiny.yaml").read_text())
    data["dtypes"].update(activations="float16", embeddings="float16", lm_head="float16",
                          attention_weights="float32")
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    assert main(["init-weights", str(spec), "-o", str(tmp_path / "ckpt")]) == 0
    (tmp_path / "b.json").write_text(json.dumps({"sequences": [[1, 2, 3], [4, 5]], "decode_steps": 2}))
    args = ["logits", str(spec), "--checkpoint", str(tmp_path / "ckpt"), "--input", str(tmp_path / "b.json")]
    assert main(args + ["-o", str(tmp_path / "o.st"), "--dtype", "f16", "--passes", "all"]) == 0
    out = load_file(tmp_path / "o.st")
    assert out["prefill.0.logits"].shape == (3, data["vocab_size"]) and out["prefill.0.logits"].isfinite().all()
    capsys.readouterr()
    assert main(args + ["-o", str(tmp_path / "p.st"), "--dtype", "bf16"]) == 2
    assert "bf16: this spec computes in float16" in one_error(capsys.readouterr().err, "--dtype")
    assert not (tmp_path / "p.st").exists()
    assert main(["generate", str(spec), "--checkpoint", str(tmp_path / "ckpt"), "--prompt-ids", "1,2,3",
                 "--max-new", "2", "--dtype", "fp16", "--backend", "interpreter", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 2


def test_init_weights_describes_what_config_json_can_and_warns_about_the_rest(tmp_path, capsys):
    """config.json's sliding_window counts the current token (a window that excludes it is written one longer, so
    transformers sees the same keys); facts transformers' Beam hard-codes (here the norms' 1 + w) are named in one
    warning, the checkpoint still written (beamc reads the spec)."""
    import yaml

    data = yaml.safe_load((ROOT / "models/beam-tiny.yaml").read_text())
    data["attention"]["sliding"]["window_includes_current"] = False
    data["norm"]["weight_form"] = "1+w"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    assert main(["init-weights", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "ckpt")]) == 0
    cfg = json.loads((tmp_path / "ckpt/config.json").read_text())
    assert cfg["sliding_window"] == data["attention"]["sliding"]["window"] + 1
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "norm.weight_form = 1+w" in err and "qk_norm" not in err


def test_compile_set_pins_a_template_constant_in_the_package(tmp_path, capsys):
    """`beamc compile ... -o DIR --set TEMPLATE.CONSTANT=VALUE`: the package's kernels of that template carry the
    value and the manifest records the overrides."""
    out = tmp_path / "pkg"
    assert main(["compile", TINY, "-o", str(out), "--set", "attention_decode.NUM_WARPS=2",
                 "--set", "moe_router.SELECT_WARPS=2"]) in (0, None)
    man = json.loads((out / "manifest.json").read_text())
    assert man["template_overrides"] == {"attention_decode": {"NUM_WARPS": 2}, "moe_router": {"SELECT_WARPS": 2}}
    att = [k for k in man["kernels"].values() if k["template"] == "attention_decode.py.j2"]
    assert att and all(k["constants"]["NUM_WARPS"] == 2 for k in att)
    assert main(["compile", TINY, "-o", str(tmp_path / "no"), "--set", "rmsnorm_boundary.EPS=0.5"]) == 2
    assert "rmsnorm_boundary.EPS: set by the compiler" in one_error(capsys.readouterr().err)
    assert not (tmp_path / "no" / "manifest.json").exists()
