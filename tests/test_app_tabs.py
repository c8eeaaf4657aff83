"""The Benchmark and Batch spot-check tabs, in process on the tiny test model.

The tab functions are called as the page calls them: real backends, real timings, real files. The
numbers shown are checked against the files written (results.json, the JSON download).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import gradio as gr
import pytest

from app import Loaded, build_app
from backends import APPROXIMATE, BACKEND_NAMES
from conftest import DEV_TSV
from service.reports import load_latest
from ui import benchmark_tab, spotcheck_tab

FP32 = [n for n in BACKEND_NAMES if n != "pytorch" and n not in APPROXIMATE]
MAX_NEW = 6  # the tiny random model rarely stops by itself: a small cap keeps every run short


def dev_rows(count: int) -> list[str]:
    """The header and the first `count` rows of dev.tsv, as a user copies them."""
    lines = DEV_TSV.read_text(encoding="utf-8").splitlines()
    return lines[: count + 1]


def loaded_app(backends, results_dir: Path, errors: dict | None = None) -> Loaded:
    return Loaded(backends, errors or {}, model="tiny", export_note="in-process", max_new_tokens=MAX_NEW,
                  results_dir=results_dir)


def cell_float(cell: str) -> float:
    return float(cell.replace(",", ""))


def ms(x: float) -> str:
    """Milliseconds as the tabs show them: one decimal below 100, none above."""
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


class Recorder(gr.Progress):
    """What the page passes: a gr.Progress, which is falsy (len 0) until it tracks an iterable."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[float, str]] = []

    def __call__(self, progress, desc=None, *args, **kwargs):
        self.calls.append((progress, desc))


# --- Batch spot-check ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spot(tiny_backends, tmp_path_factory):
    progress = Recorder()
    loaded = loaded_app(tiny_backends, tmp_path_factory.mktemp("results"))
    text = "\n".join(dev_rows(4)) + "\n\n"  # a trailing blank line, as pasting often leaves
    view = spotcheck_tab.run(loaded, text, None, progress=progress)
    return view, progress.calls


def test_spot_check_shows_real_numbers_per_backend(spot, tiny_backends):
    view, calls = spot
    assert view.result is not None, view.status
    assert [row[0] for row in view.summary] == list(tiny_backends)
    h = spotcheck_tab.headers("pytorch")
    for row in view.summary:
        cells = dict(zip(h, row))
        p50, p90, p99 = (cell_float(cells[k]) for k in ("p50 ms", "p90 ms", "p99 ms"))
        assert 0 < p50 <= p90 <= p99
        assert 0 <= cell_float(cells["BLEU vs refs (Δ)"].split()[0]) <= 100
        assert 0 <= cell_float(cells["chrF vs refs (Δ)"].split()[0]) <= 100
    by_name = {row[0]: dict(zip(h, row)) for row in view.summary}
    assert by_name["pytorch"]["identical tokens"] == "4/4 (100%)"
    assert by_name["pytorch"]["BLEU vs refs (Δ)"].endswith(" (+0.00)")
    for name in FP32:  # fp32 graphs reproduce PyTorch exactly, so they agree fully and score the same
        assert by_name[name]["identical tokens"] == "4/4 (100%)"
        assert by_name[name]["first divergence: step (sentences)"] == "none"
        assert by_name[name]["BLEU vs pytorch"] == "100.00"
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and len(calls) == 5 * (4 + 1)
    assert "4 sentences" in view.status and "References given" in view.status


def test_spot_check_download_matches_what_is_shown(spot):
    view, _ = spot
    data = json.loads(Path(view.json_path).read_text(encoding="utf-8"))
    assert data["kind"] == "spot_check" and data["reference"] == "pytorch"
    assert data["sentences"] == [line.split("\t")[1] for line in dev_rows(4)[1:]]
    assert data["references"] == [line.split("\t")[2] for line in dev_rows(4)[1:]]
    h = spotcheck_tab.headers("pytorch")
    for row in view.summary:
        cells, b = dict(zip(h, row)), data["backends"][row[0]]
        assert cells["p50 ms"] == ms(b["latency_ms"]["p50"]) and cells["p99 ms"] == ms(b["latency_ms"]["p99"])
        q = b["vs_references"]
        assert cells["BLEU vs refs (Δ)"] == f"{q['bleu']:,.2f} ({q['bleu_delta']:+.2f})"
        assert cells["chrF vs refs (Δ)"] == f"{q['chrf']:,.2f} ({q['chrf_delta']:+.2f})"
        assert cells["identical tokens"].startswith(f"{b['agreement']['identical']}/{b['agreement']['n']}")
        assert cells["hit length cap"] == b["hit_max_new_tokens"]
        assert len(b["translations"]) == 4 and all(b["translations"])
    shown = [(r[0], r[1], r[2], r[4], r[5]) for r in view.differing]
    in_file = [(name, d["index"] + 1, d["first_divergence"], d["reference_output"], d["output"])
               for name, b in data["backends"].items() for d in b["differing"]]
    assert shown == in_file
    for name, b in data["backends"].items():  # a differing sentence is exactly one whose tokens differ
        steps = b["agreement"]["first_divergence_steps"]
        n_differing = b["agreement"]["n"] - b["agreement"]["identical"]
        assert len(b["differing"]) == sum(s is not None for s in steps) == n_differing


def test_spot_check_without_references_scores_against_pytorch(tiny_backends, tmp_path):
    loaded = loaded_app({n: tiny_backends[n] for n in ("pytorch", "ort_int8")}, tmp_path)
    text = "\n".join(line.split("\t")[1] for line in dev_rows(2)[1:])
    view = spotcheck_tab.run(loaded, text, None)
    assert view.result is not None, view.status
    int8 = dict(zip(spotcheck_tab.headers("pytorch"), view.summary[1]))
    assert int8["BLEU vs refs (Δ)"] == "–" and 0 <= cell_float(int8["BLEU vs pytorch"]) <= 100
    assert "No references" in view.status


def test_spot_check_names_backends_that_failed_to_load(tiny_backends, tmp_path):
    backends = {n: b for n, b in tiny_backends.items() if n != "ort_fp16"}
    loaded = loaded_app(backends, tmp_path, errors={"ort_fp16": "FileNotFoundError: decoder_fp16.onnx"})
    view = spotcheck_tab.run(loaded, "Click OK.", None)
    assert [row[0] for row in view.summary] == list(backends)
    assert "`ort_fp16` not run: failed to load in the app: FileNotFoundError: decoder_fp16.onnx" in view.status
    assert view.result["not_run"] == {"ort_fp16": "failed to load in the app: FileNotFoundError: decoder_fp16.onnx"}


def _file(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


@pytest.mark.parametrize(
    "case, text, file, message",
    [
        ("empty", "", None, "no sentences: paste English sentences"),
        ("blank lines", "  \n\n ", None, "no sentences"),
        ("over the limit", "\n".join(f"Sentence number {i}." for i in range(201)), None,
         "at most 200 sentences per spot-check, got 201"),
        ("too long", "Short one.\n" + "word " * 600, None, "source tokens; too long: sentence 2 ("),
        ("tabs without header", "Hello.\nOne\t一", None, "line(s) 2 hold tabs but the first line is not a header"),
        ("header without en", "english\tchinese\nHello.\t你好", None,
         "pasted text:1: the header has no `en` column (found: english, chinese). A table's first line is its header"),
        ("reference missing", "en\tzh\nHello.\t你好\nBye.\t", None, "pasted text:3: the `zh` field is empty"),
        ("every bad row named", "\nen\tzh\nHello.\t\n\n\tBye.\nGood.\t好\tmore", None,
         "pasted text:3: the `zh` field is empty; pasted text:5: the `en` field is empty; "
         "pasted text:6: expected 2 tab-separated fields (en, zh), got 3"),
        ("unknown column", "en\tnotes\nHello.\tx", None, "pasted text:1: unknown column(s) notes"),
        ("both given", "Hello.", ("a.txt", "Hello."), "both pasted text and a file were given"),
        ("wrong file type", "", ("a.csv", "en,zh\nHello.,你好"), "a.csv: expected one of .txt, .tsv"),
        ("not utf-8", "", ("a.txt", b"caf\xe9\n"), "a.txt is not UTF-8 text"),
        ("tsv without en", "", ("b.tsv", "\nsource\ttext\nx\tHello."), "b.tsv:2: the header has no `en` column"),
        ("table saved as txt", "", ("c.txt", "Hello.\t你好\n"), "c.txt: line 1 holds a tab"),
        ("empty file", "", ("d.txt", "\n\n"), "d.txt is empty"),
    ],
)
def test_spot_check_bad_input_gives_a_clear_message(tiny_backends, tmp_path, case, text, file, message):
    loaded = loaded_app(tiny_backends, tmp_path)
    path = _file(tmp_path, *file) if file else None
    view = spotcheck_tab.run(loaded, text, path)
    assert view.result is None and view.json_path is None and view.summary == []
    assert message in view.status, view.status


def test_spot_check_reads_an_uploaded_tsv_with_references(tiny_backends, tmp_path):
    loaded = loaded_app({n: tiny_backends[n] for n in ("pytorch", "ort_fp32_kv_cache")}, tmp_path)
    path = _file(tmp_path, "dev3.tsv", "\n".join(dev_rows(3)) + "\n")
    view = spotcheck_tab.run(loaded, "", path)
    assert view.result["source"] == "dev3.tsv" and len(view.result["references"]) == 3
    assert view.summary[1][1] == "3/3 (100%)"


# --- Benchmark ---------------------------------------------------------------------------------------


def test_benchmark_without_report_names_the_command(tiny_backends, tmp_path):
    loaded = loaded_app(tiny_backends, tmp_path / "nothing-yet")
    loaded.reference_results = None
    v = benchmark_tab.view(loaded)
    assert "No benchmark report yet" in v.header and "`python -m bench speed`" in v.header
    assert v.table is None and v.choices == [] and v.plots == []


REFERENCE_RESULTS = Path(__file__).resolve().parent.parent / "assets" / "reference-results.json"


def test_a_fresh_start_shows_the_shipped_reference_results(tiny_backends, tmp_path):
    from service.reference import load_reference

    ref = load_reference(REFERENCE_RESULTS)
    demo = build_app(loaded_app(tiny_backends, tmp_path / "nothing-yet"))  # as the page first renders
    by_id = {getattr(b, "elem_id", None): b for b in demo.blocks.values()}
    header, table, more = by_id["bench-header"].value, by_id["bench-table"], by_id["bench-method"].value
    greedy, *others = ref["runs"]
    assert header.startswith("**Reference results, not measured on this host**: Embedded model, greedy, "
                             "2026-12-03 07:56 UTC, on a 2-core AMD EPYC VM")
    assert "No benchmark report yet" in header
    assert "not the model this app serves" in header  # the app serves the tiny model here
    assert table.visible and table.value["headers"] == greedy["columns"]
    assert table.value["data"] == greedy["rows"]
    assert [r[0] for r in greedy["rows"]][:4] == ["pytorch", "ort_fp32_kv_cache", "ort_fp16", "ort_int8"]
    for run in others:  # beam 4 and load: below, each marked too
        assert f"#### {run['title']}: reference, not measured on this host" in more
        assert "| " + " | ".join(run["rows"][-1]) + " |" in more


def docs_table(heading: str) -> list[list[str]]:
    """The rows of the first table after `heading` in docs/benchmarks.md, as the reference file splits them."""
    doc = (REFERENCE_RESULTS.parent.parent / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    lines = doc[doc.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| run"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if heading != "## Load":  # "`name` (precision)" -> name, precision
            name, _, precision = cells[0].partition(" ")
            cells = [name.strip("`"), precision.removeprefix("(").removesuffix(")"), *cells[1:]]
        rows.append(cells)
    return rows


def test_the_reference_results_are_the_docs_figures():
    from service.reference import load_reference

    runs = load_reference(REFERENCE_RESULTS)["runs"]
    assert [r["rows"] for r in runs] == [
        docs_table("### Embedded model, greedy"), docs_table("### Embedded model, beam 4"), docs_table("## Load")]


def test_malformed_reference_results_are_named_not_shown(tiny_backends, tmp_path):
    bad = tmp_path / "reference.json"
    bad.write_text('{"what": "x", "runs": [{"title": "t", "columns": ["a", "b"], "rows": [["1"]]}]}')
    loaded = loaded_app(tiny_backends, tmp_path / "nothing-yet")
    loaded.reference_results = bad
    v = benchmark_tab.view(loaded)
    assert v.table is None and "No benchmark report yet" in v.header
    assert "malformed reference results: no 'model'" in v.header and "run 1, row 1: 1 cells for 2 columns" in v.header


@pytest.fixture(scope="module")
def quick(tiny_backends, tmp_path_factory):
    results_dir = tmp_path_factory.mktemp("bench-results")
    backends = {n: b for n, b in tiny_backends.items() if n != "ort_int8"}
    loaded = loaded_app(backends, results_dir, errors={"ort_int8": "RuntimeError: no int8 graphs"})
    progress = Recorder()
    status, view = benchmark_tab.run_quick(loaded, 2.0, progress=progress)
    return loaded, status, view, progress.calls


def test_quick_benchmark_shows_and_saves_real_numbers(quick):
    loaded, status, view, calls = quick
    assert status.startswith("Done: 4 backends over 2 sentences")
    saved = json.loads(Path(view.selected).read_text(encoding="utf-8"))
    folder = Path(view.selected).parent
    assert folder.parent == loaded.results_dir and folder.name.startswith("quick-")
    assert (folder / "report.md").is_file() and view.plots == [str(folder / "speed.png")]
    assert load_latest(loaded.results_dir)["path"] == view.selected  # the newest report is this run
    assert saved["quick"] is True and saved["sentences"]["count"] == 2 and saved["options"]["max_new_tokens"] == MAX_NEW
    assert saved["not_run"] == {"ort_int8": "failed to load in the app: RuntimeError: no int8 graphs"}
    table = view.table
    assert list(table["runtime"]) == list(loaded.backends)
    assert "load s" not in table.columns and "peak RSS MB" not in table.columns  # not measured in process
    for _, row in table.iterrows():
        r = saved["runtimes"][row["runtime"]]
        assert cell_float(row["batch-1 p50 ms"]) > 0
        assert row["batch-1 p50 ms"] == f"{r['latency']['p50']:,.1f}" and row["p99 ms"] == f"{r['latency']['p99']:,.1f}"
        assert row["batch 2 sent/s"] == f"{r['throughput']['2']['sentences_per_s']:,.2f}"
        assert row["p50 vs pytorch"] == f"{r['comparison']['latency_p50_ratio']:.2f}×"
    for name in FP32:
        assert table.set_index("runtime").loc[name, "identical to pytorch"] == "100%"
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[0] == 0 and fractions[-1] == 1.0 and len(calls) > 4


def test_quick_benchmark_says_where_it_came_from_and_what_it_measures(quick):
    loaded, _, view, _ = quick
    saved = json.loads(Path(view.selected).read_text(encoding="utf-8"))
    e = saved["environment"]
    assert "Quick run from this app" in view.header and Path(view.selected).parent.name in view.header
    assert e["date_utc"] in view.header and f"onnxruntime {e['versions']['onnxruntime']}" in view.header
    assert "Not the model this app serves" not in view.header
    assert "2 from the start of `python -m bench speed`'s 200-sentence sample" in view.header
    assert "all backends share the app's process" in view.method and "Not measured:" in view.method
    assert "`ort_int8` not run: failed to load in the app" in view.notes
    assert "![" not in view.markdown and "| `ort_fp32_kv_cache` |" in view.markdown


def test_benchmark_prefers_the_app_models_report_and_says_so(quick, tmp_path):
    loaded, _, view, _ = quick
    results_dir = tmp_path / "results"
    ours = results_dir / "ours"
    shutil.copytree(Path(view.selected).parent, ours)
    time.sleep(0.05)  # the other report is strictly newer
    other = results_dir / "other"
    shutil.copytree(ours, other)
    data = json.loads((other / "results.json").read_text(encoding="utf-8"))
    data["model"]["export"] = "/elsewhere/opus-mt-other"
    (other / "results.json").write_text(json.dumps(data), encoding="utf-8")
    loaded = loaded_app(loaded.backends, results_dir)
    v = benchmark_tab.view(loaded)
    assert v.selected == str(ours / "results.json") and [c[1] for c in v.choices][0] == str(other / "results.json")
    assert "A newer report exists for another model" in v.header and "opus-mt-other" in v.header
    picked = benchmark_tab.view(loaded, str(other / "results.json"))
    assert "Not the model this app serves" in picked.header


def test_the_report_header_names_the_search_the_run_used(quick, tmp_path):
    """A quick run decodes greedily; a full run may use beams (`bench speed --num-beams`), and its
    header says so rather than "greedy"."""
    loaded, _, view, _ = quick
    assert "; greedy." in view.header
    beam = tmp_path / "results" / "beam"
    shutil.copytree(Path(view.selected).parent, beam)
    data = json.loads((beam / "results.json").read_text(encoding="utf-8"))
    data["decoding"] = {"search": "beam", "num_beams": 4, "label": "beam 4"}
    (beam / "results.json").write_text(json.dumps(data), encoding="utf-8")
    v = benchmark_tab.view(loaded_app(loaded.backends, tmp_path / "results"))
    assert "; beam 4." in v.header and "greedy" not in v.header


@pytest.mark.parametrize("count", [0, 21, 2.5, None, "3", True])
def test_quick_benchmark_count_is_validated(tiny_backends, tmp_path, count):
    loaded = loaded_app(tiny_backends, tmp_path)
    with pytest.raises(ValueError, match="a whole number from 1 to 20"):
        benchmark_tab.run_quick(loaded, count)
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing saved


# --- the page ------------------------------------------------------------------------------------------


def test_app_has_the_tabs_and_their_runs_share_the_model_slot(tiny_backends, tmp_path):
    demo = build_app(loaded_app(tiny_backends, tmp_path))
    labels = [b.label for b in demo.blocks.values() if type(b).__name__ == "Tab"]
    assert labels == ["Compare", "Benchmark", "Batch spot-check", "Translate"]
    model_fns = {f.name for f in demo.fns.values() if f.concurrency_id == "model"}
    assert {"translate_ui", "run", "on_run"} <= model_fns  # the compare, quick-run and spot-check events
    for f in demo.fns.values():
        if f.concurrency_id == "model":
            assert f.concurrency_limit == 1
    public = [f.api_name for f in demo.fns.values() if f.api_visibility == "public"]
    assert public == ["compare", "translate"]  # the other tabs add no API endpoint
    # translate: called concurrently, in a slot of its own, page and API alike; its batcher forms the
    # batches, not Gradio's batch=True
    batched = [f for f in demo.fns.values() if f.concurrency_id == "translate"]
    assert {f.name for f in batched} == {"translate_page", "translate_api"} and len(batched) == 3  # click, submit, API
    assert all(not f.batch and f.concurrency_limit == 32 for f in batched)


@pytest.mark.parametrize("value", ["-1", "20000", "nan"])
def test_app_refuses_a_batch_wait_it_cannot_use(value, capsys):
    import app

    with pytest.raises(SystemExit) as e:
        app.main(["--batch-wait-ms", value])
    assert e.value.code == 2
    assert "batch wait must be a number of milliseconds from 0 to 10000" in capsys.readouterr().err


def test_app_defaults_let_sixteen_to_sixty_four_users_wait_and_batch_after_100_ms():
    import app

    assert app.QUEUE_SIZE == 64
    assert Loaded({}).batching.max_wait_ms == 100.0 and Loaded({}).batching.max_requests == 32


@pytest.mark.parametrize(
    "start, end, warned",
    [(0.4, 1.9, False), (1.5, 2.0, False), (0.3, 2.2, True), (7.1, 3.0, True), (None, None, False)],
)
def test_timings_from_a_busy_machine_carry_a_warning(start, end, warned):
    from ui.machine import load_warning

    env = {"logical_cores": 2, "load_average_1m_at_start": start, "load_average_1m_at_end": end}
    text = load_warning(env)
    assert bool(text) == warned
    if warned:
        assert f"reached {max(start, end):.1f} on 2 cores" in text


def test_the_header_names_the_models_family_and_languages(tiny_backends, tmp_path):
    """The page title and header say which model family translates which languages (the sidecar's,
    for Marian its tokenizer's single pair), not a fixed "MarianMT en→zh"."""
    from ui.state import model_heading

    loaded = loaded_app(tiny_backends, tmp_path)
    heading = model_heading(loaded.manifest)
    assert heading == "Marian en→zh"
    demo = build_app(loaded)
    header = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "header")
    assert demo.title == "Marian en→zh: PyTorch vs ONNX Runtime"
    assert header.value.startswith("## Marian en→zh · PyTorch vs ONNX Runtime") and "MarianMT" not in header.value
    # nothing loaded: the export folder's sidecar still names the model
    assert model_heading(Loaded({}, {"pytorch": "x"}, export_dir=tiny_backends["pytorch"].manifest.root).manifest) == heading
    assert model_heading(Loaded({}, {"pytorch": "x"}).manifest) == "Model"


def test_external_backends_get_panels_after_the_built_in_ones():
    """--external NAME=DIR backends (and one that failed to load) are listed, so each gets a panel."""
    from ui.state import Loaded

    loaded = Loaded(backends={"optimum_mine": object(), "pytorch": object(), "ort_int8": object()},
                    load_errors={"broken_export": "ExternalExportError: vocab_size differs"})
    assert loaded.names == ["pytorch", "ort_int8", "optimum_mine", "broken_export"]
