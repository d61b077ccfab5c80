# Set up the GPU machine for the benchmarks. Source it from the repository root:
#     source dev/gpu_setup.sh
# - installs the wheels in .whl/ (FlashInfer 0.7.2.post1 + apache-tvm-ffi, and pytest-xdist +
#   execnet for make test-gpu; downloaded on the CPU machine and carried along: the GPU machine
#   has no network) into $CA_SITE (default /tmp/site) and puts that folder on PYTHONPATH;
# - unpacks FlashInfer's built modules carried in .ficache/ (run tool: carry [".whl", ".ficache"])
#   into its AOT folder, so they load instead of compiling for minutes;
# - installs compiled_attn itself (editable, no deps, no build isolation: that would download
#   setuptools), unless compiled_attn.ops already imports.
# Idempotent: a warm machine skips what is already there. Sourced, so no `set -e` (it would leak
# into the caller's shell); each step reports its own failure instead.

CA_SITE="${CA_SITE:-/tmp/site}"
if ls .whl/*.whl >/dev/null 2>&1; then
    if [ ! -f "$CA_SITE/.compiled_attn_wheels" ]; then
        echo "gpu_setup: installing $(ls .whl/*.whl | wc -l) wheels into $CA_SITE"
        if python3 -m pip install -q --no-index --no-deps --no-compile --target "$CA_SITE" .whl/*.whl; then
            touch "$CA_SITE/.compiled_attn_wheels"
        else
            echo "gpu_setup: wheel install FAILED (FlashInfer rows will say why; or use --no-flashinfer)"
        fi
    fi
    case ":${PYTHONPATH:-}:" in
        *":$CA_SITE:"*) ;;
        *) export PYTHONPATH="$CA_SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
else
    echo "gpu_setup: no .whl/ here (run the run tool with carry [\".whl\"]); FlashInfer will be" \
         "recorded as unavailable (or pass --no-flashinfer)"
fi

# FlashInfer's built modules, carried as .ficache/fi_aot.txz.part.* (an xz tar of
# aot/<module>/<module>.so, the layout of FlashInfer's own AOT folder; `python -m dev.fi_prebuild
# --pack $OUT` writes it on a GPU machine after the builds) and unpacked into the installed
# package's flashinfer/data/: FlashInfer loads a module found there without building it. Modules
# not carried build under FLASHINFER_WORKSPACE_BASE (default /tmp/fiws) on first use.
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}"
if ls .ficache/fi_aot.txz.part.* >/dev/null 2>&1 && [ -d "$CA_SITE/flashinfer" ] \
        && [ ! -f "$CA_SITE/.compiled_attn_fi_aot" ]; then
    mkdir -p "$CA_SITE/flashinfer/data"
    cat .ficache/fi_aot.txz.part.* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('$CA_SITE/flashinfer/data')" \
        && touch "$CA_SITE/.compiled_attn_fi_aot" \
        && echo "gpu_setup: FlashInfer modules carried: $(ls "$CA_SITE/flashinfer/data/aot" | wc -l)" \
        || echo "gpu_setup: unpacking .ficache FAILED"
fi

if ! python3 -c "import compiled_attn.ops" >/dev/null 2>&1; then
    echo "gpu_setup: pip install --no-deps --no-build-isolation -e ."
    python3 -m pip install -q --no-deps --no-build-isolation -e . \
        || echo "gpu_setup: installing compiled_attn FAILED"
fi
python3 - <<'PY'
import importlib
for name in ("torch", "triton", "compiled_attn", "flashinfer", "xdist", "tqdm", "matplotlib"):
    try:
        m = importlib.import_module(name)
        print(f"gpu_setup: {name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"gpu_setup: {name} unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
PY
