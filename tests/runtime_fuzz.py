"""Random call sequences against the compiled runtime (kept out of CI: minutes under Triton's interpreter).

    TRITON_INTERPRET=1 python tests/runtime_fuzz.py --seeds 0-3 --ops 30 [--caller-pages] [--nvfp4] [--fp8] [--wide]

One Model (the tiny spec's fp32 package; --wide: a random spec's) takes a random mix of calls: ragged prefills of
new and continuing sequences, chunked prefills, rewinds (a start before the length, as far back as the sliding ring
allows), batched decodes, releases and slot reuse; with --caller-pages the caller owns a shuffled pool and grows
each sequence's block table by random free pages. The oracle needs no state: after every call, each sequence's
logits equal the last row of one fresh prefill of its whole history by the reference session (fp32, rel < TOL, see
there). Calls the runtime should refuse (a rewind past the ring, a context past max_context, a page another
sequence holds, a token outside the vocabulary) are drawn too: each must raise one BeamcError and change no cache
(the next calls check the logits of every live sequence)."""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


# Not CI's 1e-5: the oracle's one prefill is not the chunking the runtime ran, and the reference itself moves by that
# much between chunkings on some random specs (seed 53 of --wide: 8.6e-6 between one prefill and two chunks of the
# same 15 tokens, the compiled runtime after a rewind 1.1e-5); a wrong slot, page or position is off by 1e-2 or more
TOL = 5e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class Fuzz:
    def __init__(self, spec, ckpt, rng: random.Random, caller_pages: bool):
        from beamc.codegen.package import compile_package
        from beamc.passes.manager import select_passes
        from beamc.runtime.model import Model
        from beamc.runtime.session import ReferenceSession

        self.spec, self.rng, self.caller = spec, rng, caller_pages
        pkg = compile_package(spec, passes=select_passes("all"), dtype="f32").write(Path(tempfile.mkdtemp()) / "pkg")
        self.max_batch, self.max_context, self.max_tokens = 3, 40, 12
        kw = dict(device="cpu", max_batch=self.max_batch, max_context=self.max_context,
                  max_prefill_tokens=self.max_tokens, prefill_buckets=[4, 12])
        if caller_pages:
            kw["num_pages"] = 12
        self.m = Model.load(pkg, ckpt, **kw)
        self.ref = ReferenceSession.from_checkpoint(spec, ckpt, max_seqs=1, max_len=self.max_context,
                                                    max_chunk=self.max_context)
        self.hist: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.n_new, self.worst, self.calls, self.refused = 0, 0.0, 0, 0
        self.page_size = self.m.page_size

    def tok(self) -> int:
        return self.rng.randrange(self.spec.vocab_size)

    def want(self, sid: str) -> torch.Tensor:
        self.ref.reset(0)
        return self.ref.prefill([(0, self.hist[sid])])[0][-1]

    def tables_for(self, ends: dict[str, int]) -> list[list[int]] | None:
        """The caller's tables for one step, sequence -> positions to hold: each sequence's pages, grown by random
        free ones (free: held by no live sequence's table and not given to another sequence of this step)."""
        if not self.caller:
            return None
        held = {p for t in self.tables.values() for p in t}
        free = [p for p in range(self.m.num_pages) if p not in held]
        self.rng.shuffle(free)
        out = []
        for sid, end in ends.items():
            t = list(self.tables.get(sid, []))
            while len(t) * self.page_size < end and free:
                t.append(free.pop())
            out.append(t)
        return out

    def check(self, sids, got: torch.Tensor) -> None:
        for i, sid in enumerate(sids):
            e = rel(got[i], self.want(sid))
            self.worst = max(self.worst, e)
            assert e < TOL, (sid, e, len(self.hist[sid]))

    def refuse(self, what: str, fn) -> None:
        from beamc.errors import BeamcError

        snap = {k: t.clone() for k, t in self.m.states.items()}
        try:
            fn()
        except BeamcError:
            self.refused += 1
        else:
            raise AssertionError(f"not refused: {what}")
        assert all(torch.equal(snap[k], t) for k, t in self.m.states.items()), f"cache changed by refused {what}"

    def step(self) -> None:
        rng, m = self.rng, self.m
        live = list(self.hist)
        op = rng.choice(["prefill", "prefill", "decode", "decode", "rewind", "release", "bad"])
        if op == "release" and live:
            sid = rng.choice(live)
            m.release(sid)
            del self.hist[sid]
            self.tables.pop(sid, None)
            return
        if op == "decode" and live:
            sids = rng.sample(live, rng.randint(1, len(live)))
            sids = [s for s in sids if len(self.hist[s]) < self.max_context]
            if not sids:
                return
            toks = [self.tok() for _ in sids]
            tables = self.tables_for({s: len(self.hist[s]) + 1 for s in sids})
            if tables and any(len(t) * self.page_size <= len(self.hist[s]) for s, t in zip(sids, tables)):
                return  # the pool is full: a serving stack would not schedule this step
            got = m.decode(sids, toks, block_tables=tables)
            for s, t, tb in zip(sids, toks, tables or [None] * len(sids)):
                self.hist[s].append(t)
                if tb is not None:
                    self.tables[s] = tb
            self.calls += 1
            return self.check(sids, got)
        if op == "bad" and live:
            sid = rng.choice(live)
            n = len(self.hist[sid])
            ring = m.slots.ring
            kind = rng.choice(["overrun", "far_rewind", "shared_page", "vocab"])
            if kind == "overrun" and self.max_context - n < self.max_tokens:
                k = self.max_context - n + 1  # one token past max_context
                return self.refuse(kind, lambda: m.prefill([sid], [[self.tok() for _ in range(k)]]))
            if kind == "far_rewind" and n > ring + 1:
                return self.refuse(kind, lambda: m.prefill([sid], [[self.tok()]], start_positions=[0]))
            if kind == "shared_page" and self.caller and len(live) > 1:
                other = rng.choice([s for s in live if s != sid])
                if self.tables.get(other):
                    bad = self.tables[sid] + [self.tables[other][0]]
                    return self.refuse(kind, lambda: m.decode([sid], [self.tok()], block_tables=[bad]))
            if kind == "vocab":
                return self.refuse(kind, lambda: m.decode([sid], [self.spec.vocab_size]))
            return
        # prefill (new, continuing or rewinding sequences in one ragged step)
        budget = self.max_tokens
        sids, chunks, starts = [], [], []
        cont = rng.sample(live, rng.randint(0, len(live)))
        for sid in cont:
            n = len(self.hist[sid])
            start = n
            if op == "rewind" and n > 1:
                lo = max(0, n - m.slots.ring + self.spec.effective_window - 1)  # the ring's earliest rewind
                start = rng.randint(min(lo, n), n)
            room = min(budget, self.max_context - start)
            if room < 1:
                continue
            k = rng.randint(1, room)
            sids.append(sid), chunks.append([self.tok() for _ in range(k)]), starts.append(start)
            budget -= k
        free_slots = self.max_batch - len(live)
        while budget > 0 and free_slots > 0 and rng.random() < 0.6:
            k = rng.randint(1, budget)
            sid = f"s{self.n_new}"
            self.n_new += 1
            sids.append(sid), chunks.append([self.tok() for _ in range(k)]), starts.append(0)
            budget -= k
            free_slots -= 1
        if not sids:
            return
        tables = self.tables_for({s: st + len(c) for s, st, c in zip(sids, starts, chunks)})
        if tables is not None:
            if any(len(t) * self.page_size < st + len(c) for t, st, c in zip(tables, starts, chunks)):
                return  # the pool is full: a serving stack would not schedule this step
        all_logits = rng.random() < 0.3
        got = m.prefill(sids, chunks, start_positions=starts, block_tables=tables, all_logits=all_logits)
        for i, (s, st, c) in enumerate(zip(sids, starts, chunks)):
            self.hist[s] = self.hist.get(s, [])[:st] + c
            if tables is not None:
                self.tables[s] = tables[i]
        self.calls += 1
        last = torch.stack([g[-1] for g in got]) if all_logits else got
        self.check(sids, last)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0-1")
    ap.add_argument("--ops", type=int, default=30)
    ap.add_argument("--caller-pages", action="store_true")
    ap.add_argument("--nvfp4", action="store_true", help="NVFP4 experts (slow: the decode MoE kernel interpreted)")
    ap.add_argument("--fp8", action="store_true", help="fp8 e4m3 KV caches (the reference stores the same)")
    ap.add_argument("--wide", action="store_true", help="each seed on a random spec (tests/spec_sweep.py's wide())")
    args = ap.parse_args(argv)
    from beamc.checkpoint.init import init_weights, with_experts
    from beamc.spec import load_spec

    from conftest import spec_variant
    from spec_sweep import wide

    base = load_spec(ROOT / "models" / "beam-tiny.yaml")
    a, _, b = args.seeds.partition("-")
    bad, spec = 0, None
    for seed in range(int(a), int(b or a) + 1):
        if spec is None or args.wide:
            changes = wide(random.Random(seed), False, False) if args.wide else {}
            if args.fp8:
                changes["dtypes.kv_cache"] = "fp8"
            try:
                spec = spec_variant(base, changes)
            except Exception as e:  # noqa: BLE001 (a refused draw: its message is the check)
                print(f"seed {seed}: spec refused: {str(e)[:160]}", flush=True)
                spec = None
                continue
            spec = spec if args.nvfp4 else with_experts(spec, "bf16")
            ckpt = Path(tempfile.mkdtemp()) / "ckpt"
            init_weights(spec, ckpt, seed=7)
        f = Fuzz(spec, ckpt, random.Random(seed), args.caller_pages)
        try:
            for _ in range(args.ops):
                f.step()
            print(f"seed {seed}: ok, {f.calls} steps, {f.refused} refused, worst {f.worst:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 (the sweep reports and goes on)
            bad += 1
            print(f"seed {seed}: FAILED after {f.calls} steps: {type(e).__name__}: {e}"
                  + (f" (spec: {json.dumps(changes)})" if args.wide else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
