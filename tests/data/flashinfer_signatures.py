"""Extract the signatures of FlashInfer's public entry points that compiled_attn mirrors, from
FlashInfer's Python sources (read with ``ast``: nothing is imported, so no GPU is needed).

    pip download --no-deps flashinfer-python==0.7.2.post1 && unzip it, then
    python tests/data/flashinfer_signatures.py path/to/flashinfer 0.7.2.post1 \\
        > tests/data/flashinfer_signatures.json

tests/test_api_signatures.py checks compiled_attn's signatures against the JSON this writes.
Each parameter is [name, kind ("pos", "varpos", "kwonly" or "varkw"), default as source text
or null, has_default]; a method assigned from another (``begin_forward = plan``) is
["alias", target], and a module-level ``functools.partial`` is ["partial", target,
{keyword: value source}]. Where a name is defined more than once (typing overloads first), the last
definition is the implementation and wins.
"""

import ast
import json
import sys

# FlashInfer source file -> the public names compiled_attn mirrors from it (docs/spec.md)
TARGETS = {
    "prefill.py": ["single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse",
                   "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
                   "trtllm_fmha_v2_prefill"],
    "pod.py": ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"],
    "cudnn/prefill.py": ["cudnn_batch_prefill_with_kv_cache"],
    "cascade.py": ["merge_state", "merge_states", "merge_state_in_place"],
    "page.py": ["get_batch_indices_positions", "get_seq_lens", "append_paged_kv_cache"],
    "utils.py": ["get_alibi_slopes"],
    "quantization/packbits.py": ["packbits", "segment_packbits"],
}
METHODS = ("__init__", "plan", "run", "run_return_lse", "reset_workspace_buffer",
           "begin_forward", "forward", "forward_return_lse", "end_forward")


def params(fn: ast.FunctionDef) -> list:
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    out = [[p.arg, "pos", None if d is None else ast.unparse(d), d is not None]
           for p, d in zip(pos, defaults)]
    if a.vararg:
        out.append([a.vararg.arg, "varpos", None, False])
    out += [[p.arg, "kwonly", None if d is None else ast.unparse(d), d is not None]
            for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append([a.kwarg.arg, "varkw", None, False])
    return out


def extract(root: str) -> dict:
    res = {}
    for path, names in TARGETS.items():
        with open(f"{root}/{path}") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                res[node.name] = params(node)
            elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                  and ast.unparse(node.value.func) == "functools.partial"):
                for t in node.targets:  # name = functools.partial(fn, kw=...)
                    if isinstance(t, ast.Name) and t.id in names:
                        res[t.id] = ["partial", ast.unparse(node.value.args[0]),
                                     {k.arg: ast.unparse(k.value) for k in node.value.keywords}]
            elif isinstance(node, ast.ClassDef) and node.name in names:
                for m in node.body:
                    if isinstance(m, ast.FunctionDef) and m.name in METHODS:
                        res[f"{node.name}.{m.name}"] = params(m)
                    elif isinstance(m, ast.Assign) and isinstance(m.value, ast.Name):
                        for t in m.targets:
                            if isinstance(t, ast.Name) and t.id in METHODS:
                                res[f"{node.name}.{t.id}"] = ["alias", m.value.id]
    missing = [n for names in TARGETS.values() for n in names
               if n not in res and not any(k.startswith(n + ".") for k in res)]
    if missing:
        raise SystemExit(f"not found in {root}: {missing}")
    return res


if __name__ == "__main__":
    root, version = sys.argv[1], sys.argv[2]
    sigs = extract(root)
    # one entry per line block, one parameter per line: diffs between versions stay readable
    lines = [f'{{"flashinfer": {json.dumps(version)}, "signatures": {{']
    for i, (name, sig) in enumerate(sigs.items()):
        sep = "," if i < len(sigs) - 1 else ""
        if sig and sig[0] in ("alias", "partial"):
            lines.append(f"  {json.dumps(name)}: {json.dumps(sig)}{sep}")
        else:
            lines.append(f"  {json.dumps(name)}: [")
            lines += [f"    {json.dumps(p)}{',' if j < len(sig) - 1 else ''}"
                      for j, p in enumerate(sig)]
            lines.append(f"  ]{sep}")
    lines.append("}}")
    print("\n".join(lines))
