"""The Benchmark, Batch spot-check and Translate tabs in a real browser (Debian's Chromium, headless).

The app is built in process on the tiny test model, with its reports in a temporary folder (so a
test never replaces the repository's newest report). Each tab is opened, a 2-sentence run is made,
the numbers on the page are checked against the files the run wrote, and a screenshot is saved to
test-artifacts/.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import gradio as gr
import pytest
from playwright.sync_api import sync_playwright

from app import CSS, Loaded, build_app
from conftest import DEV_TSV, REPO

CHROMIUM = Path("/usr/bin/chromium")
TIMEOUT_MS = 120_000

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium fonts-noto-cjk)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-results")


@pytest.fixture(scope="module")
def page(tiny_backends, results_dir):
    loaded = Loaded(tiny_backends, {}, model="tiny", export_note="in-process", max_new_tokens=6,
                    results_dir=results_dir)
    demo = build_app(loaded)
    demo.queue(max_size=4, default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, css=CSS,
                theme=gr.themes.Soft())
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(f"http://127.0.0.1:{port}/", wait_until="networkidle")
            yield page
            browser.close()
    finally:
        demo.close()


# A progress bar's text (gr.Progress: "description - 40.0%") in any output's status tracker. Only the
# benchmark run is watched: the spot-check of 2 sentences on the tiny model can end between two updates.
# Every text a progress tracker shows, recorded as it changes: a backend's phase can be over before a
# poll would see it (the tiny export's backends take a few milliseconds each).
RECORD_PROGRESS = """() => {
    window.__progress = [];
    new MutationObserver(() => {
        for (const e of document.querySelectorAll('[data-testid=status-tracker]')) {
            if (e.innerText.includes('%')) window.__progress.push(e.innerText);
        }
    }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def table_rows(page, elem_id: str) -> list[list[str]]:
    """The cells of a gr.Dataframe as the page shows them (its rendered rows), header excluded."""
    return page.evaluate(
        """(id) => [...document.querySelectorAll(`#${id} .virtual-row`)].map(
               row => [...row.querySelectorAll('[role=gridcell]')].map(cell => cell.innerText.trim()))""",
        elem_id,
    )


def table_headers(page, elem_id: str) -> list[str]:
    return page.evaluate(
        "(id) => [...document.querySelectorAll(`#${id} th[role=columnheader]`)].map(th => th.title)", elem_id
    )


def test_benchmark_tab_runs_two_sentences_and_shows_the_saved_report(page, results_dir, artifacts_dir):
    page.get_by_role("tab", name="Benchmark").click()
    page.locator("#bench-header").get_by_text("No benchmark report yet").wait_for()
    assert "python -m bench speed" in page.locator("#bench-header").inner_text()
    # a fresh start: the shipped reference results, marked as measured elsewhere
    reference = json.loads((REPO / "assets" / "reference-results.json").read_text(encoding="utf-8"))
    greedy = reference["runs"][0]
    page.locator("#bench-header").get_by_text("Reference results, not measured on this host").wait_for()
    assert table_headers(page, "bench-table") == greedy["columns"]
    assert table_rows(page, "bench-table") == greedy["rows"]
    for run in reference["runs"][1:]:
        page.locator("#bench-method").get_by_text(f"{run['title']}: reference, not measured on this host").wait_for()
    # and the shipped load curve, plotted, marked as measured elsewhere
    page.locator("#load-curve-header").get_by_text("reference, not measured on this host").wait_for()
    for plot in ("#load-curve-throughput", "#load-curve-p99"):
        page.locator(f"{plot} canvas, {plot} svg").first.wait_for()
    page.wait_for_timeout(500)
    page.screenshot(path=str(artifacts_dir / "test-tab-benchmark-reference.png"), full_page=True)

    page.locator("#bench-count input").fill("25")
    page.locator("#bench-run").click()
    page.locator("#bench-status").get_by_text("whole number from 1 to 20").wait_for()

    page.locator("#bench-count input").fill("2")
    page.evaluate(RECORD_PROGRESS)
    page.locator("#bench-run").click()
    page.locator("#bench-status").get_by_text("Done:").wait_for(timeout=TIMEOUT_MS)
    shown = page.evaluate("() => window.__progress")
    assert any("/5)" in text for text in shown), shown[-5:]  # the bar named the backend running
    [saved] = list(results_dir.glob("quick-*/results.json"))
    results = json.loads(saved.read_text(encoding="utf-8"))

    page.locator("#bench-header").get_by_text("Quick run from this app").wait_for()
    heads = table_headers(page, "bench-table")
    rows = {r[0]: dict(zip(heads, r)) for r in table_rows(page, "bench-table")}
    assert list(rows) == list(results["runtimes"])
    for name, r in results["runtimes"].items():
        assert rows[name]["batch-1 p50 ms"] == f"{r['latency']['p50']:,.1f}"
        assert float(rows[name]["batch-1 p50 ms"].replace(",", "")) > 0
    page.locator("#bench-plot-speed img").wait_for()
    assert saved.parent.name in page.locator("#bench-header").inner_text()

    page.wait_for_timeout(500)  # let the gallery finish fading in
    shot = artifacts_dir / "test-tab-benchmark.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 30_000


def test_benchmark_tab_plots_this_hosts_load_curve(page, results_dir, artifacts_dir):
    points = [{"backend": b, "users": u, "sentences_per_s": rate * u / (1 + u / 8), "p50_ms": 100.0 + 20 * u,
               "p95_ms": 120.0 + 30 * u, "p99_ms": 130.0 + 40 * u, "ok": 10 * u, "busy": 0, "errors": 0}
              for b, rate in (("ort_fp32_kv_cache", 10.0), ("ort_int8", 14.0)) for u in (1, 4, 16)]
    (results_dir / "load-curve-test").mkdir()
    (results_dir / "load-curve-test" / "curve.json").write_text(json.dumps(
        {"kind": "load_curve", "date_utc": "2026-12-05 08:00", "method": "closed loop (test)", "points": points}))
    page.get_by_role("tab", name="Translate").click()
    page.get_by_role("tab", name="Benchmark").click()  # opening the tab reads the newest curve
    page.locator("#load-curve-header").get_by_text("measured on this host").wait_for()
    assert "0 busy, 0 errors" in page.locator("#load-curve-header").inner_text()
    for plot in ("#load-curve-throughput", "#load-curve-p99"):
        page.locator(f"{plot} canvas, {plot} svg").first.wait_for()
    page.locator("#load-curve-p99").get_by_text("ort_int8").first.wait_for()  # the legend names each backend
    page.locator("#load-curve-p99").scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(artifacts_dir / "test-tab-benchmark-load-curve.png"), full_page=True)


def test_spotcheck_tab_runs_two_sentences_and_downloads_the_report(page, artifacts_dir, tmp_path):
    page.get_by_role("tab", name="Batch spot-check").click()
    page.locator("#spot-run").click()  # nothing given yet
    page.locator("#spot-status").get_by_text("no sentences").wait_for()

    rows = DEV_TSV.read_text(encoding="utf-8").splitlines()[:3]  # header + 2 sentences
    page.locator("#spot-text textarea").fill("\n".join(rows))
    page.locator("#spot-run").click()
    page.locator("#spot-status").get_by_text("2 sentences").wait_for(timeout=TIMEOUT_MS)

    heads = table_headers(page, "spot-summary")
    shown = {r[0]: dict(zip(heads, r)) for r in table_rows(page, "spot-summary")}
    with page.expect_download() as info:
        page.locator("#spot-download").click()
    path = tmp_path / "spot-check.json"
    info.value.save_as(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert list(shown) == list(data["backends"])
    for name, b in data["backends"].items():
        p50 = b["latency_ms"]["p50"]
        assert shown[name]["p50 ms"] == (f"{p50:,.1f}" if p50 < 100 else f"{p50:,.0f}") and p50 > 0
        q = b["vs_references"]
        assert shown[name]["BLEU vs refs (Δ)"] == f"{q['bleu']:,.2f} ({q['bleu_delta']:+.2f})"
        assert shown[name]["identical tokens"].startswith(f"{b['agreement']['identical']}/2")
    differing = [(name, str(d["index"] + 1), d["output"])
                 for name, b in data["backends"].items() for d in b["differing"]]
    assert [(r[0], r[1], r[5]) for r in table_rows(page, "spot-differing") if r and r[0]] == differing

    page.wait_for_timeout(300)
    shot = artifacts_dir / "test-tab-spotcheck.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 30_000


def test_translate_tab_answers_with_the_default_backend_and_refuses_empty_input(page, tiny_backends):
    from backends.registry import LABELS
    from service.translate import default_backend, translate_batch

    # the default is whichever verified backend the export's sidecar timed fastest: it varies by machine
    default = default_backend(tiny_backends)
    page.get_by_role("tab", name="Translate").click()
    page.locator("#translate-input textarea").fill("Open the file.")
    page.locator("#translate-go").click()
    page.locator("#translate-status").get_by_text("decoded in").wait_for()
    assert page.locator("#translate-status").inner_text().startswith(f"{LABELS[default]}, greedy: decoded in")
    [alone] = translate_batch(tiny_backends, ["Open the file."], backend_names=[default], max_new_tokens=6)
    assert page.locator("#translate-output textarea").input_value() == alone.to_json()["text"]

    page.locator("#translate-input textarea").fill("")
    page.locator("#translate-go").click()
    page.locator("#translate-status").get_by_text("the input is empty").wait_for()
    assert page.locator("#translate-output textarea").input_value() == ""
