"""Two `bench/decode_batch.py` records side by side, batch by batch and op by op (their graph replays' profile), so a
candidate run is read against the default run of the same call without hand arithmetic.

    python bench/compare_batch.py BASE.json CANDIDATE.json [--ops 8]

For each batch in both: the step's ms and the change; then the ops whose time moved most (us a step, base ->
candidate), at most --ops of them. Only runs of one call (one machine, one read rate) compare: the read rates of both
are printed first.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(path: str) -> tuple[dict, dict[int, dict]]:
    facts = json.loads(Path(path).read_text())
    return facts, {r["batch"]: r for r in facts["rows"]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("candidate")
    ap.add_argument("--ops", type=int, default=8, help="ops listed per batch (those that moved most)")
    a = ap.parse_args(argv)
    (fa, ra), (fb, rb) = rows(a.base), rows(a.candidate)
    for f, p in ((fa, a.base), (fb, a.candidate)):
        print(f"{Path(p).name}: {f['env']['device']}, read {f.get('read_tb_s')} TB/s, context {f['context']}, "
              f"command: {f['command']}")
    for b in sorted(set(ra) & set(rb)):
        x, y = ra[b], rb[b]
        print(f"batch {b}: {x['ms']:.3f} -> {y['ms']:.3f} ms ({y['ms'] / x['ms'] - 1:+.1%})")
        ox, oy = x.get("by_op_us", {}), y.get("by_op_us", {})
        moved = sorted(set(ox) | set(oy), key=lambda o: -abs(oy.get(o, 0.0) - ox.get(o, 0.0)))
        for o in moved[: a.ops]:
            u, v = ox.get(o, 0.0), oy.get(o, 0.0)
            print(f"    {o:<40} {u:>9.0f} -> {v:>9.0f} us ({v - u:+.0f})")


if __name__ == "__main__":
    main()
