"""The compiled runtime (`beamc.runtime.model.Model`) on the tiny spec in fp32, its generated Triton kernels run by
Triton's CPU interpreter in a child process: logits equal the reference session's (rel < 1e-5) through ragged
prefill, padded decode batches, chunked prefill past a sliding ring's wrap, slot reuse and caller-supplied block
tables; every bad call refused with caches untouched; padding rows never touch a real sequence's cache; the CLI's
`logits --backend compiled` and `generate --json`. The NVFP4 experts of an sm90 package re-laid out at load (from a
checkpoint and from a caller's weights dict, which stays as it was; layer by layer, the ModelOpt tensors released as
it goes), in a child process without running a step (the MoE kernels on those weights: tests/test_kernels_moe*.py).
In-process (no kernel imported): package checks (one whose manifest lacks the load transforms is refused), buffer
planning and sampling."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamc.errors import BeamcError
from conftest import ROOT, rel_err, run_interpreted

TINY = ROOT / "models/beam-tiny.yaml"
TOL = 1e-5


# ---------------------------------------------------------------- the child: runs under TRITON_INTERPRET=1
def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kinds(m) -> dict[str, str]:
    """state name -> "ring" (first dim: slots) or "paged" (first dim: pages of the pool)."""
    g = m.bufs["decode"].graph
    return {n: ("paged" if node.out.shape[0] == "P" else "ring") for n, node in g.leaves("state").items()}


def _snapshot(m) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in m.states.items()}


def _changed(m, snap) -> tuple[set[int], set[int]]:
    """(ring slots, pool pages) whose cache rows differ from `snap`."""
    slots, pages = set(), set()
    for name, kind in _kinds(m).items():
        diff = (m.states[name] != snap[name]).flatten(1).any(1).nonzero().flatten().tolist()
        (pages if kind == "paged" else slots).update(diff)
    return slots, pages


def _pages_of(m, sids) -> set[int]:
    return {int(p) for s in sids for p in m.block_table_cpu[m.seqs[s].slot]}


def _within(m, snap, sids) -> dict:
    """Did only the caches of `sids` (and the padding slot / pages) change, and did the padding ones change?"""
    slots, pages = _changed(m, snap)
    own_slots = {m.seqs[s].slot for s in sids}
    own_pages = _pages_of(m, sids)
    return {"others_untouched": slots <= own_slots | {m.pad_slot} and pages <= own_pages | set(m.pad_pages),
            "pad_written": m.pad_slot in slots and bool(pages & set(m.pad_pages)),
            "own_written": own_slots <= slots}


def _interpreted_main(out: str, spec_yaml: str, ckpt: str) -> None:
    import beamc.runtime.model as rm
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import Model
    from beamc.runtime.session import ReferenceSession
    from beamc.spec import load_spec

    spec = load_spec(spec_yaml)
    pkg = compile_package(spec, passes=select_passes("all"), dtype="f32").write(Path(out).parent / "pkg")
    r: dict = {}

    def close(name, got, want):
        r[name] = rel_err(torch.cat(list(got)) if isinstance(got, list) else got,
                          torch.cat(list(want)) if isinstance(want, list) else want)

    def error(call):
        try:
            call()
        except BeamcError as e:
            return str(e)
        return None

    # ---- model A: each sequence its own page; 4 slots, 12 positions, prefill steps of 4 or 8 tokens
    m = Model.load(pkg, ckpt, device="cpu", max_batch=4, max_context=12, max_prefill_tokens=8,
                   prefill_buckets=[4, 8])
    ref = ReferenceSession.from_checkpoint(spec, ckpt, max_seqs=4, max_len=12, max_chunk=8)
    A, B, C, D = _ids(3, 0), _ids(2, 1), _ids(3, 2), _ids(3, 3)
    # (long chunks take the tensor path: here chunks of 3 do, of 2 stay lists, and the cache checks run as tensors)
    long_chunk, small_check = rm.LONG_CHUNK, rm.SMALL_CHECK_TOKENS
    rm.LONG_CHUNK, rm.SMALL_CHECK_TOKENS = 2, 2
    close("ragged_prefill", m.prefill(["a", "b", "c"], [A, B, torch.tensor(C, dtype=torch.int32)], all_logits=True),
          ref.prefill([(0, A), (1, B), (2, C)]))
    rm.LONG_CHUNK, rm.SMALL_CHECK_TOKENS = long_chunk, small_check
    snap = _snapshot(m)
    close("prefill_last_token", m.prefill(["d"], [D]), ref.prefill([(3, D)])[0][-1:])  # 3 tokens + 1 padding
    r["padded_prefill"] = _within(m, snap, ["d"])
    snap = _snapshot(m)
    close("decode_padded", m.decode(["a", "b", "c"], [7, 8, 9]), ref.decode({0: 7, 1: 8, 2: 9}))  # 3 rows + 1
    r["padded_decode"] = _within(m, snap, ["a", "b", "c"])
    A2, B2 = _ids(2, 4), _ids(2, 5)
    close("chunked_prefill", m.prefill(["b", "a"], [B2, A2], start_positions=[3, 4], all_logits=True),
          ref.prefill([(1, B2), (0, A2)]))
    slot_b = m.seqs["b"].slot
    m.release("b")
    ref.reset(1)
    E, A3 = _ids(2, 6), _ids(2, 7)
    close("reused_slot_prefill", m.prefill(["e", "a"], [E, A3], positions=[[0, 1], [6, 7]]),
          torch.stack([x[-1] for x in ref.prefill([(1, E), (0, A3)])]))
    r["reused_slot"] = m.seqs["e"].slot == slot_b
    r["lengths"] = m.lengths
    r["status"] = m.graphs.summary()
    # ---- every bad call: one BeamcError, no cache or length changed
    snap, lengths = _snapshot(m), dict(m.lengths)
    r["errors"] = {name: error(call) for name, call in {
        "context_overrun": lambda: m.prefill(["c", "a"], [[1], [3] * 5]),
        "unknown_seq": lambda: m.decode(["zz"], [1]),
        "token_outside_vocab": lambda: m.prefill(["c", "a"], [[1], [1, 512]]),
        "no_free_slot": lambda: m.prefill(["x"], [[1]]),
        "batch_over_max": lambda: m.prefill(["a", "c", "d", "e", "x"], [[1]] * 5),
        "page_outside_pool": lambda: m.decode(["c", "a"], [1, 2], block_tables=[None, [99]]),
        "too_few_pages": lambda: m.decode(["a"], [1], block_tables=[[]]),
        "start_after_length": lambda: m.prefill(["a"], [[1]], start_positions=[30]),
        "seq_twice": lambda: m.prefill(["a", "a"], [[1], [2]]),
        "too_many_tokens": lambda: m.prefill(["a", "c"], [[1] * 5, [1] * 5]),
    }.items()}
    r["errors_untouched"] = _changed(m, snap) == (set(), set()) and m.lengths == lengths
    # the step's inputs as written now and as bench/api_overhead.py's baseline (the path before) wrote them
    sys.path.insert(0, str(ROOT / "bench"))
    from api_overhead import legacy_write

    same = []
    for phase, ids, pos, slots, size in (("prefill", [5, 6, 7], [0, 1, 2], [1, 1, 1], 4),
                                         ("decode", [9, 8], [3, 4], [0, 2], 4)):
        for form in (list, lambda x: torch.tensor(x, dtype=torch.int64)):
            written = []
            for write in (m._write_inputs, lambda *a: legacy_write(m, *a)):
                for t in m.inputs[phase].values():
                    t.fill_(-7)  # poisoned: a row of the bucket left unwritten shows (the graph reads no other)
                write(phase, form(ids), form(pos), form(slots), [len(ids) - 1], size, 1)
                written.append({k: t[:1 if k == "logit_rows" else size].clone() for k, t in m.inputs[phase].items()})
            same.append(all(torch.equal(written[0][k], written[1][k]) for k in written[0]))
    r["inputs_as_before"] = same
    close("decode_after_errors", m.decode(["e", "a", "c", "d"], [10, 11, 12, 13]),
          ref.decode({1: 10, 0: 11, 2: 12, 3: 13}))

    # ---- model B: a caller-managed pool of 6 pages, shuffled tables, a sequence crossing a page boundary
    mb = Model.load(pkg, ckpt, device="cpu", max_batch=2, max_context=32, max_prefill_tokens=8, num_pages=6,
                    prefill_buckets=[4, 8])
    refb = ReferenceSession.from_checkpoint(spec, ckpt, max_seqs=2, max_len=32, max_chunk=8)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(5)).tolist()
    P, Q = perm[:2], perm[2:4]
    r["tables"] = [P, Q]
    p1, q1, q2, q3, p3 = _ids(2, 10), _ids(6, 11), _ids(8, 12), _ids(3, 13), _ids(1, 14)
    close("tables_prefill", mb.prefill(["p", "q"], [p1, q1], block_tables=[P, Q], all_logits=True),
          refb.prefill([(0, p1), (1, q1)]))
    close("tables_prefill_kept", mb.prefill(["q"], [q2]), refb.prefill([(1, q2)])[0][-1:])
    close("tables_page_boundary", mb.prefill(["q", "p"], [q3, p3], all_logits=True), refb.prefill([(1, q3), (0, p3)]))
    close("tables_decode", mb.decode(["p", "q"], [1, 2]), refb.decode({0: 1, 1: 2}))
    _, pages = _changed(mb, {k: torch.zeros_like(t) for k, t in mb.states.items()})
    r["tables_pages_written"] = sorted(pages - set(mb.pad_pages))
    r["tables_errors"] = {
        "no_table": error(lambda: mb.decode(["p", "q"], [1, 2], block_tables=[None, [Q[0]]])),
        "pad_page": error(lambda: mb.decode(["p"], [1], block_tables=[[P[0], 6]])),
        "shared_page": error(lambda: mb.decode(["p"], [1], block_tables=[[P[0], Q[1]]])),
        "page_twice": error(lambda: mb.decode(["p", "q"], [1, 2], block_tables=[[P[0], P[1]], [Q[0], P[1]]]))}
    mb.release("p")
    r["tables_errors"]["new_seq_without_table"] = error(lambda: mb.prefill(["r"], [[1, 2]]))
    Path(out).write_text(json.dumps(r))


def _relayout_main(out: str, ckpt: str) -> None:
    """The child of test_nvfp4_experts_are_relaid_at_load (TRITON_INTERPRET=1; no step runs)."""
    import gc
    import weakref

    from beamc.checkpoint.loader import load_rank_weights
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import Model
    from beamc.spec import load_spec

    spec = load_spec(TINY)
    pkg = compile_package(spec, passes=select_passes("all"), dtype="f32", nvfp4_relayout=True).write(
        Path(out).parent / "pkg")
    kw = dict(device="cpu", max_batch=1, max_context=16, max_prefill_tokens=16)
    m = Model.load(pkg, ckpt, **kw)  # from the checkpoint
    plan = m.package.nvfp4_relayouts()
    names = [n for e in plan for n in e["params"]]
    stored = load_rank_weights(spec, ckpt, tp=1, rank=0, dtype=torch.float32)
    before = {n: (t, t.clone()) for n, t in stored.items()}
    m2 = Model.load(pkg, weights=stored, **kw)  # from a caller's dict
    mod = m.step_module.K[plan[0]["kernel"]]
    changed = {n for n in names if m.weights[n].dtype != stored[n].dtype}  # codes and block scales
    r = {"layers": [e["layer"] for e in plan],
         "manifest_layers": m.manifest["load_transforms"]["moe_experts"]["layers"],
         "dtypes": {n.rsplit(".", 1)[-1]: str(m.weights[n].dtype) for n in names},
         "relaid": all(torch.equal(m.weights[n], t) for e in plan
                       for n, t in zip(e["params"], mod.relayout([stored[n] for n in e["params"]]))),
         "both_loads_equal": all(torch.equal(m.weights[n], m2.weights[n]) for n in m.weights),
         "caller_untouched": set(stored) == set(before) and all(stored[n] is t and torch.equal(t, c)
                                                                for n, (t, c) in before.items()),
         "others_shared": all(m2.weights[n] is stored[n] for n in m2.weights if n in stored and n not in changed),
         "changed": len(changed)}
    handed = dict(stored)  # take_weights: the caller's dict handed over loses the re-laid-out tensors, nothing else
    m3 = Model.load(pkg, weights=handed, take_weights=True, **kw)
    r["handed_dropped"] = sorted(set(stored) - set(handed)) == sorted(changed)
    r["handed_kept"] = all(handed[n] is stored[n] for n in handed)
    r["handed_load_equal"] = all(torch.equal(m.weights[n], m3.weights[n]) for n in m.weights)
    # the packed QKV+gate weights: storage for their rows up to a multiple of 8 (the prefill GEMM's aligned route)
    from beamc.runtime import library

    packed = [n for n, node in next(iter(m.package.steps.values())).graph.leaves("param").items()
              if node.attrs.get("pack")]
    r["packed_room"] = [(tuple(m.weights[n].shape), tuple(library.aligned_rows(m.weights[n]).shape),
                         float(library.aligned_rows(m.weights[n])[m.weights[n].shape[0]:].abs().sum()))
                        for n in packed]
    # layer by layer: when layer i is re-laid out, the ModelOpt codes / scales of layers < i are already freed
    owned = {n: stored[n].clone() for n in names}
    refs = [weakref.ref(owned[n]) for n in names if n in changed]
    out_ = dict(owned)
    alive, orig = [], mod.relayout

    def spy(params):
        gc.collect()
        alive.append(sum(ref() is not None for ref in refs))
        return orig(params)

    mod.relayout = spy
    try:
        m._relayout_experts(out_, [owned])
    finally:
        mod.relayout = orig
    gc.collect()
    r["alive_at_each_layer"] = alive
    r["alive_after"] = sum(ref() is not None for ref in refs)
    r["owned_left"] = sorted(owned)
    Path(out).write_text(json.dumps(r))


def test_nvfp4_experts_are_relaid_at_load(tiny_ckpt_nvfp4, tmp_path):
    """An sm90 package's NVFP4 experts (the decode and the prefill MoE kernel read one re-laid-out copy): Model.load
    replaces each MoE layer's codes and block scales by `moe_nvfp4_decode.relayout`'s (int32 / uint8; global scales
    as they were), from a checkpoint or a caller's weights dict, which keeps its own tensors (no key, tensor or value
    changed; with take_weights=True it loses the re-laid-out tensors, nothing else) while the model shares all the
    others; one layer at a time, the loaded ModelOpt tensors freed as it
    goes (peak: one layer's experts more)."""
    out = tmp_path / "relayout.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_runtime_model as t; "
            f"t._relayout_main({str(out)!r}, {str(tiny_ckpt_nvfp4)!r})")
    r = run_interpreted(["-c", code], out)
    assert r["layers"] == r["manifest_layers"] == [3, 4, 5, 6, 7], r
    assert r["dtypes"] == {"weight": "torch.int32", "weight_scale": "torch.uint8", "weight_scale_2": "torch.float32"}
    assert r["relaid"] and r["both_loads_equal"] and r["caller_untouched"] and r["others_shared"], r
    assert r["changed"] == 5 * 4 and r["alive_at_each_layer"] == [20, 16, 12, 8, 4] and r["alive_after"] == 0, r
    assert len(r["owned_left"]) == 10 and all(n.endswith("_scale_2") for n in r["owned_left"]), r  # kept as given
    assert r["handed_dropped"] and r["handed_kept"] and r["handed_load_equal"], r
    assert r["packed_room"] and all(w[1:] == a[1:] and a[0] % 8 == 0 and a[0] - w[0] < 8 and pad == 0
                                    for w, a, pad in r["packed_room"]), r


@pytest.fixture(scope="module")
def spec_yaml(tiny_spec_bf16, tmp_path_factory) -> Path:
    """The tiny spec with bf16 experts: its MoE runs as a library call, which keeps Triton's interpreter to the
    kernels the runtime needs (the NVFP4 decode kernel takes minutes there; tests/test_kernels_moe.py covers it)."""
    from beamc.spec.hf import spec_to_yaml

    p = tmp_path_factory.mktemp("spec") / "beam-tiny-bf16.yaml"
    p.write_text(spec_to_yaml(tiny_spec_bf16))
    return p


@pytest.fixture(scope="module")
def interpreted(spec_yaml, tiny_ckpt, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("runtime") / "result.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_runtime_model as t; "
            f"t._interpreted_main({str(out)!r}, {str(spec_yaml)!r}, {str(tiny_ckpt)!r})")
    return run_interpreted(["-c", code], out)


# ---------------------------------------------------------------- compiled vs reference
@pytest.mark.parametrize("case", ["ragged_prefill", "prefill_last_token", "decode_padded", "chunked_prefill",
                                  "reused_slot_prefill", "decode_after_errors", "tables_prefill",
                                  "tables_prefill_kept", "tables_page_boundary", "tables_decode"])
def test_compiled_logits_equal_the_reference_session(interpreted, case):
    assert interpreted[case] < TOL, (case, interpreted[case])


def test_step_inputs_are_written_as_before(interpreted):
    """The pinned-staging input path pads and writes a step's inputs exactly as the synchronous path it replaced
    (which bench/api_overhead.py keeps as its baseline), from int lists and from tensors, prefill and decode."""
    assert interpreted["inputs_as_before"] == [True] * 4


def test_runs_eagerly_on_cpu_and_reuses_a_released_slot(interpreted):
    assert interpreted["status"] == {"decode": "eager (cpu)", "prefill": "eager (cpu)"}
    assert interpreted["reused_slot"]
    assert interpreted["lengths"] == {"a": 8, "c": 4, "d": 3, "e": 2}


@pytest.mark.parametrize("step", ["padded_prefill", "padded_decode"])
def test_padding_rows_write_only_the_padding_slot_and_pages(interpreted, step):
    """A 3-token prefill in the 4-token bucket, a 3-sequence decode in the batch-4 bucket: the padding rows wrote
    the reserved slot and pages (so padding ran), no cache of a sequence outside the step changed."""
    assert interpreted[step] == {"others_untouched": True, "pad_written": True, "own_written": True}


def test_caller_tables_write_only_their_pages(interpreted):
    P, Q = interpreted["tables"]
    assert interpreted["tables_pages_written"] == sorted([P[0], *Q])  # p holds 4 positions, q 18: two pages


@pytest.mark.parametrize("case, message", [
    ("context_overrun", "seq 'a': length 13 exceeds max_context=12 (raise max_context)"),
    ("unknown_seq", "seq 'zz': unknown sequence (never prefilled, or released)"),
    ("token_outside_vocab", "seq 'a': token id 512 outside the vocabulary [0, 512)"),
    ("no_free_slot", "1 new sequences, but only 0 of max_batch=4 slots are free"),
    ("batch_over_max", "5 sequences in one step exceed max_batch=4"),
    ("page_outside_pool", "seq 'a': block table names page 99, outside the pool of num_pages=4"),
    ("too_few_pages", "seq 'a': its block table has 0 pages (0 positions), too few for 9 positions"),
    ("start_after_length", "seq 'a': start position 30 outside [0, 8]"),
    ("seq_twice", "a sequence appears twice in one step"),
    ("too_many_tokens", "10 tokens in one step exceed max_prefill_tokens=8"),
])
def test_bad_calls_raise_one_error_and_touch_no_cache(interpreted, case, message):
    assert message in (interpreted["errors"][case] or "no error"), interpreted["errors"][case]
    assert interpreted["errors_untouched"]


@pytest.mark.parametrize("case, message", [
    ("no_table", "seq 'q': its block table has 1 pages (16 positions), too few for 19 positions"),
    ("pad_page", "seq 'p': block table names page 6, outside the pool of num_pages=6"),
    ("new_seq_without_table", "seq 'r': no block table: the pool of num_pages=6 is managed by the caller"),
    ("shared_page", "seq 'p': block table names page {Q1}, which seq 'q' holds"),
    ("page_twice", "seq 'q': block table names page {P1}, which seq 'p' holds"),
])
def test_caller_managed_pool_errors(interpreted, case, message):
    (P0, P1), (Q0, Q1) = interpreted["tables"]
    message = message.format(P1=P1, Q1=Q1)
    assert message in (interpreted["tables_errors"][case] or "no error"), interpreted["tables_errors"][case]


# ---------------------------------------------------------------- the command line (child processes)
def _cli(*argv) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI sets it itself on a CPU
    return subprocess.run([sys.executable, "-m", "beamc.cli", *map(str, argv)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_logits_compiled_equals_interpreter(tmp_path, spec_yaml, tiny_ckpt):
    """`beamc logits --backend compiled` in a child (it sets TRITON_INTERPRET itself); the interpreter here."""
    from safetensors.torch import load_file

    from beamc.cli import main

    batch = tmp_path / "b.json"
    batch.write_text(json.dumps({"sequences": [[1, 2, 3], [400, 5]], "decode_steps": 1}))
    argv = ["logits", spec_yaml, "--checkpoint", tiny_ckpt, "--input", batch, "--passes", "all"]
    p = _cli(*argv, "-o", tmp_path / "c.st", "--backend", "compiled")
    assert p.returncode == 0 and "backend: compiled" in p.stdout, p.stderr
    assert main(list(map(str, argv + ["-o", tmp_path / "i.st"]))) == 0
    got, want = load_file(tmp_path / "c.st"), load_file(tmp_path / "i.st")
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape
        assert (got[k] == want[k]).all() if "tokens" in k else rel_err(got[k], want[k]) < TOL, k


def test_cli_generate(spec_yaml, tiny_ckpt):
    """--json from both backends; the compiled run stops after the prefill's token (a batch-1 decode step runs the
    gemv kernels, minutes in Triton's interpreter). Sampling flags, and the text output, on the interpreter."""
    res = {}
    for backend, n in (("compiled", 1), ("interpreter", 3)):
        p = _cli("generate", spec_yaml, "--checkpoint", tiny_ckpt, "--prompt-ids", "1,2,3", "--json",
                 "--backend", backend, "--max-new", n)
        assert p.returncode == 0, p.stderr
        res[backend] = json.loads(p.stdout)
        assert res[backend]["backend"] == backend and len(res[backend]["tokens"]) == n
        assert res[backend]["tokens_per_s"] > 0
    assert res["compiled"]["tokens"] == res["interpreter"]["tokens"][:1]
    p = _cli("generate", spec_yaml, "--checkpoint", tiny_ckpt, "--prompt-ids", "1,2,3", "--backend", "interpreter",
             "--max-new", "3", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert p.returncode == 0, p.stderr
    tokens, summary = p.stdout.splitlines()
    assert len(tokens.split()) == 3 and "3 tokens" in summary and "tokens/s" in summary


@pytest.mark.parametrize("argv, message", [
    (["logits", "--input", "B", "-o", "O", "--backend", "compiled", "--dtype", "bf16"],
     "--dtype: bf16: on a CPU the compiled backend runs the fp32 package under Triton's interpreter"),
    (["logits", "--input", "B", "-o", "O", "--backend", "compiled", "--tp", "2"],
     "--tp: 2: the compiled backend runs one rank per process"),
    (["generate", "--prompt-ids", "1,x"], "--prompt-ids: '1,x' is not a comma-separated list of token ids"),
    (["generate", "--prompt-ids", "1,512"], "--prompt-ids: token id 512 outside the vocabulary [0, 512)"),
    (["generate", "--prompt-ids", "1", "--max-new", "0"], "--max-new: must be >= 1, got 0"),
    (["generate", "--prompt-ids", "1", "--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    (["generate", "--prompt-ids", "1", "--temperature", "nan"], "--temperature: must be a finite number >= 0, got nan"),
])
def test_cli_refusals_come_before_any_kernel(argv, message, tmp_path, tiny_ckpt_nvfp4, capsys, monkeypatch):
    from beamc.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps([[1, 2]]))
    argv = [str(batch) if a == "B" else str(tmp_path / "o.st") if a == "O" else a for a in argv]
    assert main([argv[0], str(TINY), "--checkpoint", str(tiny_ckpt_nvfp4), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert "TRITON_INTERPRET" not in os.environ  # a refused command leaves the environment as it was


# ---------------------------------------------------------------- in-process: package checks, buffers, sampling
def test_an_sm100_package_asks_for_the_triton_that_compiles_it(tiny_spec):
    """The sm100 NVFP4 prefill MoE (tl.dot_scaled) fails to compile with Triton 3.6 (its matmul lowering): Model.load
    names the kernel and the fix before any launch (`triton_refusal`); sm90 packages and newer Tritons pass."""
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import triton_refusal

    sm100 = compile_package(tiny_spec, target="sm100", passes=select_passes("all"), phases=("prefill",)).kernels
    sm90 = compile_package(tiny_spec, target="sm90", passes=select_passes("all"), phases=("prefill",)).kernels
    refused = triton_refusal(sm100, "3.6.0")
    assert refused is not None and sm100[refused[0]].template == "moe_nvfp4_prefill", refused
    assert "Triton 3.6.0" in refused[1] and refused[2] == "install triton>=3.8"
    assert triton_refusal(sm100, "3.8.0") is None and triton_refusal(sm100, "3.10.1+git1234") is None
    assert triton_refusal(sm90, "3.6.0") is None


def _plan_or_error(table, chunks):
    try:
        return table.plan(chunks)
    except BeamcError as e:
        return str(e)


@pytest.mark.parametrize("bad", [None, True, 2.0, 2 ** 70, -1, 512, "x"])
def test_long_chunks_are_planned_as_tensors_with_the_same_checks(tiny_spec, bad):
    """A prefill chunk of more than LONG_CHUNK tokens is checked and planned with tensor ops (the host's time of a
    16K-token step): the same plan as the int-list path, and for every bad token the same error."""
    from beamc.runtime.kv_cache import SlotTable
    from beamc.runtime.model import LONG_CHUNK, _token_chunk, _token_list

    n = LONG_CHUNK + 5
    toks = [(7 * i) % 512 for i in range(n)]
    if bad is not None:
        toks[n - 3] = bad
    table = SlotTable(tiny_spec, 2, 1024, 1024)
    table.lengths = [5, 0]

    def planned(convert):
        try:
            chunks = [(0, convert(toks, "token_ids[0]")), (1, convert([3, 4], "token_ids[1]"))]
        except BeamcError as e:
            return str(e)
        return _plan_or_error(table, chunks)

    fast, slow = planned(_token_chunk), planned(_token_list)
    if bad is None:
        assert isinstance(fast["input_ids"], torch.Tensor)
        assert {k: v.tolist() for k, v in fast.items()} == slow
        as_tensor = _token_chunk(torch.tensor(toks, dtype=torch.int32), "t")
        assert as_tensor.dtype == torch.int64 and as_tensor.tolist() == toks
    else:
        assert isinstance(slow, str) and fast == slow, (fast, slow)
    for convert in (_token_chunk, _token_list):  # True is not token 1: bool tensors are refused like float ones
        with pytest.raises(BeamcError, match=r"t: expected a 1-D integer tensor, got \(\d+,\) torch.bool"):
            convert(torch.tensor([True] * n), "t")
        with pytest.raises(BeamcError, match="1-D integer tensor"):
            convert(torch.ones(n), "t")


@pytest.mark.parametrize("n", [3, 300])
def test_numpy_token_ids_are_taken_as_integers(n):
    """Serving stacks hold token ids in NumPy: 1-D integer arrays and lists of NumPy integers are token lists (the
    same values as Python ints); float, bool and 2-D arrays are refused by name."""
    import numpy as np

    from beamc.runtime.model import _token_chunk, _token_list

    want = [(7 * i) % 512 for i in range(n)]
    for convert in (_token_chunk, _token_list):
        for x in (np.array(want, dtype=np.int32), np.array(want, dtype=np.uint16), [np.int64(t) for t in want]):
            got = convert(x, "t")
            got = got.tolist() if isinstance(got, torch.Tensor) else got
            assert got == want and all(type(t) is int for t in got), (convert, x)
        for bad, what in ((np.ones(n), "float64"), (np.ones(n, dtype=bool), "bool"),
                          (np.ones((1, n), dtype=np.int64), "int64")):
            with pytest.raises(BeamcError, match=f"t: expected a 1-D integer array, got .* {what}"):
                convert(bad, "t")
    with pytest.raises(BeamcError, match=r"t: np.float32\(1.0\) is not an integer"):
        _token_list([np.int64(3), np.float32(1)], "t")


@pytest.fixture(scope="module")
def package(tiny_spec, tmp_path_factory) -> Path:
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes

    return compile_package(tiny_spec, passes=select_passes("all"), dtype="f32", nvfp4_relayout=True).write(
        tmp_path_factory.mktemp("pkg") / "pkg")


@pytest.mark.parametrize("kw, message", [
    (dict(tp=2, rank=1), "tp: asked 2, the package has 1; rank: asked 1, the package has 0"),
    (dict(dtype="bf16"), "dtype (activations): asked 'bf16', the package has 'f32'"),
    (dict(kv_dtype="fp8"), "kv_dtype: asked 'f8e4m3', the package has 'bf16'"),
    (dict(target="sm100"), "target: asked 'sm100', the package has 'sm90'"),
])
def test_load_refuses_a_package_that_is_not_the_one_asked_for(package, tiny_ckpt_nvfp4, kw, message):
    from beamc.runtime.model import Model

    with pytest.raises(BeamcError, match="the package is not the one asked for") as e:
        Model.load(package, tiny_ckpt_nvfp4, device="cpu", **kw)
    assert message in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(max_batch=1.5), "max_batch: must be an integer, got 1.5"),
    (dict(max_batch=True), "max_batch: must be an integer, got True"),
    (dict(max_context="24"), "max_context: must be an integer, got '24'"),
    (dict(num_pages=2.0), "num_pages: must be an integer, got 2.0"),
    (dict(prefill_buckets=[16, 32.0]), "prefill_buckets: 32.0 is not an integer"),
    (dict(device="gpu"), "device: 'gpu' is not a device (use 'cuda', 'cuda:N' or 'cpu')"),
    (dict(device="meta"), "device: 'meta': beamc runs on a CUDA GPU"),
    (dict(kv_dtype="int8"), "kv_dtype: 'int8' is not a KV cache dtype of a beamc package (use 'bf16' or 'fp8')"),
    (dict(dtype="f64"), "dtype: 'f64' is not an activation dtype of a beamc package"),
])
def test_load_refuses_bad_arguments_by_name(tmp_path, kw, message):
    """Model.load's own arguments are checked before any file is read: one BeamcError naming the argument (a float
    size was a TypeError from deep in the load, an unknown device torch's RuntimeError)."""
    from beamc.runtime.model import Model

    with pytest.raises(BeamcError) as e:
        Model.load(tmp_path / "no-package", None, **{"device": "cpu", **kw})
    assert message in str(e.value)


def test_load_refuses_another_spec_a_stale_package_and_a_cpu_without_the_interpreter(package, tiny_spec,
                                                                                    tiny_ckpt_nvfp4, tmp_path,
                                                                                    monkeypatch):
    import shutil

    from beamc.runtime.model import Model

    other = tiny_spec.model_copy(update={"vocab_size": 640})
    with pytest.raises(BeamcError, match="is not the spec the package was compiled from"):
        Model.load(package, tiny_ckpt_nvfp4, device="cpu", spec=other)
    with pytest.raises(BeamcError, match="not a beamc package: manifest.json is missing"):
        Model.load(tmp_path, tiny_ckpt_nvfp4, device="cpu")
    stale = tmp_path / "stale"
    shutil.copytree(package, stale)
    (stale / "step.py").write_text((stale / "step.py").read_text().replace("# ---- layer 3", "# edited"))
    with pytest.raises(BeamcError, match="differs from what this beamc generates"):
        Model.load(stale, tiny_ckpt_nvfp4, device="cpu")
    old = tmp_path / "old"  # a package from before the experts' relayout (its prefill kernel reads ModelOpt only)
    shutil.copytree(package, old)
    man = json.loads((old / "manifest.json").read_text())
    assert man["load_transforms"]["moe_experts"]["layers"] == [3, 4, 5, 6, 7]
    del man["load_transforms"]
    (old / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BeamcError, match="load_transforms differ from the weight transforms this beamc applies"):
        Model.load(old, tiny_ckpt_nvfp4, device="cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BeamcError, match="run on a CPU only under Triton's interpreter"):
        Model.load(package, tiny_ckpt_nvfp4, device="cpu")  # the spec comes from the checkpoint's config.json


def test_buffer_plan_shares_storage_only_between_disjoint_lifetimes(tiny_spec):
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import StepBuffers, _aligned, _nbytes

    pkg = compile_package(tiny_spec, passes=select_passes("all"), dtype="f32")
    st = pkg.steps["prefill"]
    sizes = {"T": 64, "R": 8, "S": 5, "Cs": 79, "P": 10, "MP": 2}
    shared, alone = StepBuffers(st.graph, st.launches), StepBuffers(st.graph, st.launches)
    blocks, every = shared.plan(sizes, share=True), alone.plan(sizes, share=False)
    assert len(every) == len(alone.roots) and sum(blocks) < sum(every) / 4
    by_block: dict[int, list[str]] = {}
    for name, b in shared.roots.items():
        by_block.setdefault(b.block, []).append(name)
        assert blocks[b.block] >= _aligned(_nbytes(b.shape, b.dtype, sizes))
    for names in by_block.values():  # buffers of one block: lifetimes never overlap
        spans = sorted((shared.first[n], shared.last[n]) for n in names)
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
    assert "scratch:mlp_gate" in shared.roots and shared.root("L0.q_heads") == "L0.qkvg_proj.0"
    assert shared.leaf[shared.root("L5.qk_norm_pos_kv.1")] == ("state", "kv.5.k")  # the cache, written in place


def test_linear_packed_runs_over_the_rows_its_weight_has_room_for():
    """library.linear_packed: the same parts whether the packed weight has storage for its rows up to a multiple of 8
    (`with_row_room`: the GEMM then runs over them, its output rows 16-byte aligned) or not; a weight without that
    room, or already aligned, is used as it is."""
    from beamc.runtime import library

    g = torch.Generator().manual_seed(5)
    w = torch.randn(1030, 40, generator=g)
    roomy = library.with_row_room(w)
    assert torch.equal(roomy, w) and roomy.is_contiguous() and roomy.shape == w.shape
    wide = library.aligned_rows(roomy)
    assert wide.shape == (1032, 40) and wide.data_ptr() == roomy.data_ptr() and not wide[1030:].any()
    assert library.aligned_rows(w) is w and library.aligned_rows(w[:1024]).shape == (1024, 40)
    assert library.with_row_room(w[:1024]).shape == (1024, 40)
    x = torch.randn(7, 40, generator=g)
    parts = [(768, 128, 128, 6)]
    for weight in (w, roomy):
        outs = [torch.full((7, n), float("nan")) for n in parts[0]]
        library.linear_packed(x, weight, *outs)
        assert torch.allclose(torch.cat(outs, 1), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_buckets():
    from beamc.runtime.model import bucket_for, buckets

    assert buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128] and buckets(6) == [1, 2, 4, 6]
    assert buckets(8, first=16) == [8] and buckets(100, first=16) == [16, 32, 64, 100]
    assert bucket_for(3, buckets(8)) == 4 and bucket_for(8, buckets(8)) == 8


def test_sampling_greedy_temperature_top_p():
    from beamc.runtime.sampling import generator, greedy, sample, top_p_filter

    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [2.0, 2.0, 0.0, 5.0]])
    assert greedy(logits).tolist() == [1, 3] and sample(logits, temperature=0).tolist() == [1, 3]
    assert sample(logits[0], temperature=0).item() == 1
    kept = top_p_filter(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 0.8)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(top_p_filter(logits, 1e-6)).sum(-1).tolist() == [1, 1]  # the top token always stays
    draws = [sample(logits, 1.0, 0.9, generator(7)).tolist() for _ in range(2)]
    assert draws[0] == draws[1]  # seeded
    many = sample(logits[:1].expand(4000, -1), temperature=1.0, generator=generator(0))
    freq = torch.bincount(many, minlength=4).float() / 4000
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.03
    with pytest.raises(BeamcError, match="top_p"):
        sample(logits, 1.0, 0.0)
    for bad in (float("nan"), float("inf"), -1.0, "1", None):  # one error, never torch's NaN-probability traceback
        with pytest.raises(BeamcError, match="temperature: must be a finite number >= 0"):
            sample(logits, bad)
    # a tiny temperature is greedy, not inf - inf (the row's maximum is subtracted before the division)
    wide = torch.tensor([[30.0, -30.0, 29.0, 0.0]])
    assert [sample(wide, t, 0.9, generator(1)).item() for t in (1e-30, 1e-40, 1e-45)] == [0, 0, 0]



# ---------------------------------------------------------------- TP 2: one process per rank, torch.distributed
def _tp_rank_main(out: str, spec_yaml: str, ckpt: str, rank: int, port: int) -> None:
    """One rank's process (TRITON_INTERPRET=1, gloo): its TP-2 package and weights, a ragged prefill and a decode
    step; the all-reduces (in place) and the logits all-gather go through torch.distributed. The package runs the
    MoE decode kernel's COMBINE render up to 2 tokens (the decode step) and the experts + moe_combine above (the
    prefill). Writes the logits."""
    import torch.distributed as dist

    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import Model
    from beamc.spec import load_spec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    spec = load_spec(spec_yaml)
    pkg = compile_package(spec, tp=2, rank=rank, passes=select_passes("all"), dtype="f32",
                          moe_combine_max_tokens=2).write(Path(out).parent / f"pkg_rank{rank}")
    m = Model.load(pkg, ckpt, device="cpu", tp=2, rank=rank, max_batch=2, max_context=16, max_prefill_tokens=8,
                   prefill_buckets=[8])
    seqs = [_ids(5, 30), _ids(2, 31)]
    prefill = m.prefill(["x", "y"], seqs)
    decode = m.decode(["x", "y"], [11, 12])
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"prefill": prefill.tolist(), "decode": decode.tolist(), "seqs": seqs}))


def test_tp2_ranks_in_two_processes_equal_the_reference_session(spec_yaml, tiny_ckpt, tmp_path):
    """TP 2 as deployed: a process per rank, each with its own package and weight slices, collectives through
    torch.distributed (gloo here, NCCL on GPUs); both ranks' logits equal the reference session's at TP 2."""
    import os
    import socket

    from beamc.runtime.session import ReferenceSession
    from beamc.spec import load_spec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, outs = [], []
    for rank in (0, 1):
        out = tmp_path / f"rank{rank}" / "out.json"
        out.parent.mkdir()
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_runtime_model as t; "
                f"t._tp_rank_main({str(out)!r}, {str(spec_yaml)!r}, {str(tiny_ckpt)!r}, {rank}, {port})")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "TRITON_INTERPRET": "1"}))
        outs.append(out)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    got = [json.loads(o.read_text()) for o in outs]
    spec = load_spec(spec_yaml)
    ref = ReferenceSession.from_checkpoint(spec, tiny_ckpt, tp=2, max_seqs=2, max_len=16, max_chunk=8)
    seqs = got[0]["seqs"]
    want_prefill = torch.stack([x[-1] for x in ref.prefill(list(enumerate(seqs)))])
    want_decode = ref.decode({0: 11, 1: 12})
    for g in got:
        assert rel_err(torch.tensor(g["prefill"]), want_prefill) < 1e-5
        assert rel_err(torch.tensor(g["decode"]), want_decode) < 1e-5


def test_tp2_without_a_process_group_is_refused(tiny_spec, tmp_path):
    """An all-reduce without a process group would copy its input: silently wrong logits. Refused at load."""
    from beamc.runtime.model import check_process_group

    with pytest.raises(BeamcError, match="torch.distributed"):
        check_process_group(2, 0)
    check_process_group(2, 0, allow_single=True)  # a benchmark of one rank's share, which says so
    check_process_group(1, 0)


# ---------------------------------------------------------------- the unfused graph (the ablation's first row)
def _unfused_main(out: str, spec_yaml: str, ckpt: str) -> None:
    from beamc.codegen.package import compile_package
    from beamc.runtime.model import Model
    from beamc.runtime.session import ReferenceSession
    from beamc.spec import load_spec

    spec = load_spec(spec_yaml)
    pkg = compile_package(spec, passes=[], dtype="f32").write(Path(out).parent / "pkg_unfused")
    m = Model.load(pkg, ckpt, device="cpu", max_batch=2, max_context=32, max_prefill_tokens=16,
                   prefill_buckets=[16])
    ref = ReferenceSession.from_checkpoint(spec, ckpt, max_seqs=2, max_len=32, max_chunk=16)
    seqs = [_ids(10, 40), _ids(4, 41)]
    errs = [rel_err(m.prefill([0, 1], seqs), torch.stack([x[-1] for x in ref.prefill(list(enumerate(seqs)))])),
            rel_err(m.decode([0, 1], [3, 4]), ref.decode({0: 3, 1: 4}))]
    Path(out).write_text(json.dumps({"errs": errs}))


def test_unfused_package_runs_and_equals_the_reference_session(spec_yaml, tiny_ckpt, tmp_path):
    """A package compiled with no fusion pass (every IR op its own launch) runs through the same runtime."""
    out = tmp_path / "unfused.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_runtime_model as t; "
            f"t._unfused_main({str(out)!r}, {str(spec_yaml)!r}, {str(tiny_ckpt)!r})")
    assert max(run_interpreted(["-c", code], out)["errs"]) < 1e-5


def _batch_options_main(out: str, ckpt: str) -> None:
    """The child of test_batch_decode_options_equal_the_reference_session (TRITON_INTERPRET=1)."""
    from beamc.codegen import emitters
    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import Model
    from beamc.runtime.session import ReferenceSession
    from beamc.spec import load_spec

    emitters.ROUTER_DECODE_LARGE_MIN_TOKENS = 2  # (this child process only: the load's rebuild sees it too)
    emitters.ATTENTION_DECODE_BATCH_MIN_TOKENS = 2
    spec = load_spec(TINY)
    pkg = compile_package(spec, passes=select_passes("all"), dtype="f32",
                          template_overrides={"moe_nvfp4_decode": {"PLAN_MIN_PAIRS": 0}}).write(Path(out).parent / "pkg")
    m = Model.load(pkg, ckpt, device="cpu", max_batch=2, max_context=32, max_prefill_tokens=16, prefill_buckets=[16])
    launches = [ln for _, ln in m.package.steps["decode"].launches if ln.kernel is not None]
    planned = [ln.kernel.constants.get("PLAN_MIN_PAIRS") for ln in launches if ln.kernel.template == "moe_nvfp4_decode"]
    routers = sorted({(ln.kernel.constants["PATH"], ln.min_tokens, ln.max_tokens) for ln in launches
                      if ln.kernel.template == "moe_router"})
    attention = sorted({(ln.kernel.constants["WINDOW"], ln.kernel.constants.get("BLOCK_N"),
                         ln.kernel.constants.get("WHOLE_WAVES", False), ln.min_tokens, ln.max_tokens)
                        for ln in launches if ln.kernel.template == "attention_decode"}, key=str)
    ref = ReferenceSession.from_checkpoint(spec, ckpt, max_seqs=2, max_len=32, max_chunk=16)
    seqs = [_ids(10, 50), _ids(4, 51)]
    errs = [rel_err(m.prefill([0, 1], seqs), torch.stack([x[-1] for x in ref.prefill(list(enumerate(seqs)))])),
            rel_err(m.decode([0, 1], [5, 6]), ref.decode({0: 5, 1: 6})), rel_err(m.decode([0], [7]), ref.decode({0: 7}))]
    Path(out).write_text(json.dumps({"errs": errs, "planned": planned, "routers": routers, "attention": attention}))


def test_batch_decode_options_equal_the_reference_session(tiny_ckpt_nvfp4, tmp_path):
    """Two batch-decode options through the compiled fp32 package under the interpreter: the MoE decode kernel's
    PLAN on every step (`--set moe_nvfp4_decode.PLAN_MIN_PAIRS=0`: the tiny spec's steps have too few pairs for the
    default 32; the pairs grouped by expert in a first launch, each program on one item; NVFP4 experts) and the
    router's large path from 2 decode tokens on (`emitters.ROUTER_DECODE_LARGE_MIN_TOKENS`; the small path at 1), and
    the decode attention's batch tiles from 2 tokens on (`emitters.ATTENTION_DECODE_BATCH_MIN_TOKENS`: blocks of 32,
    whole-wave splits; the register cap is the GPU's): a ragged prefill of 14 tokens, a decode step of 2 and one of
    1 equal the reference session."""
    out = tmp_path / "batch_options.json"
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_runtime_model as t; "
            f"t._batch_options_main({str(out)!r}, {str(tiny_ckpt_nvfp4)!r})")
    r = run_interpreted(["-c", code], out)
    assert r["planned"] and all(x == 0 for x in r["planned"]), r
    assert r["routers"] == [["large", 2, None], ["small", 0, 1]], r
    kinds = {w for w, *_ in r["attention"]}
    assert len(r["attention"]) == 2 * len(kinds) and all(
        [w, 32, True, 2, None] in r["attention"] and any(x[0] == w and x[2:] == [False, 0, 1] for x in r["attention"])
        for w in kinds), r
    assert max(r["errs"]) < 1e-5, r


def test_load_rebuilds_packages_with_overrides_and_either_prefill_gate(tiny_spec, tiny_ckpt_nvfp4, tmp_path,
                                                                       monkeypatch):
    """Model.load rebuilds a package from its manifest and refuses one it would not generate: a package compiled
    with `--set` or with `--prefill-attention-gate` passes those checks (and stops, without the interpreter, at the
    CPU check that comes after them); a manifest from before the prefill gate was recorded reads as the fused form
    (what those packages ran), so such a package passes and a current one with the record removed is stale; a
    malformed record or an override this beamc refuses is one error naming the manifest."""
    import shutil

    from beamc.codegen.package import compile_package
    from beamc.passes.manager import select_passes
    from beamc.runtime.model import Model

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu_check = "run on a CPU only under Triton's interpreter"
    over = {"attention_decode": {"NUM_WARPS": 2}, "moe_router": {"SELECT_WARPS": 2}}
    fused = None
    for name, kw in (("over", dict(template_overrides=over)), ("fused", dict(prefill_attention_gate=True))):
        pkg = compile_package(tiny_spec, passes=select_passes("all"), dtype="f32", **kw).write(tmp_path / name)
        with pytest.raises(BeamcError, match=cpu_check):
            Model.load(pkg, tiny_ckpt_nvfp4, device="cpu")
        fused = pkg if name == "fused" else fused
    legacy = tmp_path / "legacy"  # the fused package with the manifest of a beamc that did not record the choice
    shutil.copytree(fused, legacy)
    man = json.loads((legacy / "manifest.json").read_text())
    del man["prefill_attention_gate"]
    (legacy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BeamcError, match=cpu_check):
        Model.load(legacy, tiny_ckpt_nvfp4, device="cpu")
    current = tmp_path / "current"  # a default (two-launch prefill) package whose record was removed: stale
    compile_package(tiny_spec, passes=select_passes("all"), dtype="f32").write(current)
    man = json.loads((current / "manifest.json").read_text())
    assert man["prefill_attention_gate"]["fused"] is False
    del man["prefill_attention_gate"]
    (current / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BeamcError, match="differs from what this beamc generates"):
        Model.load(current, tiny_ckpt_nvfp4, device="cpu")
    man["prefill_attention_gate"] = "yes"
    (current / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BeamcError, match="prefill_attention_gate: 'yes' is not a record"):
        Model.load(current, tiny_ckpt_nvfp4, device="cpu")
    man["prefill_attention_gate"] = {"fused": False}
    man["l2_prefetch_mb"] = "24"
    (current / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BeamcError, match="l2_prefetch_mb: '24' is not a budget"):
        Model.load(current, tiny_ckpt_nvfp4, device="cpu")
    man["l2_prefetch_mb"] = 0
    man["template_overrides"] = {"attention_decode": {"HEAD_DIM": 64}}
    (current / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(BeamcError, match=r"manifest.json: template_overrides attention_decode.HEAD_DIM: set by the"):
        Model.load(current, tiny_ckpt_nvfp4, device="cpu")


def test_fp16_attention_operands_are_checked_against_the_q_norms():
    """A package whose attention kernels multiply in fp16 (F16_DOT: fp8 caches) refuses, at load, q norms that would
    let q leave fp16's range (|q| <= sqrt(head_dim) * max |w| * the SSMax scale), naming the param and the fix;
    ordinary weights pass, and without F16_DOT nothing is checked."""
    from types import SimpleNamespace

    from beamc.runtime.model import Model
    from beamc.spec import load_spec

    m = Model.__new__(Model)
    m.spec = load_spec(ROOT / "models/beam.yaml")
    m.step_module = SimpleNamespace(K={"qkn": SimpleNamespace(F16_DOT=True), "gemv": SimpleNamespace()})
    name = "model.layers.5.self_attn.q_norm.weight"
    m._check_f16_dot({name: torch.full((128,), 3.0), "model.norm.weight": torch.full((8,), 1e6)})
    big = {name: torch.cat([torch.ones(127), torch.tensor([5000.0])])}  # 5000 * sqrt(128) * 1.17 > 65504
    with pytest.raises(BeamcError, match=r"q_norm.weight.*fp16.*F16_DOT=false"):
        m._check_f16_dot(big)
    m.step_module = SimpleNamespace(K={"qkn": SimpleNamespace(F16_DOT=False)})
    m._check_f16_dot(big)
