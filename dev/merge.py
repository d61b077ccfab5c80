"""python -m dev.merge TARGET RETURNED [RETURNED ...]: fold the results files that device
calls returned into the committed one.

Each device call runs on a copy of the working tree, so the file it returns holds the committed
rows plus its own runs' (one per `benchmarks.run` the call made into it); copying the last one
over TARGET would drop the other calls' runs. A returned file's own runs are its
rows whose run_date (run stamps each run's rows with its start) is later than every run TARGET
held when the merge began; each replaces TARGET's rows of its cases whole (results.merge_rows'
rule, as run --cases does on the device), oldest first, so no peer row of an earlier run stays
beside a re-timed case. Folding a file twice (in one call or two) changes nothing, and the stale
copies of replaced rows every returned file carries never come back. The header (gpu, torch,
triton, date) comes from the last file given.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import results


def fold(target: dict, returned: list[dict]) -> dict:
    """TARGET's document with each returned document's own runs folded in (see the module)."""
    rows = list(target["rows"])
    env = {k: target[k] for k in results.TOP_KEYS[:-1]}
    # a run is a returned file's own when it started after every run TARGET held at the start
    # (the committed rows each file carries are older); runs already folded are skipped
    newest = max((r.get("run_date") or "" for r in rows), default="")
    known = {r.get("run_date") for r in rows}
    for doc in returned:
        env = {k: doc[k] for k in results.TOP_KEYS[:-1]}
        runs = sorted({r.get("run_date") or "" for r in doc["rows"]} - known)
        for date in (d for d in runs if d > newest):
            new = [r for r in doc["rows"] if r.get("run_date") == date]
            cases = {(r["suite"], r["case"]) for r in new}
            rows = results.merge_rows(rows, new, {s for s, _ in cases}, cases)
            known.add(date)
    return results.make_doc(env, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="the committed results file (rewritten)")
    ap.add_argument("returned", nargs="+", help="results files the device calls returned")
    a = ap.parse_args(argv)
    with open(a.target) as f:
        target = json.load(f)
    docs = []
    for path in a.returned:
        with open(path) as f:
            docs.append(json.load(f))
    doc = fold(target, docs)
    results.write(a.target, {k: doc[k] for k in results.TOP_KEYS[:-1]}, doc["rows"])
    print(f"{a.target}: {len(doc['rows'])} rows ({len(target['rows'])} before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
