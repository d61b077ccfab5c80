"""The results file: {"gpu", "torch", "triton", "date", "rows": [...]}.

Every row has "suite", "case", "provider", "median_ms", "tflops" (null when the provider did not
run: then "status" is "unavailable" or "failed" and "error" says why), plus the case's columns
(B, S, Hq, Hkv, D, causal, layout, ...), "rel_err" against the reference and, on compiled_attn's
rows, "ratio_vs_<provider>" = our TFLOP/s over that provider's in the same run. Timed CUDA rows
also carry "host_ms" and "cpu_bound" (CPU_BOUND below). Rows timed since 2026-11-23 carry
"kernel_src" (kernel_fingerprint: the code of our kernels when the row was timed).
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import math
import os
from pathlib import Path

TOP_KEYS = ("gpu", "torch", "triton", "date", "rows")
# The sources that decide what a timed compiled_attn op runs (the kernels, their launchers and
# the op contracts; the work list): a row's "kernel_src" fingerprints them as they were when it
# was timed, and the report marks rows whose fingerprint is not the tree's. The reference (the
# CPU path) is not among them: a timed CUDA op never runs it.
# ops/ holds the kernels, their launchers and the work-list builders (schedule.py); not the CPU
# reference, nor which kernel a traced call runs (dispatch.py).
KERNEL_SOURCES = ("ops",)
NOT_KERNEL_SOURCES = ("ops/reference.py", "ops/dispatch.py")
ROW_KEYS = ("suite", "case", "provider", "median_ms", "tflops")
STATUSES = ("ok", "unavailable", "failed")
# A CUDA row whose host time to issue a call ("host_ms") is at least this fraction of its median
# time per call is flagged "cpu_bound": the GPU waited on the host, so it times the launch path.
CPU_BOUND = 0.9


def environment() -> dict:
    """gpu / torch / triton / date of this process (gpu 'cpu' without CUDA)."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001  (recorded, not hidden)
        triton_version = f"unavailable ({type(e).__name__}: {e})"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def policy_settings(items: list[str]) -> dict:
    """--policy NAME=VALUE items (the suites' CLIs) as launch-policy settings
    (compiled_attn.ops.policy; VALUE a Python literal)."""
    import ast

    settings = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--policy {item!r}: write NAME=VALUE, e.g. host_tma_min_flop=2e10")
        try:
            settings[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise SystemExit(f"--policy {item!r}: VALUE must be a Python literal") from None
    return settings


def policy_record(settings: dict) -> dict:
    """Launch-policy settings as a results file records them (each value's repr)."""
    return {k: repr(v) for k, v in settings.items()}


def _code_key(node) -> str:
    """A node's code as text: node types and field values, without positions, docstrings or
    empty fields (so the key is the same under the Pythons that read it: 3.12 adds empty
    type_params fields that 3.11 lacks)."""
    if isinstance(node, ast.AST):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body = body[1:]
        parts = []
        for name, value in ast.iter_fields(node):
            value = body if name == "body" and body is not None else value
            if value is None or value == []:
                continue
            parts.append(f"{name}={_code_key(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_code_key(x) for x in node) + "]"
    return repr(node)


def kernel_fingerprint(root: str | os.PathLike | None = None) -> str:
    """12 hex digits over the code of KERNEL_SOURCES under root (default: this checkout): a
    change to what runs moves it; comments, docstrings and formatting do not."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent.parent
    files = []
    for rel in KERNEL_SOURCES:
        p = root / rel
        files += sorted(p.glob("*.py")) if p.is_dir() else [p]
    files = [f for f in files if f.relative_to(root).as_posix() not in NOT_KERNEL_SOURCES]
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(_code_key(ast.parse(f.read_text())).encode() + b"\0")
    return h.hexdigest()[:12]


def _clean(v):
    """JSON-safe: NaN/inf become null (json.dump would write invalid JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def validate(doc: dict) -> None:
    """Raise ValueError when doc is not a results file of the documented schema."""
    missing = [k for k in TOP_KEYS if k not in doc]
    if missing:
        raise ValueError(f"results file lacks top-level keys {missing}")
    if not isinstance(doc["rows"], list):
        raise ValueError("'rows' must be a list")
    for i, r in enumerate(doc["rows"]):
        miss = [k for k in ROW_KEYS if k not in r]
        if miss:
            raise ValueError(f"row {i} lacks {miss}: {r}")
        st = r.get("status", "ok")
        if st not in STATUSES:
            raise ValueError(f"row {i} has status {st!r}, expected one of {STATUSES}")
        if st == "ok" and (r["median_ms"] is None or r["tflops"] is None):
            raise ValueError(f"row {i} is ok but has no timing: {r}")


def make_doc(env: dict, rows: list[dict]) -> dict:
    doc = {k: env[k] for k in TOP_KEYS[:-1]}
    doc["rows"] = [_clean(r) for r in rows]
    validate(doc)
    return doc


def merge_rows(old_rows: list[dict], new_rows: list[dict], suites, cases=None) -> list[dict]:
    """Keep old rows of suites not run now; replace those of the suites run now. cases: the
    (suite, case) pairs a filtered run (run --cases) ran: only their old rows are replaced, so
    the suite's other cases keep theirs."""
    if cases is not None:
        run = set(cases)
        return [r for r in old_rows if (r.get("suite"), r.get("case")) not in run] + list(new_rows)
    suites = set(suites)
    return [r for r in old_rows if r.get("suite") not in suites] + list(new_rows)


def write(path: str | os.PathLike, env: dict, rows: list[dict]) -> dict:
    """Write atomically (a run killed mid-write leaves the previous file)."""
    doc = make_doc(env, rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return doc


def load(path: str | os.PathLike) -> dict:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc
