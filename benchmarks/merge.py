"""python -m benchmarks.merge TARGET RETURNED [RETURNED ...]: fold the results files that device
calls returned into the committed one.

Each device call runs on a copy of the working tree, so the file it returns holds the committed
rows plus its own run's; copying the last one over TARGET would drop the other calls' runs of the
session. A returned file's own runs are its rows whose run_date neither TARGET nor a file folded
before it has; they replace TARGET's rows of the same cases whole (results.merge_rows' rule, as
run --cases does on the device), so no peer row of an earlier run stays beside a re-timed case.
The files are folded in the order given, and the header (gpu, torch, triton, date) comes from
the last one.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import results


def fold(target: dict, returned: list[dict]) -> dict:
    """TARGET's document with each returned document's own runs folded in (see the module)."""
    rows = list(target["rows"])
    env = {k: target[k] for k in results.TOP_KEYS[:-1]}
    # runs already here: TARGET's and those folded so far (a later file still carries the rows
    # an earlier one replaced, under their old dates: they must not come back)
    known = {r.get("run_date") for r in rows}
    for doc in returned:
        new = [r for r in doc["rows"] if r.get("run_date") not in known]
        cases = {(r["suite"], r["case"]) for r in new}
        rows = results.merge_rows(rows, new, {s for s, _ in cases}, cases)
        known |= {r.get("run_date") for r in new}
        env = {k: doc[k] for k in results.TOP_KEYS[:-1]}
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
