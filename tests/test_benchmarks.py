"""CPU tests of the benchmark harness (no GPU): FLOP counting against brute force, case
generation, argument parsing, the results schema, the plot and report scripts, and one tiny
end-to-end run of the loop on CPU (our ops run the reference there; SDPA's CPU flash backend)."""

from __future__ import annotations

import json
import pathlib

import pytest

from benchmarks import cases, flops, results
from benchmarks.run import parse_args


def brute_pairs(qo, kv, causal):
    """Visible (i, j) pairs, bottom-right aligned: j <= i + kv - qo."""
    return sum(1 for i in range(qo) for j in range(kv) if not causal or j <= i + kv - qo)


@pytest.mark.parametrize("qo,kv", [(1, 1), (3, 7), (7, 3), (5, 5), (8, 1), (1, 8), (0, 4),
                                   (4, 0), (13, 13), (16, 33), (33, 16)])
def test_causal_pairs_exact_vs_brute_force(qo, kv):
    assert flops.causal_pairs_exact(qo, kv) == brute_pairs(qo, kv, True)


@pytest.mark.parametrize("qo,kv", [(3, 7), (7, 3), (1, 8), (16, 33), (33, 16)])
def test_non_square_causal_counts_visible_pairs(qo, kv):
    h, d = 3, 8
    got = flops.attention_flops([qo], [kv], h, d, causal=True)
    assert got == 4 * brute_pairs(qo, kv, True) * h * d


@pytest.mark.parametrize("s", [1, 4, 17, 64])
def test_square_causal_is_halved_and_noncausal_is_full(s):
    h, d = 2, 16
    assert flops.attention_flops([s], [s], h, d, causal=True) == 4 * s * s * h * d / 2
    assert flops.attention_flops([s], [s], h, d, causal=False) == 4 * brute_pairs(s, s, False) * h * d
    # the halved convention differs from the exact count by the diagonal's half
    assert brute_pairs(s, s, True) - s * s / 2 == s / 2


def test_batch_flops_sum_over_requests_and_dvo():
    qo, kv = [4, 5, 6], [4, 9, 2]
    want = sum(2 * flops.visible_pairs(a, b, True) * 4 * (16 + 8) for a, b in zip(qo, kv))
    assert flops.attention_flops(qo, kv, 4, 16, 8, causal=True) == want
    with pytest.raises(ValueError):
        flops.attention_flops([1, 2], [1], 1, 1)
    assert flops.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert flops.tflops(1.0, None) is None


def test_fa3_suite_grid():
    cs = cases.fa3_cases()
    assert len(cs) == 3 * 6 * 2
    for c in cs:
        assert c.tokens == 16 * 1024 and c.num_qo_heads * c.head_dim == 2048
        assert c.layout == "dense" and c.uniform
    c = next(c for c in cs if c.name == "D128 S4096 causal")
    assert (c.batch, c.num_qo_heads, c.causal) == (4, 16, True)
    assert c.flops == 4 * 4096 * 4096 * 16 * 128 * 4 / 2


def test_flashinfer_paged_gqa_varlen_suites():
    fi = cases.flashinfer_cases()
    assert [(c.batch, c.seq_len) for c in fi] == list(cases.FLASHINFER_SWEEP)
    assert all(c.num_qo_heads == 32 == c.num_kv_heads and c.head_dim == 128 and c.causal
               for c in fi)
    pg = cases.paged_cases()
    assert {c.page_size for c in pg if c.layout == "paged"} == {1, 16}
    groups = {c.group_key for c in pg}
    for g in groups:  # every paged case has its ragged twin with the same lengths
        layouts = {c.layout for c in pg if c.group_key == g}
        assert layouts == {"ragged", "paged"}
    assert [(c.num_qo_heads, c.num_kv_heads) for c in cases.gqa_cases()] == [(32, 8), (64, 8)]
    vl = cases.varlen_cases()
    by = {c.name: c for c in vl}
    for c in vl:
        if c.fixed_case:
            fx = by[c.fixed_case]
            assert fx.uniform and fx.batch == c.batch == 16
            assert abs(fx.tokens - c.tokens) < 16
            assert not c.uniform
    u = cases.uniform_lengths()
    assert len(u) == 16 and min(u) >= 512 and max(u) <= 4096
    z = cases.zipf_lengths()
    assert len(z) == 16 and abs(sum(z) / 16 - 1024) < 8 and max(z) > 4 * min(z) * 2


def test_quick_grid_is_smaller():
    for s in cases.SUITES:
        assert 0 < len(cases.SUITE_CASES[s](True)) <= len(cases.SUITE_CASES[s](False))
    assert len(cases.cases_for(cases.SUITES, quick=True)) <= 24


def test_parse_args():
    a = parse_args(["--suite", "all", "--quick"])
    assert a.suites == list(cases.SUITES) and a.quick
    assert a.flashinfer_dims is None  # every head dim: every row gets its FlashInfer ratios
    assert a.provider_list[0] == "compiled_attn" and "flashinfer_fa3" in a.provider_list
    a = parse_args(["--suite", "paged,varlen", "--providers", "flex,compiled_attn",
                    "--no-flashinfer", "--flashinfer-dims", "64,128"])
    assert a.suites == ["paged", "varlen"]
    assert a.provider_list == ["compiled_attn", "flex"]
    assert a.no_flashinfer and a.flashinfer_dims == {64, 128}
    with pytest.raises(SystemExit):
        parse_args(["--suite", "nope"])
    with pytest.raises(SystemExit):
        parse_args(["--providers", "nope"])


ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
       "date": "2026-01-01T00:00:00+00:00"}


def synthetic_rows():
    rows = []
    tf = {"compiled_attn": 500.0, "flex": 400.0, "sdpa_flash": 300.0, "sdpa_cudnn": 600.0}
    for c in cases.fa3_cases(quick=True) + cases.paged_cases(quick=True) + cases.varlen_cases():
        for p, t in tf.items():
            if c.layout == "paged" and p != "compiled_attn":
                rows.append({"suite": c.suite, "case": c.name, "provider": p, "median_ms": None,
                             "tflops": None, "status": "unavailable", "error": "no page table",
                             **c.row_fields()})
                continue
            t = t * (0.9 if c.page_size == 1 else 1.0)
            rows.append({"suite": c.suite, "case": c.name, "provider": p,
                         "median_ms": c.flops / (t * 1e12) * 1e3, "tflops": t, "status": "ok",
                         **c.row_fields()})
    return rows


def test_results_schema_roundtrip_and_merge(tmp_path):
    path = tmp_path / "r" / "h100.json"
    rows = synthetic_rows()
    rows[0]["rel_err"] = float("nan")  # NaN must not produce invalid JSON
    results.write(path, ENV, rows)
    doc = json.loads(path.read_text())
    assert list(doc) == ["gpu", "torch", "triton", "date", "rows"]
    assert doc["rows"][0]["rel_err"] is None
    for r in doc["rows"]:
        assert {"suite", "case", "provider", "median_ms", "tflops"} <= set(r)
    assert results.load(path)["gpu"] == ENV["gpu"]
    merged = results.merge_rows(doc["rows"], [{"suite": "fa3", "case": "x", "provider": "p",
                                               "median_ms": 1.0, "tflops": 1.0}], ["fa3"])
    assert {r["suite"] for r in merged} == {"fa3", "paged", "varlen"}
    assert sum(r["suite"] == "fa3" for r in merged) == 1
    # a filtered run (--cases) replaces only the cases it ran
    n_fa3 = sum(r["suite"] == "fa3" for r in doc["rows"])
    case = next(r["case"] for r in doc["rows"] if r["suite"] == "fa3")
    new = [{**r, "tflops": 1.0} for r in doc["rows"] if (r["suite"], r["case"]) == ("fa3", case)]
    merged = results.merge_rows(doc["rows"], new, ["fa3"], [("fa3", case)])
    assert len(merged) == len(doc["rows"]) and sum(r["suite"] == "fa3" for r in merged) == n_fa3
    assert [r for r in merged if r["case"] == case and r["suite"] == "fa3"] == new
    with pytest.raises(ValueError):
        results.validate({"gpu": 1, "rows": []})
    with pytest.raises(ValueError):
        results.validate({**ENV, "rows": [{"suite": "a", "case": "b", "provider": "c",
                                           "median_ms": None, "tflops": None}]})


def test_plot_and_report(tmp_path):
    from benchmarks import plot, report

    path = tmp_path / "h100.json"
    results.write(path, ENV, synthetic_rows())
    assert plot.main([str(path)]) == 0
    for s in ("fa3", "paged", "varlen"):
        png = tmp_path / f"h100_{s}.png"
        assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    assert report.main([str(path)]) == 0
    md = (tmp_path / "h100_ratios.md").read_text()
    # synthetic rows carry no kernel fingerprint: each of ours is marked as such
    assert "| fa3 | D128 S4096 causal | 500 ? | 1.25 | 1.67 | 0.83 |" in md
    assert "| B32 S4096 | 16 | 1.000 | - |" in md and "| B32 S4096 | 1 | 0.900 | - |" in md
    assert "varlen / our fixed-length >= 1.0 | 2 (0 missing) | 1.00 | 2/2 |" in md
    assert "Suites from more than one run" not in md
    # a file merged from two runs says which suites came from which
    rows = synthetic_rows()
    for r in rows:
        r["run_date"] = "2026-11-22T12:00" if r["suite"] == "paged" else "2026-11-22T11:00"
    md = report.render(results.make_doc(ENV, rows))
    assert ("Suites from more than one run: fa3, varlen at 2026-11-22T11:00; paged at "
            "2026-11-22T12:00.\n") in md
    # a suite re-timed in part (run --cases) is named as such
    rows[0]["run_date"] = "2026-11-22T13:00"
    md = report.render(results.make_doc(ENV, rows))
    assert f"{rows[0]['suite']}: re-timed in part (`run --cases`)" in md


def test_report_pairs_only_rows_of_one_run():
    # A ratio's two rows must come from one run: a peer, a paged row's ragged twin or a varlen
    # batch's fixed-length companion re-timed in another run gives no ratio ('-'); a peer that
    # does not run a case (unavailable) is not counted in the goal rows.
    from benchmarks import report

    rows = synthetic_rows()
    for r in rows:
        r["run_date"] = "2026-11-22T11:00"
    md = report.render(results.make_doc(ENV, rows))
    n_cudnn = sum(r["provider"] == "sdpa_cudnn" and r["status"] == "ok" for r in rows)
    assert f"goal: ours / SDPA cuDNN >= 1.0 (rows it runs) | {n_cudnn} (0 missing)" in md
    assert "| B32 S4096 | 16 | 1.000 | - |" in md
    later = "2026-11-22T12:00"
    for r in rows:
        if (r["provider"] == "flex" and r["case"] == "D128 S4096 causal") or (
                r["provider"] == "compiled_attn" and r["layout"] == "ragged"
                and r["suite"] in ("paged", "varlen") and r["case"].startswith(("B32", "fixed"))):
            r["run_date"] = later
    md = report.render(results.make_doc(ENV, rows))
    assert "| fa3 | D128 S4096 causal | 500 ? | - | 1.67 | 0.83 |" in md
    assert "| B32 S4096 | 16 | - | - |" in md and "| B32 S4096 | 1 | - | - |" in md
    assert "varlen / our fixed-length >= 1.0 | 2 (2 missing) | - | 0/2 |" in md


def test_kernel_fingerprint_follows_code_not_comments(tmp_path):
    """kernel_fingerprint moves with the code of ops/ (the work-list builders included), not
    with their comments, docstrings or formatting, nor with other files; the report marks our
    rows timed on another source (*) or on none recorded (?)."""
    from benchmarks import report

    (tmp_path / "ops").mkdir()
    (tmp_path / "compiled_attn").mkdir()
    kernel = tmp_path / "ops" / "kernel.py"
    kernel.write_text('"""Doc."""\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n')
    (tmp_path / "ops" / "schedule.py").write_text("W = 2\n")
    base = results.kernel_fingerprint(tmp_path)
    assert len(base) == 12 and base == results.kernel_fingerprint(tmp_path)
    kernel.write_text('"""Other doc."""\n\ndef f(x):\n    return (x\n            + 1)  # two\n')
    assert results.kernel_fingerprint(tmp_path) == base
    (tmp_path / "compiled_attn" / "api.py").write_text("X = 1\n")  # not a kernel source
    (tmp_path / "ops" / "reference.py").write_text("Y = 1\n")  # the CPU path: nor is this
    assert results.kernel_fingerprint(tmp_path) == base
    kernel.write_text("def f(x):\n    return x + 2\n")
    assert results.kernel_fingerprint(tmp_path) != base
    kernel.write_text("def f(x):\n    return x + 1\n")
    (tmp_path / "ops" / "schedule.py").write_text("W = 3\n")
    assert results.kernel_fingerprint(tmp_path) != base
    # the checkout's own sources are found and parse
    assert results.kernel_fingerprint() == results.kernel_fingerprint(ROOT)

    rows = [r for r in synthetic_rows() if r["suite"] == "fa3"]
    ours = [r for r in rows if r["provider"] == "compiled_attn"]
    ours[0]["kernel_src"], ours[1]["kernel_src"] = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
    md = report.render(results.make_doc(ENV, rows), kernel_src="aaaaaaaaaaaa")
    assert (f"Of our {len(ours)} timed rows, 1 were timed on it, 1 on another source (`*` "
            f"below) and {len(ours) - 2} before rows recorded theirs") in md
    assert f"| fa3 | {ours[0]['case']} | {ours[0]['tflops']:.0f} |" in md
    assert f"| fa3 | {ours[1]['case']} | {ours[1]['tflops']:.0f} * |" in md


def test_cpu_smoke_run_end_to_end(tmp_path):
    """The whole loop on tiny shapes on CPU (ops fall back to the reference): rows for every
    provider, refusals recorded as unavailable, nothing failed."""
    pytest.importorskip("compiled_attn.ops")
    from benchmarks import run

    out = tmp_path / "smoke.json"
    rc = run.main(["--suite", "smoke", "--device", "cpu", "--providers",
                   "compiled_attn,sdpa_flash,sdpa_cudnn,flex,flashinfer_fa2",
                   "--warmup-ms", "1", "--rep-ms", "2", "--out", str(out)])
    assert rc == 0
    doc = results.load(out)
    n_cases = len(cases.smoke_cases())
    assert len(doc["rows"]) == 5 * n_cases
    assert {r["run_date"] for r in doc["rows"]} == {doc["date"]}
    assert {r["kernel_src"] for r in doc["rows"]} == {results.kernel_fingerprint()}
    st = {(r["case"], r["provider"]): r for r in doc["rows"]}
    assert all(r["status"] != "failed" for r in doc["rows"]), [r.get("error") for r in doc["rows"]]
    for c in cases.smoke_cases():
        ours = st[(c.name, "compiled_attn")]
        assert ours["status"] == "ok" and ours["rel_err"] < 2e-2 and ours["tflops"] > 0
        assert st[(c.name, "flashinfer_fa2")]["status"] == "unavailable"
    assert "ratio_vs_sdpa_flash" in st[("dense D64 S128 causal", "compiled_attn")]


def test_results_file_is_named_after_the_device():
    from benchmarks.run import device_slug

    assert device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert device_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_slug("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert device_slug("cpu") == "cpu"


def test_cpu_run_leaves_another_devices_results_alone(tmp_path, monkeypatch):
    """Without --out, a CPU run writes benchmarks/results/cpu.json; where that file holds
    another device's rows it refuses (exit 2, file unchanged). --out naming the file writes."""
    pytest.importorskip("compiled_attn.ops")
    from benchmarks import run

    monkeypatch.setattr(run, "RESULTS_DIR", tmp_path)
    args = ["--suite", "smoke", "--device", "cpu", "--providers", "compiled_attn",
            "--warmup-ms", "1", "--rep-ms", "2", "--cases", "D64 S128 causal"]
    assert run.main(args) == 0
    mine = tmp_path / "cpu.json"
    assert results.load(mine)["gpu"] == "cpu"

    theirs = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6",
              "date": "2026-11-24T22:13:51+00:00", "rows": []}
    mine.write_text(json.dumps(theirs))
    before = mine.read_bytes()
    assert run.main(args) == 2
    assert mine.read_bytes() == before
    assert run.main(args + ["--out", str(mine)]) == 0
    assert results.load(mine)["gpu"] == "cpu"


def test_cli_help_covers_every_flag_and_suite(capsys):
    import argparse

    from benchmarks import run

    parser = run.build_parser()
    bare = [a.option_strings for a in parser._actions
            if a.option_strings and not a.help]
    assert not bare, f"flags without help: {bare}"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for suite in (*cases.SUITES, "smoke"):
        assert suite in text.split("--suite", 1)[1], suite
    assert argparse.SUPPRESS not in text


def test_twin_provider_is_an_a_a_control(tmp_path):
    """compiled_attn_twin times our op again as a peer: same op, same output, and the report
    gives its ratio (the harness's own spread) beside the real peers'."""
    pytest.importorskip("compiled_attn.ops")
    from benchmarks import report, run

    out = tmp_path / "twin.json"
    assert run.main(["--suite", "smoke", "--device", "cpu", "--providers",
                     "compiled_attn,compiled_attn_twin", "--warmup-ms", "1", "--rep-ms", "2",
                     "--out", str(out)]) == 0
    rows = results.load(out)["rows"]
    st = {(r["case"], r["provider"]): r for r in rows}
    for c in cases.smoke_cases():
        a, b = st[(c.name, "compiled_attn")], st[(c.name, "compiled_attn_twin")]
        assert a["status"] == b["status"] == "ok" and a["note"] == b["note"]
        assert a["rel_err"] == b["rel_err"]
    ratios = {(s, c): rat for s, c, _, rat in report.peer_ratios(rows)}
    assert all(rat["compiled_attn_twin"] > 0 for rat in ratios.values())
    md = report.render(results.load(out))
    assert f"A/A control (compiled_attn over compiled_attn_twin, the same op timed as a peer): " \
           f"{len(ratios)} rows" in md


def test_precise_timing_settings_reach_the_harness_and_the_rows(tmp_path, monkeypatch):
    """--precise times in 9 rounds with 300 ms of settling and 900 ms per runner, and every
    timed row says how it was timed."""
    from benchmarks import providers, run

    seen = []

    def fake_bench(runners, warmup_ms, rep_ms, cuda, rounds=3):
        seen.append((warmup_ms, rep_ms, rounds))
        return [providers.Timing(median_ms=1.0, iters=1) for _ in runners]

    monkeypatch.setattr(providers, "bench", fake_bench)
    out = tmp_path / "p.json"
    assert run.main(["--suite", "smoke", "--device", "cpu", "--providers", "compiled_attn",
                     "--precise", "--out", str(out)]) == 0
    assert seen and set(seen) == {(300.0, 900.0, 9)}
    rows = results.load(out)["rows"]
    assert rows and all(r["status"] == "ok" for r in rows)
    assert {r["timing"] for r in rows} == {"rounds 9, settle 300 ms, rep 900 ms"}
    with pytest.raises(SystemExit):  # both: an error, not one silently overriding the other
        run.main(["--suite", "smoke", "--device", "cpu", "--precise", "--rounds", "5"])


def test_forced_kv_path_sets_and_restores_every_path_setting():
    """The dev tools' path switch: inside, the path's settings; after, even on an error, every
    path setting as it was (the production policy)."""
    from dev.kv_paths import forced_kv_path
    from compiled_attn.ops import choose

    from compiled_attn.ops.policy import POLICY

    before = POLICY.settings()
    for path, (tma, settings) in choose.KV_PATHS.items():
        with pytest.raises(RuntimeError):
            with forced_kv_path(path) as got:
                assert got == tma
                assert {n: getattr(POLICY, n) for n in settings} == settings
                raise RuntimeError("a failed timing")
        assert POLICY.settings() == before


def test_forced_tile_sets_and_restores_the_tile_policy():
    from dev.kv_paths import forced_tile
    from compiled_attn.ops import choose

    before = choose.tile, choose.config
    with pytest.raises(RuntimeError):
        with forced_tile(256, 64, 16, 3):
            assert choose.tile(128, 128, 1, 4096, True, True, page_size=1) == 256
            assert choose.config(256, 128, 128) == dict(BLOCK_N=64, num_warps=16, num_stages=3,
                                                    TMA=True)
            raise RuntimeError("a failed timing")
    assert (choose.tile, choose.config) == before


def test_scatter_pages_round_trips_through_the_page_table():
    """The benchmarks' paged inputs (providers.scatter_pages): gathering each request's pages
    back in page-table order gives its keys, a partial last page included."""
    import torch

    from benchmarks.providers import scatter_pages

    kv_lens = [5, 16, 0, 33]
    k = torch.randn(sum(kv_lens), 2, 4)
    v = torch.randn(sum(kv_lens), 2, 4)
    kc, vc, indptr, idx, last = scatter_pages(k, v, kv_lens, 8, torch.Generator().manual_seed(0))
    assert indptr.tolist() == [0, 1, 3, 3, 8] and last.tolist() == [5, 8, 8, 1]
    start = 0
    for b, n in enumerate(kv_lens):
        pages = idx[indptr[b]:indptr[b + 1]].long()
        assert torch.equal(kc[pages].reshape(-1, 2, 4)[:n], k[start:start + n])
        assert torch.equal(vc[pages].reshape(-1, 2, 4)[:n], v[start:start + n])
        start += n


def _smoke_rows(tmp_path, provider_list: str) -> list[dict]:
    """The rows of a quick CPU run of the smoke suite with these providers."""
    from benchmarks import run

    out = tmp_path / "w.json"
    assert run.main(["--suite", "smoke", "--device", "cpu", "--providers", provider_list,
                     "--rep-ms", "1", "--warmup-ms", "1", "--out", str(out)]) == 0
    return results.load(out)["rows"]


def test_wrong_output_is_failed_and_not_timed(tmp_path, monkeypatch):
    """A provider whose output differs from the reference is recorded as failed, untimed; a
    provider that raises is failed with its error; neither stops the run."""
    import torch

    from benchmarks import providers

    calls = {"n": 0}

    def wrong(case, inps, opts):
        def fn():
            calls["n"] += 1
            return torch.zeros(case.tokens, case.num_qo_heads, case.head_dim)
        return providers.Runner([fn], lambda o: o)

    def crash(case, inps, opts):
        raise RuntimeError("kernel exploded\nsecond line")

    monkeypatch.setitem(providers.SETUPS, "sdpa_efficient", wrong)
    monkeypatch.setitem(providers.SETUPS, "flex", crash)
    rows = _smoke_rows(tmp_path, "sdpa_efficient,flex")
    assert calls["n"] == len(cases.smoke_cases())  # one check call per case, no timing calls
    for r in rows:
        assert r["status"] == "failed" and r["median_ms"] is None and r["tflops"] is None
        if r["provider"] == "sdpa_efficient":
            assert "wrong output" in r["error"] and r["rel_err"] == pytest.approx(1.0)
        else:
            assert r["error"] == "RuntimeError: kernel exploded"


def test_output_wrong_after_timing_fails_the_row(tmp_path, monkeypatch):
    """A provider right at its check call and wrong afterwards (its timed calls computed
    nothing) is failed by the re-check after timing, its timing kept aside; a provider right
    throughout keeps its row, with rel_err_after."""
    import torch
    from torch.utils._pytree import tree_map

    from benchmarks import providers

    real = providers.SETUPS["compiled_attn"]

    def flaky(case, inps, opts):
        runner = real(case, inps, opts)
        calls = {"n": 0}

        def fn(f=runner.fns[0]):
            calls["n"] += 1
            out = f()
            return out if calls["n"] == 1 else tree_map(torch.zeros_like, out)
        runner.fns = [fn]
        return runner

    monkeypatch.setitem(providers.SETUPS, "flex", flaky)
    rows = _smoke_rows(tmp_path, "compiled_attn,flex")
    assert rows
    for r in rows:
        if r["provider"] == "compiled_attn":
            assert r["status"] == "ok" and r["rel_err_after"] == pytest.approx(r["rel_err"])
        else:
            assert r["status"] == "failed" and "after the timed calls" in r["error"]
            assert r["median_ms"] is None and r["timed_ms"] > 0


def test_gpu_state_and_clock_in_summary(monkeypatch):
    """Each timed CUDA row carries the SM clock, power and temperature read while it ran; where
    NVML cannot be read (this CPU machine) the values are None, never a made-up number; the
    summary line shows a clock only when there is one."""
    import torch

    from benchmarks import providers, run

    state = providers.gpu_state()
    assert set(state) == {"sm_clock_mhz", "power_w", "temp_c"}
    if not torch.cuda.is_available():
        assert all(v is None for v in state.values())
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda: 1755, raising=False)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda: 612_400, raising=False)
    monkeypatch.setattr(torch.cuda, "temperature", lambda: 61, raising=False)
    assert providers.gpu_state() == {"sm_clock_mhz": 1755, "power_w": 612, "temp_c": 61}
    case = cases.smoke_cases()[0]
    rows = [{"provider": "compiled_attn", "status": "ok", "tflops": 400.0, "sm_clock_mhz": 1755},
            {"provider": "flex", "status": "ok", "tflops": 300.0, "sm_clock_mhz": None}]
    line = run.summary_line(case, rows)
    assert "compiled_attn 400 @1755MHz" in line and "flex 300 |" not in line
    assert line.endswith("flex 300")


def test_timing_groups_pair_what_the_ratios_compare():
    """Paged cases are grouped with their ragged twin of the same suite and lengths (not with the
    flashinfer suite's case of the same lengths), a varlen batch with its fixed-length
    companion; every other case is timed on its own."""
    from benchmarks.run import _groups

    all_cases = cases.cases_for(cases.SUITES)
    groups = _groups(all_cases)
    assert sum(len(g) for g in groups) == len(all_cases)
    for g in groups:
        assert len({c.timing_group for c in g}) == 1
    paged = [g for g in groups if g[0].suite == "paged"]
    assert len(paged) == len(cases.FLASHINFER_SWEEP)
    assert all(sorted(c.page_size for c in g) == [0, 1, 16] for g in paged)
    varlen = [sorted(c.uniform for c in g) for g in groups if g[0].suite == "varlen"]
    assert varlen == [[False, True], [False, True]]
    assert all(len(g) == 1 for g in groups if g[0].suite in ("fa3", "flashinfer", "gqa"))


def test_bench_interleaves_rounds_and_isolates_errors():
    """Each round times a slice of every runner, in a fresh seeded order, inside the runner's
    own context; a runner that raises mid-way is recorded and the others finish."""
    import contextlib
    import random

    from benchmarks import providers

    log, inside = [], []

    def runner(name, fail_at=None):
        calls = {"n": 0}

        def fn():
            calls["n"] += 1
            assert inside and inside[-1] == name, "called outside its context"
            if fail_at is not None and calls["n"] == fail_at:
                raise RuntimeError(f"{name} broke")
            log.append(name)

        @contextlib.contextmanager
        def ctx():
            inside.append(name)
            try:
                yield
            finally:
                inside.pop()
        return [fn], ctx

    # CPU counts: 1 + 3 estimate calls each, then 5 timed calls in 3 rounds: slices of 2, each
    # after one untimed settling call. c breaks on the first call of its second slice.
    res = providers.bench([runner("a"), runner("b"), runner("c", fail_at=8)],
                          warmup_ms=0.0, rep_ms=0.0, cuda=False, rounds=3)
    a, b, c = res
    assert a.error is None and b.error is None and a.iters == b.iters == 6
    assert a.median_ms >= 0 and b.median_ms >= 0
    assert isinstance(c.error, RuntimeError) and c.median_ms is None and c.iters == 0
    assert log[:12] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    want, alive = "", {0, 1, 2}
    for r in range(3):
        for i in random.Random(r).sample(range(3), 3):
            if i in alive:
                if i == 2 and r == 1:
                    alive.discard(2)  # its slice raised before logging anything
                    continue
                want += "abc"[i] * 3
    assert "".join(log[12:]) == want
    orders = ["".join("abc"[i] for i in random.Random(r).sample(range(3), 3)) for r in range(3)]
    assert len(set(orders)) > 1  # the order changes between rounds


def test_host_time_per_call_flags_cpu_bound_rows(monkeypatch):
    """CUDA timing also reads the host's time to issue each slice's calls; a row whose host
    time per call comes near its median time per call is flagged cpu_bound (the GPU waited on
    the host), and the report marks our TFLOP/s with (cpu). CUDA events are faked here with the
    host clock, so the plumbing runs on this CPU machine."""
    import contextlib
    import time

    import torch

    from benchmarks import providers, report, results, run

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    res = providers.bench([([lambda: time.sleep(1e-3)], contextlib.nullcontext)],
                          warmup_ms=0.0, rep_ms=0.0, cuda=True, rounds=2)
    (t,) = res
    assert t.error is None and t.iters >= 20 and t.host_ms is not None
    assert 0.5 < t.host_ms < 50 and 0.5 < t.median_ms < 50

    # the host time is read over a slice's first HOST_CALLS calls, issued after a synchronize
    # (the settling calls' backlog drained): later calls, which could block on a full launch
    # queue and count GPU time as the host's, do not enter it (here they take 5 ms, not 1)
    since_sync = [0]

    def sync(*a):
        since_sync[0] = 0

    def call():
        since_sync[0] += 1
        time.sleep(1e-3 if since_sync[0] <= 2 else 5e-3)

    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    monkeypatch.setattr(providers, "HOST_CALLS", 2)
    (t,) = providers.bench([([call], contextlib.nullcontext)], warmup_ms=0.0, rep_ms=0.0,
                           cuda=True, rounds=2)
    assert t.error is None and t.host_ms < 3.0 < 5.0 <= t.median_ms

    row = {}
    run.record_timing(row, 4e9, providers.Timing(median_ms=1.0, iters=20, host_ms=0.95), 3)
    assert row["cpu_bound"] and row["host_ms"] == 0.95 and row["tflops"] == 4.0
    row = {}
    run.record_timing(row, 4e9, providers.Timing(median_ms=1.0, iters=20, host_ms=0.5), 3)
    assert row["cpu_bound"] is False
    row = {}
    run.record_timing(row, 4e9, providers.Timing(median_ms=1.0, iters=20), 3)  # CPU timing
    assert "cpu_bound" not in row and "host_ms" not in row

    base = dict(suite="fa3", case="D128 S512 causal", status="ok", median_ms=1.0)
    doc = {"gpu": "g", "torch": "t", "triton": "tr", "date": "d", "rows": [
        dict(base, provider="compiled_attn", tflops=140.0, cpu_bound=True, host_ms=1.0,
             ratio_vs_flex=0.75),
        dict(base, provider="flex", tflops=187.0)]}
    md = report.render(doc)
    assert "| fa3 | D128 S512 causal | 140 (cpu) ? | 0.75 |" in md
    assert f"{results.CPU_BOUND} x median_ms" in md


def test_merge_folds_device_files(tmp_path):
    # two device calls, each returning the committed rows plus its own run: folding both keeps
    # both runs, replaces re-timed cases whole (a peer row the new run lacks goes too), keeps
    # untouched cases, and a later file's stale copy of a replaced row does not come back, nor
    # does one when the files are folded again (a second merge of the same calls)
    from dev import merge

    def row(case, provider, date, tflops=100.0):
        return {"suite": "fa3", "case": case, "provider": provider, "median_ms": 1.0,
                "tflops": tflops, "run_date": date}

    # case a's only run d0a is replaced by call 1, so its date leaves the file
    committed = [row("a", "ours", "d0a"), row("a", "eff", "d0a"), row("b", "ours", "d0b")]
    call1 = committed + [row("a", "ours", "d1", 200.0)]  # run d1 re-times case a
    call2 = committed + [row("b", "ours", "d2", 300.0), row("b", "eff", "d2")]
    target = tmp_path / "h100.json"
    results.write(target, ENV, committed)
    paths = []
    for i, rows in enumerate((call1, call2)):
        paths.append(tmp_path / f"call{i}.json")
        results.write(paths[-1], {**ENV, "date": f"d{i + 1}"}, rows)
    want = [("a", "ours", "d1"), ("b", "eff", "d2"), ("b", "ours", "d2")]
    for _ in range(2):
        assert merge.main([str(target)] + [str(p) for p in paths]) == 0
        doc = json.loads(target.read_text())
        assert sorted((r["case"], r["provider"], r["run_date"]) for r in doc["rows"]) == want
        assert doc["date"] == "d2"
    # one call that ran twice into its file (two benchmarks.run): both runs are its own
    call3 = doc["rows"] + [row("c", "ours", "d3"), row("a", "ours", "d4", 400.0)]
    paths.append(tmp_path / "call3.json")
    results.write(paths[-1], {**ENV, "date": "d4"}, call3)
    assert merge.main([str(target), str(paths[-1])]) == 0
    doc = json.loads(target.read_text())
    assert sorted((r["case"], r["provider"], r["run_date"]) for r in doc["rows"]) == [
        ("a", "ours", "d4"), ("b", "eff", "d2"), ("b", "ours", "d2"), ("c", "ours", "d3")]



def test_compile_path_cases_calls_and_plot(tmp_path):
    """benchmarks.compile_path off the GPU: its cases, the op calls it builds (each one the
    op's full argument list, run on CPU inputs against the ragged reference), distinct code
    objects for its two compiled providers, and the plot of a results file."""
    import torch

    from benchmarks import compile_path as cp
    from benchmarks import providers as P

    cases_ = cp.select_cases(quick=False)
    assert {c.layout for c in cases_} == {"dense", "ragged", "paged"}
    for layout in ("dense", "ragged", "paged"):
        case = next(c for c in cases_ if c.layout == layout)
        small = cases.Case(case.suite, case.name, layout, (32, 32), (32, 32), 2, 2, 64,
                           case.causal, page_size=case.page_size)
        inp = P.make_inputs(small, "cpu", torch.float32)
        name, tensors, full, _ = P.op_call(small, inp)
        out = getattr(torch.ops.compiled_attn, name)(*full(*tensors))[0]
        torch.testing.assert_close(out.reshape(64, 2, 64), P.reference(small, inp))
    f = lambda x: x + 1  # noqa: E731
    g = cp._fresh(f, "other")
    assert g.__code__ is not f.__code__ and g(1) == 2
    rows = [{"case": f"c{i}", "provider": p, "tflops": 100.0 + i} for i in range(3)
            for p in cp.PROVIDERS]
    doc = {"gpu": "cpu", "torch": torch.__version__, "triton": "-", "rows": rows}
    png = cp.plot(doc, tmp_path / "cp.png")
    assert png.stat().st_size > 1000


def test_cases_filter_keeps_whole_timing_groups(capsys):
    # --cases selects whole timing groups: a paged case brings its ragged twin and its other
    # page size, a varlen batch its fixed-length companion (the report pairs them by run).
    from benchmarks import run

    assert run.main(["--suite", "paged,varlen", "--cases", "B32 S4096 page16|zipf", "--list"]) == 0
    names = [line.split()[1:4] for line in capsys.readouterr().out.splitlines()
             if line.startswith(("paged", "varlen"))]
    assert names == [["B32", "S4096", "ragged"], ["B32", "S4096", "page16"],
                     ["B32", "S4096", "page1"], ["zipf", "mean1024", "ragged"],
                     ["fixed", "1024", "(="]], names


@pytest.mark.parametrize("name", ["dev_ab", "dev_kernel", "dev_launch_cost", "paged_tma_probe",
                                  "ws_probe", "split_kv_check", "kv_paths", "merge",
                                  "gpu_memcheck"])
def test_dev_tools_import(name):
    """The developer tools import from the repository root as python -m dev.NAME would (their
    imports of benchmarks/ and tests/ resolve); gpu_aoti_probe runs at import, on CUDA only."""
    import importlib

    mod = importlib.import_module(f"dev.{name}")
    assert mod.__doc__


def test_pod_suite_cases_and_cli(capsys):
    from benchmarks import pod

    full, quick = pod.case_list(), pod.case_list(quick=True)
    assert len(quick) == 6 and len(full) > 100 and len({c.name for c in full}) == len(full)
    assert {c.kind for c in quick} == {"pod", "batch_pod"}
    assert {(c.hq, c.hkv) for c in full} == set(pod.GQAS) and {c.page for c in full} == {16, 1}
    for p, d, kv in [(256, 16, 1024), (8192, 256, 32768)]:
        assert pod.PodCase("pod", (p,), d, kv, 64, 8, 1) in full
    assert all(len(c.prefill_lens) > 1 for c in full if c.kind == "batch_pod")
    c = pod.PodCase("pod", (2048,), 128, 4096, 32, 8, 16)
    assert c.decode_bytes() == 128 * 4096 * 2 * 8 * 128 * 2
    assert c.flops("all") == c.flops("prefill") + c.flops("decode") == \
        4.0 * 128 * 32 * (2048 * 2049 // 2 + 128 * 4096)
    parser = pod.build_parser()
    assert not [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    a = parser.parse_args(["--out", "x.json", "--quick", "--no-flashinfer"])
    assert a.quick and a.no_flashinfer and a.budget_s == 480.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert "--budget-s" in capsys.readouterr().out


def test_pod_suite_rows_and_ratios_from_fake_timings(tmp_path, monkeypatch):
    from benchmarks import pod
    from compiled_attn.ops import choose
    from compiled_attn.ops.policy import override

    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)  # (the suite's GPU)

    case = pod.PodCase("pod", (2048,), 128, 4096, 32, 8, 16)
    t = {"ours_pod": 500.0, "ours_pod_triton": 800.0, "ours_pod_compiled": 510.0,
         "ours_prefill": 100.0, "ours_decode": 400.0, "ours_apart": 600.0,
         "ours_mixed": 700.0, "fi_pod": 550.0, "fi_prefill": 90.0, "fi_decode": 380.0,
         "fi_apart": 480.0, "copy": 300.0}
    res = {(p, "eager"): v for p, v in t.items()}
    res.update({(p, "graph"): v * 0.9 for p, v in t.items()})
    res["fi_pod", "graph"] = "RuntimeError: capture refused"
    res["copy", "graph"] = "skipped: --no-flashinfer"
    state = dict(sm_clock_mhz=1755, power_w=640, temp_c=61)
    rows = pod.assemble(case, res, diff=0.01, fi_diff=0.02, states={("ours_pod", "eager"): state})
    assert len(rows) == len(pod.PROVIDERS) * 2
    by = {(r["provider"], r["mode"]): r for r in rows}
    assert (by["ours_pod", "eager"]["sm_clock_mhz"], by["ours_pod", "eager"]["power_w"]) == \
        (1755, 640)
    assert "sm_clock_mhz" not in by["ours_apart", "eager"]
    assert by["fi_pod", "eager"]["max_abs_diff_vs_ours"] == 0.02
    assert "max_abs_diff_vs_ours" not in by["ours_pod", "eager"]
    e = by["ours_pod", "eager"]
    assert e["ratio_vs_apart"] == pytest.approx(600 / 500)
    assert e["ratio_vs_fi_pod"] == pytest.approx(550 / 500)
    assert e["bound_us"] == pytest.approx(400 + 0.25 * 100)
    assert e["pod_over_bound"] == pytest.approx(500 / 425) and e["max_abs_diff_vs_apart"] == 0.01
    assert e["ratio_vs_triton_pod"] == pytest.approx(800 / 500)
    assert e["ratio_vs_compiled"] == pytest.approx(510 / 500)
    # the launch the policy gives the case (ops.choose.pod_apart): the quick grid's
    # prefill-heavy case goes apart; the page-1 one is fused (both parts gathered), apart with
    # pod_gather off (its fused launch would be Triton's)
    assert e["launch"] == "fused" and "launch" not in by["ours_apart", "eager"]
    assert [pod.launch_choice(c) for c in pod.case_list(quick=True)] == \
        ["fused", "apart", "fused", "fused", "fused", "fused"]
    with override(pod_gather=False):
        assert pod.launch_choice(pod.case_list(quick=True)[4]) == "apart"
    # rows under CUDA graphs take the captured choice: a small page-1 call goes apart there
    small = pod.PodCase("pod", (256,), 16, 4096, 64, 8, 1)
    assert [pod.launch_plan(small, captured=c)["launch"] for c in (False, True)] == \
        ["fused", "apart"]
    # and p2048 + 16 x 1k on page 1 side by side in both (the decodes on a quarter of the SMs)
    side = pod.launch_plan(pod.PodCase("pod", (2048,), 16, 1024, 32, 8, 1))
    assert (side["launch"], side["side_programs"]) == ("side", 33)
    g = {(r["provider"], r["mode"]): r for r in pod.assemble(small, res, diff=None)}
    assert (g["ours_pod", "eager"]["launch"], g["ours_pod", "graph"]["launch"]) == \
        ("fused", "apart")
    # and the decode key chunks its plan gives the launch (compiled_attn/pod.py _chunks_for)
    assert e["decode_chunks"] == 0
    few = [pod.PodCase("pod", (2048,), 16, 32768, 32, 8, 16),
           pod.PodCase("pod", (8192,), 8, 32768, 32, 8, 16),
           pod.PodCase("pod", (256,), 16, 4096, 32, 8, 16),
           pod.PodCase("batch_pod", pod.BATCH_PREFILLS, 16, 4096, 32, 8, 1),
           pod.PodCase("pod", (8192,), 128, 32768, 32, 8, 16)]
    # (side by side: the decodes' programs, half the SMs, or for the decode-heavy last case
    # their share of both parts' bytes, at most 0.8 of the SMs; the fused launches' decode
    # items on the swapped products where their pages take TMA boxes, not on page 1's gathers)
    assert [pod.launch_plan(c) for c in few] == [
        dict(launch="fused", decode_chunks=8, side_programs=0, swap_decodes=True),
        dict(launch="side", decode_chunks=4, side_programs=66, swap_decodes=False),
        dict(launch="fused", decode_chunks=0, side_programs=0, swap_decodes=True),
        dict(launch="fused", decode_chunks=4, side_programs=0, swap_decodes=False),
        dict(launch="side", decode_chunks=0, side_programs=106, swap_decodes=False)]
    with override(pod_decode_swap=False):
        assert not pod.launch_plan(few[0])["swap_decodes"]
    g = by["ours_pod", "graph"]
    assert g["ratio_vs_apart"] == pytest.approx(600 / 500) and "ratio_vs_fi_pod" not in g
    assert by["fi_pod", "graph"]["status"] == "failed"
    assert by["copy", "graph"]["status"] == "unavailable"
    d = by["ours_decode", "eager"]
    nbytes = case.decode_bytes()
    assert d["decode_tbs"] == pytest.approx(nbytes / 400e-6 / 1e12)
    assert d["decode_over_copy"] == pytest.approx((nbytes / 400) / (2 * nbytes / 300))
    # the ceiling is the faster copy timing of either mode (graph's failed here: eager's)
    assert by["ours_decode", "graph"]["decode_over_copy"] == pytest.approx(
        (nbytes / 360) / (2 * nbytes / 300))
    assert by["copy", "eager"]["tflops"] == 0.0 and e["median_ms"] == 0.5
    skipped = pod.skipped(case, "--budget-s 480 spent")
    assert {r["status"] for r in skipped} == {"unavailable"}
    doc = dict(ENV, rows=rows + skipped)
    results.validate(doc)
    text = pod.table(doc["rows"])
    assert case.name in text and "1.20" in text
    pod.plot(doc, tmp_path / "pod.png")


def test_run_policy_settings(tmp_path, monkeypatch):
    """python -m benchmarks.run --policy NAME=VALUE: our provider runs under the setting (seen by
    the launch while it runs, restored after), each row records it, and it needs --out."""
    pytest.importorskip("compiled_attn.ops")
    from benchmarks import run
    from compiled_attn.ops import reference
    from compiled_attn.ops.policy import POLICY

    seen = []
    real = reference.single_prefill

    def spy(*a, **k):  # (the CPU body of the op our provider calls)
        seen.append(POLICY.host_tma_min_flop)
        return real(*a, **k)

    monkeypatch.setattr(reference, "single_prefill", spy)
    before = POLICY.host_tma_min_flop
    out = tmp_path / "variant.json"
    args = ["--suite", "smoke", "--device", "cpu", "--providers", "compiled_attn",
            "--warmup-ms", "1", "--rep-ms", "2", "--policy", "host_tma_min_flop=2e10"]
    assert run.main(args) == 2  # no --out
    assert run.main(args + ["--out", str(out)]) == 0
    assert seen and set(seen) == {2e10} and POLICY.host_tma_min_flop == before
    rows = results.load(out)["rows"]
    assert rows and all(r["policy"] == {"host_tma_min_flop": "20000000000.0"} for r in rows)


def test_pod_suite_policy_settings(tmp_path, monkeypatch):
    """--policy NAME=VALUE: the run goes under those launch-policy settings (read by the cases
    while they run, restored after), recorded in the results; malformed items exit with why."""
    from benchmarks import pod
    from compiled_attn.ops.policy import POLICY

    monkeypatch.setattr(pod, "environment", lambda: dict(ENV))
    before, seen = POLICY.host_tma_min_flop, []

    def run_case(case, args):
        seen.append((POLICY.host_tma_min_flop, POLICY.pod_gluon))
        return pod.assemble(case, {(p, m): 100.0 for p in pod.PROVIDERS for m in pod.MODES},
                            diff=0.0)

    monkeypatch.setattr(pod, "run_case", run_case)
    monkeypatch.setattr(pod, "plot", lambda doc, path: None)
    out = tmp_path / "pod.json"
    first = pod.case_list(quick=True)[0].name
    pod.main(["--out", str(out), "--quick", "--only", first, "--policy", "host_tma_min_flop=2e10",
              "--policy", "pod_gluon=False"])
    assert seen == [(2e10, False)] and POLICY.host_tma_min_flop == before
    assert json.loads(out.read_text())["policy"] == {"host_tma_min_flop": "20000000000.0",
                                                     "pod_gluon": "False"}
    for bad in ("host_tma_min_flop", "host_tma_min_flop=two"):
        with pytest.raises(SystemExit, match="--policy"):
            pod.main(["--out", str(out), "--only", first, "--policy", bad])


def test_pod_suite_keeps_timed_cases_when_stopped(tmp_path, monkeypatch, capsys):
    """The results file is rewritten after every case: a run stopped from outside during its
    second case keeps the first case's rows, and the cases not reached say so."""
    from benchmarks import pod

    monkeypatch.setattr(pod, "environment", lambda: dict(ENV))
    first = pod.case_list(quick=True)[0]

    def run_case(case, args):
        if case != first:
            raise KeyboardInterrupt  # a time limit's signal, as seen by the run
        res = {(p, m): 100.0 for p in pod.PROVIDERS for m in pod.MODES}
        return pod.assemble(case, res, diff=0.0)

    monkeypatch.setattr(pod, "run_case", run_case)
    monkeypatch.setattr(pod, "_free", lambda: None)
    out = tmp_path / "pod.json"
    with pytest.raises(KeyboardInterrupt):
        pod.main(["--out", str(out), "--quick"])
    doc = json.loads(out.read_text())
    results.validate(doc)
    by_case = {}
    for r in doc["rows"]:
        by_case.setdefault(r["case"], set()).add(r["status"])
    assert by_case.pop(first.name) == {"ok"}
    assert len(by_case) == 5 and all(s == {"unavailable"} for s in by_case.values())
    assert all("not reached" in r["error"] for r in doc["rows"] if r["case"] != first.name)
    assert f"{first.name} ..." in capsys.readouterr().out


def _stub_run_case(monkeypatch, max_diff, checked_graph) -> dict:
    """pod.run_case on the quick grid's first case with its GPU parts stubbed (inputs, calls,
    synchronisation, timing: 100 us a row) and these _max_diff / checked_graph; its rows by
    (provider, mode)."""
    import argparse

    import torch

    from benchmarks import pod

    monkeypatch.setattr(pod, "make_inputs", lambda case, dev: {"copy_dst": None, "copy_src": None})
    monkeypatch.setattr(pod, "_calls", lambda *a: {k: (lambda: None) for k in
                                                    ("pod", "prefill", "decode", "apart")})
    monkeypatch.setattr(pod, "_max_diff", max_diff)
    monkeypatch.setattr(pod, "checked_graph", checked_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timing = type("T", (), dict(median_ms=0.1, error=None, state={}))
    monkeypatch.setattr("benchmarks.providers.bench",
                        lambda runners, *a: [timing() for _ in runners])
    args = argparse.Namespace(no_flashinfer=True, compiled=False, warmup_ms=1, rep_ms=1,
                              rounds=1)
    return {(r["provider"], r["mode"]): r
            for r in pod.run_case(pod.case_list(quick=True)[0], args)}


@pytest.mark.parametrize("after", [0.5, 7.0])
def test_pod_suite_fails_an_eager_row_whose_output_changed(monkeypatch, after):
    """run_case checks POD's eager output against its parts again after the timed calls: the
    same difference as before them keeps the row; another (a launch that stopped computing
    between, as a bound call without its launches once did) fails the eager row, with both."""
    diffs = iter([0.5, after])
    by = _stub_run_case(monkeypatch, lambda calls, ref="parts": next(diffs),
                        lambda fn, perturb=None: fn)
    eager, graph = by["ours_pod", "eager"], by["ours_pod", "graph"]
    assert graph["status"] == "ok"
    if after == 0.5:
        assert eager["status"] == "ok" and eager["median_us"] == pytest.approx(100.0)
    else:
        assert eager["status"] == "failed" and "by 7.0 (before them: 0.5)" in eager["error"]


@pytest.mark.parametrize("kind,pre,page", [("pod", (40,), 16), ("batch_pod", (40, 17), 1)])
def test_pod_suite_inputs_agree_across_our_providers(kind, pre, page):
    """The suite's page tables, contiguous k_p / v_p and mixed plan describe one batch: on the
    CPU, POD, the parts alone and the mixed paged prefill give the same numbers."""
    import torch

    import compiled_attn as ca
    from benchmarks import pod

    case = pod.PodCase(kind, pre, 3, 37, 4, 2, page)
    x = pod.make_inputs(case, torch.device("cpu"))
    calls = {f"ours_{k}": v for k, v in pod._calls(ca, case, x, torch.device("cpu"), False).items()}
    assert pod._max_diff(calls) == 0.0
    out_p, out_d = calls["ours_pod"]()
    assert torch.equal(calls["ours_mixed"](), torch.cat([out_p, out_d]))
    di, dx, _ = x["dec"]
    pages = x["cache"][dx[di[1]:di[2]].long()].float()  # decode request 1
    k, v = (pages[:, j].reshape(-1, case.hkv, pod.D)[:case.kv].repeat_interleave(2, 1)
            for j in (0, 1))
    p = (torch.einsum("hd,nhd->hn", x["q_d"][1].float(), k) / pod.D ** 0.5).softmax(-1)
    ref = torch.einsum("hn,nhd->hd", p, v)
    assert (out_d[1].float() - ref).abs().max() < 1e-2


def test_host_suite_rows_and_ratios_from_fake_timings():
    """benchmarks/host.py's bookkeeping on this CPU machine: medians and best rounds per row,
    ours' ratios against every peer of the same case (medians and best rounds), rows without
    timings marked failed or unavailable, and the printed table."""
    from benchmarks import host

    call = object()
    provs = {("ragged_run", "compiled_attn"): call, ("ragged_run", "flashinfer"): call,
             ("paged_run", "compiled_attn"): call,
             ("paged_run", "flashinfer"): "RuntimeError: no JIT cache",
             ("pod_run", "flashinfer"): "skipped: --no-fi-pod"}
    times = {("ragged_run", "compiled_attn"): [26.0, 40.0, 25.0],
             ("ragged_run", "flashinfer"): [21.0, 20.0, 30.0],
             ("paged_run", "compiled_attn"): [27.0, 28.0, 26.0]}
    rows = host.assemble(provs, times, {("ragged_run", "compiled_attn"): 0.0,
                                        ("ragged_run", "flashinfer"): 0.0,
                                        ("paged_run", "compiled_attn"): 0.125})
    by = {(r["case"], r["provider"]): r for r in rows}
    ours = by["ragged_run", "compiled_attn"]
    assert by["paged_run", "compiled_attn"]["recordings_per_call"] == 0.125
    assert ours["recordings_per_call"] == 0.0
    assert "recordings_per_call" not in by["ragged_run", "flashinfer"]
    assert ours["host_us"] == 26.0 and ours["host_us_best"] == 25.0
    assert ours["ratio_vs_flashinfer"] == pytest.approx(21.0 / 26.0)
    assert ours["best_ratio_vs_flashinfer"] == pytest.approx(20.0 / 25.0)
    assert "ratio_vs_compiled_attn" not in by["ragged_run", "flashinfer"]
    assert by["paged_run", "flashinfer"]["status"] == "failed"
    assert by["pod_run", "flashinfer"]["status"] == "unavailable"
    assert not any(k.startswith("ratio_vs_") for k in by["paged_run", "compiled_attn"])
    text = host.table(rows)
    assert "flashinfer=0.81 (0.80)" in text and "RuntimeError: no JIT cache" in text
    assert "recorded/call=0.12" in text
    # the *_layers cases' calls take the layers' tensors in turn
    seen = []
    step = host._turns(seen.append, ["a", "b", "c"])
    for _ in range(7):
        step()
    assert seen == ["a", "b", "c", "a", "b", "c", "a"]


def test_host_suite_steps_plan_then_run_every_layer():
    """The *_step cases: plan() on the next of two page orders, then run() on each layer's
    tensors in order (a stand-in module records the calls); FlashInfer's without POD under
    --no-fi-pod."""
    from benchmarks import host

    log = []

    class Wrapper:
        def __init__(self, *a, **kw):
            self.kind = "pod" if not kw else kw["backend"]

        def plan(self, *a, **kw):
            log.append(("plan", a[2] if self.kind != "pod" else a[1]))

        def run(self, q, *a, **kw):
            log.append(("run", q))

    class Mod:
        BatchPrefillWithPagedKVCacheWrapper = PODWithPagedKVCacheWrapper = Wrapper

    x = {"qo": 0, "kvi": 0, "last": 0, "idx": "i1", "idx2": "i2",
         "layers": [dict(q=f"q{i}", q1=f"p{i}", k1=0, v1=0, qd=0, cache=0) for i in range(3)]}
    steps = host._steps(Mod, x, "cpu", "flashinfer")
    assert set(steps) == {"paged_step", "pod_step"}
    for case in ("paged_step", "pod_step"):
        log.clear()
        steps[case]()
        steps[case]()
        q = "q" if case == "paged_step" else "p"
        assert log == [("plan", "i1"), *[("run", f"{q}{i}") for i in range(3)],
                       ("plan", "i2"), *[("run", f"{q}{i}") for i in range(3)]]
    assert set(host._steps(Mod, x, "cpu", "flashinfer", pod=False)) == {"paged_step"}
    assert {"paged_step", "pod_step"} <= host.PLAN_CASES


def test_host_suite_chunk_steps_grow_the_prefill_beside_the_decodes(monkeypatch):
    """The chunk_step / mixed_step cases: each step the decode_step case's decodes and one
    prompt's prefill chunk of CHUNK rows whose keys grow by CHUNK; POD plans the decodes and
    runs the chunk on the first kv keys of each layer's k / v, the paged wrapper plans the
    chunk's request (its own pages, after the decodes' pool) then the decodes."""
    import torch

    from benchmarks import host

    steps, n_pages = host._chunk_tables("cpu", requests=5, steps=40)
    dec, _ = host._decode_tables("cpu", requests=5, steps=40)
    pool = set()
    for s, (st, (kvi, idx, last)) in enumerate(zip(steps, dec)):
        assert st["kv"] == host.CHUNK * (s + 1)
        assert all(torch.equal(a, b) for a, b in zip(st["dec"], (kvi, idx, last)))
        qo, m_kvi, m_idx, m_last = st["mixed"]
        own = -(-st["kv"] // host.PAGE)
        assert qo.tolist() == [0, host.CHUNK] + [host.CHUNK + i + 1 for i in range(5)]
        assert m_kvi.tolist() == [0] + (kvi + own).tolist()
        assert torch.equal(m_idx[own:], idx) and torch.equal(m_last[1:], last)
        assert (own - 1) * host.PAGE + int(m_last[0]) == st["kv"]
        qo_p, kvi_p, idx_p, last_p, qo_d, *decodes = st["batch"]
        assert qo_p.tolist() == [0, host.CHUNK] and kvi_p.tolist() == [0, own]
        assert torch.equal(idx_p, m_idx[:own]) and torch.equal(last_p, m_last[:1])
        assert qo_d.tolist() == list(range(6))
        assert all(torch.equal(a, b) for a, b in zip(decodes, (kvi, idx, last), strict=True))
        pre = m_idx[:own].tolist()
        assert int(idx.max()) < min(pre) and max(pre) < n_pages and len(set(pre)) == own
        pool.update(pre)
    assert len(pool) == -(-host.CHUNK * 40 // host.PAGE)
    assert {"chunk_step", "mixed_step"} <= host.PLAN_CASES

    log = []

    class Wrapper:
        def __init__(self, *a, **kw):
            self.kind = "pod" if not kw else kw["backend"]

        def plan(self, *a, **kw):
            log.append(("plan", a[:3] if self.kind == "pod" else a[:4]))

        def run(self, q, *a, **kw):
            log.append(("run", q, a[0].shape[0] if self.kind == "pod" else None))

    class BatchPOD(Wrapper):
        def plan(self, *a, **kw):
            log.append(("plan", a[:8]))

        def run(self, q, cache, qd, *a, **kw):
            log.append(("run", q, None))
            assert cache is a[0] and qd.shape[0] == 5

    class Mod:
        BatchPrefillWithPagedKVCacheWrapper = PODWithPagedKVCacheWrapper = Wrapper
        BatchPODWithPagedKVCacheWrapper = BatchPOD

    for name, value in (("HQ", 2), ("HKV", 1), ("D", 4)):  # (small layers' tensors)
        monkeypatch.setattr(host, name, value)
    calls = host._chunk_steps(Mod, "cpu", "flashinfer", requests=5, steps=40, batch_pod=True)
    assert set(calls) == {"chunk_step", "mixed_step", "batch_pod_step"}
    assert "batch_pod_step" in host.PLAN_CASES
    for case, key in (("chunk_step", "dec"), ("mixed_step", "mixed"),
                      ("batch_pod_step", "batch")):
        for s in range(3):
            log.clear()
            calls[case]()
            (_, planned), *runs = log
            assert all(torch.equal(a, b) for a, b in zip(planned, steps[s][key]))
            assert len(runs) == host.LAYERS and len({id(r[1]) for r in runs}) == host.LAYERS
            kv = steps[s]["kv"] if case == "chunk_step" else None
            assert all(r[2] == kv for r in runs)
    assert set(host._chunk_steps(Mod, "cpu", "flashinfer", pod=False, requests=5,
                                 steps=4)) == {"mixed_step"}


def test_host_suite_cut_step_plans_cut_decodes(monkeypatch):
    """The cut_step case: chunk_step on CUT_REQ decodes of CUT_KV0 + keys, whose POD plan for a
    Hopper GPU holds decode key chunks; its re-plans over the steps keep their calls but where a
    request's new page changes the chunk layout (one new memo in the first 12 steps)."""
    import torch

    import compiled_attn as ca
    from benchmarks import host
    from compiled_attn.ops import choose

    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    steps, _ = host._chunk_tables("cpu", host.CUT_REQ, 12, host.CUT_KV0)
    w = ca.PODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    memos = []
    for st in steps:
        kvi, idx, last = st["dec"]
        assert kvi.numel() == host.CUT_REQ + 1
        w.plan(kvi, idx, last, host.HQ, host.HKV, host.D, host.PAGE, q_data_type=host.DT,
               kv_data_type=host.DT)
        assert w._plan["chunks"] is not None
        memos.append(w._memo)
    assert len({id(m) for m in memos}) == 2, memos
    assert "cut_step" in host.PLAN_CASES
    made = []
    monkeypatch.setattr(host, "_chunk_steps", lambda *a, **kw: made.append(kw) or {
        "chunk_step": "call"})
    assert host._cut_step(ca, "cpu", "compiled_attn") == "call"
    assert made == [dict(requests=host.CUT_REQ, kv0=host.CUT_KV0)]


def test_medians_us_times_each_call_and_raises_a_failure():
    """providers.medians_us (the developer probes' timing through bench): one median per name,
    in microseconds; a call that raises is not given a figure."""
    from benchmarks.providers import medians_us

    calls = []
    med = medians_us({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2,
                     cuda=False)
    assert list(med) == ["a", "b"] and all(v > 0 for v in med.values())
    assert {"a", "b"} <= set(calls)

    def fails():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError, match="no"):
        medians_us({"ok": lambda: None, "bad": fails}, rounds=1, cuda=False)


def test_pod_only_picks_whole_names_then_substrings_in_order():
    """--only: each comma-separated item picks the case of that whole name, else the cases
    whose name contains it; items keep their order and a case is taken once."""
    from benchmarks import pod

    cases = pod.case_list()
    p1 = "pod p2048 d128x4096 g32/8 page1"
    got = [c.name for c in pod.pick(cases, f"{p1},batch_pod p2048+1024+512+512 d16,{p1}")]
    assert got == [p1] + [f"batch_pod p2048+1024+512+512 d16x4096 g{g} page{pg}"
                          for g in ("32/8", "64/8") for pg in (16, 1)]
    assert [c.name for c in pod.pick(cases, "page1")] == [c.name for c in cases
                                                          if "page1" in c.name]
    assert pod.pick(cases, "no such case") == []


def test_pod_uncaptured_marks_graphs_that_recorded_nothing():
    """A POD replay under half of its longer part replayed alone is a capture that recorded
    no kernel: marked failed; plausible ones stay, and so does a replay far under a
    host-bound eager call (checked_graph judges those)."""
    from benchmarks import pod

    res = {("fi_pod", "eager"): 51.4, ("fi_pod", "graph"): 10.3, ("fi_prefill", "graph"): 11.4,
           ("fi_decode", "graph"): 34.2, ("ours_pod", "eager"): 56.4, ("ours_pod", "graph"): 28.9,
           ("ours_prefill", "eager"): 67.4, ("ours_prefill", "graph"): 11.7,
           ("ours_decode", "graph"): 25.9, ("fi_apart", "eager"): 600.0,
           ("fi_apart", "graph"): 100.0}
    out = pod.uncaptured(res, pod.PROVIDERS)
    assert out["fi_pod", "graph"].startswith("failed:") and "34.2 us" in out["fi_pod", "graph"]
    assert out["ours_pod", "graph"] == 28.9 and res["fi_pod", "graph"] == 10.3
    assert out["ours_prefill", "graph"] == 11.7 and out["fi_apart", "graph"] == 100.0


def test_pod_checked_graph_fails_a_replay_that_skips_work(monkeypatch):
    """checked_graph poisons the captured call's outputs and replays once: a replay that
    rewrites them with the eager call's values on the current inputs passes; one that leaves
    any of them, or rewrites them from values kept since the capture (seen once the inputs are
    perturbed), fails instead of being timed."""
    import torch

    from benchmarks import pod

    class Graph:  # a stand-in for capture(): its replay rewrites the captured call's outputs
        def __init__(self, fn):
            fn()
            out = list(held)
            self.replay = lambda: replay_parts(out)

    held = []
    x = torch.randn(5, 3)

    def call():
        out = (x * 2, x + 1)
        held[:] = [out]
        return out

    monkeypatch.setattr(pod, "capture", lambda fn: Graph(fn))

    def full(h):
        h[0][0].copy_(x * 2)
        h[0][1].copy_(x + 1)

    replay_parts = full
    assert callable(pod.checked_graph(call))
    assert callable(pod.checked_graph(call, perturb=lambda: x.add_(1)))

    def partial(h):  # the second output not rewritten: it keeps the poison
        h[0][0].copy_(x * 2)

    replay_parts = partial
    with pytest.raises(RuntimeError, match="did not record all of the call's work"):
        pod.checked_graph(call)

    def stale(h):  # the outputs rewritten from values kept since the capture
        h[0][0].copy_(kept[0])
        h[0][1].copy_(kept[1])

    kept = call()
    kept = [t.clone() for t in kept]
    replay_parts = stale
    assert callable(pod.checked_graph(call))  # inputs unchanged: indistinguishable
    with pytest.raises(RuntimeError, match="on the same inputs by"):
        pod.checked_graph(call, perturb=lambda: x.mul_(3))


def test_pod_suite_compares_pod_with_its_parts_on_the_same_inputs(monkeypatch):
    """The graph checks perturb the queries; POD's difference from its parts is taken after
    them, so the check after the timed calls compares on the same inputs (a deterministic
    row stays ok)."""
    checks = {"n": 0}

    def checked(fn, perturb=None):  # each graph check perturbs the inputs
        checks["n"] += 1
        return fn

    by = _stub_run_case(monkeypatch, lambda calls, ref="parts": 0.5 + checks["n"], checked)
    assert checks["n"] > 0
    assert by["ours_pod", "eager"]["status"] == "ok"


def test_host_suite_decode_tables_grow_a_step_at_a_time():
    """The decode_step case's page tables: each step one more key a request, a new page of the
    pool where the last page was full, no page owned twice, every index inside the pool."""
    from benchmarks import host

    tables, n_pages = host._decode_tables("cpu", requests=5, steps=40)
    prev = None
    for kvi, idx, last in tables:
        pages = (kvi[1:] - kvi[:-1]).tolist()
        lens = [(n - 1) * host.PAGE + int(x) for n, x in zip(pages, last)]
        assert len(set(idx.tolist())) == idx.numel() and 0 <= int(idx.min())
        assert int(idx.max()) < n_pages and all(1 <= int(x) <= host.PAGE for x in last)
        if prev is not None:
            assert lens == [n + 1 for n in prev[0]]
            # a request keeps its pages and appends one only when its last page was full
            for r, n in enumerate(prev[0]):
                old = prev[1][prev[2][r]:prev[2][r + 1]].tolist()
                new = idx[kvi[r]:kvi[r + 1]].tolist()
                assert new[:len(old)] == old and len(new) == len(old) + (n % host.PAGE == 0)
        prev = lens, idx, kvi.tolist()
    assert "decode_step" in host.PLAN_CASES


def test_pod_scoreboard_counts_each_target_on_the_rows_it_applies_to(tmp_path, capsys):
    """benchmarks.pod's scoreboard: a row counts toward a target only where its case and mode
    hold what the target reads (FlashInfer's ratio eager only; the 1.05x target where the
    smaller part alone is a tenth of the larger; a failed provider leaves its row out), and
    --score prints the counts (with -v the rows missing each)."""
    import json

    from benchmarks import pod

    def row(case, mode, prov, **kw):
        return dict(case=case, mode=mode, provider=prov, status="ok", **kw)

    rows = [
        # a balanced case: every target applies; misses fi, apart, bound; meets the rest
        row("a", "eager", "ours_pod", ratio_vs_fi_pod=0.9, ratio_vs_apart=1.02,
            pod_over_bound=1.2),
        row("a", "eager", "ours_prefill", median_us=100.0),
        row("a", "eager", "ours_decode", median_us=50.0, decode_over_copy=0.96),
        # graph: no FlashInfer ratio counted; a lopsided case (the 1.05x target left out)
        row("a", "graph", "ours_pod", ratio_vs_fi_pod=2.0, ratio_vs_apart=0.97,
            pod_over_bound=0.9),
        row("a", "graph", "ours_prefill", median_us=100.0),
        row("a", "graph", "ours_decode", median_us=5.0, decode_over_copy=0.5),
        # a failed POD row counts nowhere; a failed decode row leaves copy and apart out
        row("b", "eager", "ours_pod", ratio_vs_apart=1.5),
        row("b", "eager", "ours_prefill", median_us=10.0),
        dict(row("b", "eager", "ours_decode", decode_over_copy=0.99), status="failed"),
        dict(row("c", "eager", "ours_pod", ratio_vs_fi_pod=3.0), status="failed"),
    ]
    board = pod.scoreboard(rows)
    assert board == {
        "fi": (0, 1, [("a", "eager", 0.9)]),
        "apart": (0, 1, [("a", "eager", 1.02)]),
        "apart_floor": (2, 3, [("a", "graph", 0.97)]),
        "bound": (1, 2, [("a", "eager", 1.2)]),
        "copy": (1, 2, [("a", "graph", 0.5)]),
    }
    path = tmp_path / "pod.json"
    path.write_text(json.dumps({"rows": rows}))
    pod.main(["--score", str(path), "-v"])
    out = capsys.readouterr().out
    assert "apart_floor     2 / 3" in out and "    a [graph] 0.97" in out
    with pytest.raises(SystemExit):
        pod.main([])  # (--out or --score)


def test_swap_ab_swaps_a_base_trees_functions_in_and_out(tmp_path):
    """dev.swap_ab's core: a base tree's function and method, compiled into the live module
    (its globals), replace the working tree's and are put back; a method only the base has is
    added, then removed; --patch rewrites the base text first; a name neither tree has raises."""
    import torch

    from compiled_attn.ops import launch
    from dev import swap_ab

    text = pathlib.Path(launch.__file__).read_text()
    body = '    return device.type == "cuda" or (INTERPRET and device.type == "cpu")'
    assert body in text and "    def known_unbound(self, key) -> bool:" in text
    anchor = "    def known_unbound(self, key) -> bool:"
    text = text.replace(body, '    return ("base", INTERPRET)').replace(
        anchor, "    def only_in_base(self):\n        return 7\n\n" + anchor)
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "launch.py").write_text(text)
    live = launch.kernel_device
    cpu = torch.device("cpu")
    swaps = [swap_ab.Swap("ops/launch.py:kernel_device", tmp_path, []),
             swap_ab.Swap("ops/launch.py:Memo.only_in_base", tmp_path, [])]
    try:
        swap_ab.use(swaps, "base")
        assert launch.kernel_device(cpu) == ("base", launch.INTERPRET)
        assert launch.Memo().only_in_base() == 7
    finally:
        swap_ab.use(swaps, "new")
    assert launch.kernel_device is live and not hasattr(launch.Memo, "only_in_base")
    patched = swap_ab.Swap("ops/launch.py:kernel_device", tmp_path, [('"base"', '"patched"')])
    try:
        patched.use("base")
        assert launch.kernel_device(cpu)[0] == "patched"
    finally:
        patched.use("new")
    with pytest.raises(ValueError, match="neither tree"):
        swap_ab.Swap("ops/launch.py:no_such_function", tmp_path, [])
