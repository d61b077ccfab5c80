"""Packaging: the wheel holds every module and the LICENSE and requires numpy, the README's quick start runs, and
the top-level ops/fx_passes fail loudly.

ops/ and fx_passes/ sit at the repository top level and install as compiled_attn.ops and
compiled_attn.fx_passes (setuptools package-dir mapping). The wheel test builds from a copy of
the source tree in a temporary folder (so no build/ or egg-info lands in the checkout) and
compares the wheel's listing with the source listing, so new modules are covered without
editing this file. Importing ``ops`` or ``fx_passes`` as top-level packages from the
repository root must raise an ImportError that says how to import them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {"compiled_attn": "compiled_attn", "ops": "compiled_attn/ops",
           "fx_passes": "compiled_attn/fx_passes"}


def _source_modules() -> set[str]:
    """Every .py file of the three source folders, as its path inside the wheel."""
    mods = set()
    for src, dst in MAPPING.items():
        for f in (ROOT / src).rglob("*.py"):
            if "__pycache__" in f.parts:
                continue
            mods.add(f"{dst}/{f.relative_to(ROOT / src).as_posix()}")
    return mods


def test_source_listing_is_not_empty():
    mods = _source_modules()
    for must in ("compiled_attn/__init__.py", "compiled_attn/ops/__init__.py",
                 "compiled_attn/ops/contracts.py", "compiled_attn/ops/reference.py",
                 "compiled_attn/fx_passes/__init__.py", "compiled_attn/ops/schedule.py"):
        assert must in mods


@pytest.mark.slow
def test_wheel_contains_every_module(tmp_path):
    """Bounded at 60 s by the build subprocess timeout (a few seconds here)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for folder in MAPPING:
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(src)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    missing = _source_modules() - names
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licenses, f"LICENSE not in the wheel: {sorted(names)}"
    assert b"Apache License" in zipfile.ZipFile(wheels[0]).read(licenses[0])
    # numpy is required: without it torch's own import warns "Failed to initialize NumPy"
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(.*)$",
                          zipfile.ZipFile(wheels[0]).read(meta).decode(), re.M)
    assert ("numpy", "") in requires, requires
    # no top-level ops / fx_passes packages in the wheel (they would shadow other projects)
    assert not any(n.startswith(("ops/", "fx_passes/")) for n in names), sorted(names)


@pytest.mark.parametrize("pkg,proper", [("ops", "compiled_attn.ops"),
                                        ("fx_passes", "compiled_attn.fx_passes")])
def test_top_level_import_fails_loudly(pkg, proper):
    """`import ops` from the repo root (root on sys.path) raises ImportError naming the right
    import; after compiled_attn is imported it still raises (no second registration)."""
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "import compiled_attn\n"
        "try:\n"
        f"    import {pkg}\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR:', e)\n"
        "    raise SystemExit(3)\n"
        "raise SystemExit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"import it as {proper}" in proc.stdout, proc.stdout
    assert "pip install -e ." in proc.stdout

    bare = subprocess.run([sys.executable, "-c", f"import {pkg}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0
    assert "ImportError" in bare.stderr and proper in bare.stderr, bare.stderr


def test_readme_quick_start_runs():
    """The README's quick start, run as written (a fresh process): it prints its check against
    SDPA, within float32 rounding on CPU."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    m = re.search(r"max \|out - SDPA\| = (\S+)", proc.stdout)
    assert m, proc.stdout
    assert float(m.group(1)) < (1e-5 if proc.stdout.startswith("cpu") else 2e-2), proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr
