"""A real browser on the app: Debian's Chromium driven by Playwright, headless.

Loads the page, types a sentence, presses Translate, waits for every backend's translation, checks
that the divergence view and the latency table and chart are rendered, and saves a screenshot to
test-artifacts/app.png; a two-sentence input shows its split (test-artifacts/app-segments.png). `.ci/run` installs chromium and fonts-noto-cjk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from app import LABELS
from service.segment import join_translations
from test_app import BACKENDS, SENTENCE

CHROMIUM = Path("/usr/bin/chromium")
TIMEOUT_MS = 180_000

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium fonts-noto-cjk)",
)


@pytest.fixture(scope="module")
def page(app_url):
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(app_url, wait_until="networkidle")
        page.locator("#translate-btn").wait_for()
        yield page
        browser.close()


def _status(page) -> str:
    return page.locator("#status").inner_text()


def test_translate_shows_every_backend_divergence_and_latency(page, artifacts_dir):
    page.locator("#input-text textarea").fill(SENTENCE)
    page.locator("#translate-btn").click()
    page.wait_for_function(
        "() => document.querySelector('#status')?.innerText.includes('Done:')", timeout=TIMEOUT_MS
    )
    assert f"Done: {len(BACKENDS)}/{len(BACKENDS)} backends translated" in _status(page)

    translations = {n: page.locator(f"#out-{n} textarea").input_value() for n in BACKENDS}
    assert all(translations.values()), translations
    # fp32 graphs reproduce PyTorch's text exactly
    assert translations["ort_fp32_single_step"] == translations["pytorch"] == translations["ort_fp32_kv_cache"]
    for n in BACKENDS[1:]:
        assert "PyTorch" in page.locator(f"#stats-{n}").inner_text()
    # what the fp16 graphs keep in fp32, as the export's overflow guard measured it
    assert "overflow guard: " in page.locator("#stats-ort_fp16").inner_text()
    assert "--int8-keep" in page.locator("#stats-ort_int8").inner_text()
    assert "total" in page.locator("#stats-pytorch").inner_text()

    divergence = page.locator("#divergence")
    text = divergence.inner_text()
    for name in BACKENDS[1:]:
        assert LABELS[name] in text
    assert text.count("identical") >= 2 and "max |Δlogit|" in text
    n_tokens = len(page.locator("#divergence .tokcol").all())
    assert n_tokens >= len(BACKENDS) - 1, "expected aligned token columns for every ORT backend"
    page.locator("#forced-plot img").wait_for()

    table = page.locator("#latency-table").inner_text()
    for name in BACKENDS:
        assert LABELS[name] in table
    page.locator("#latency-plot img").wait_for()

    page.wait_for_timeout(500)  # let the plots finish fading in
    shot = artifacts_dir / "app.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 50_000


def test_beam_search_shows_each_backends_n_best_and_pytorchs_rank(page, artifacts_dir):
    """Beam 3 picked in the decoding control: the status names it, and every backend's panel lists
    its 3 final hypotheses with scores; the ORT panels say where PyTorch's best ranks."""
    page.locator("#decoding input").click()
    page.get_by_role("option", name="beam 3", exact=True).click()
    page.locator("#input-text textarea").fill("The storm caused a lot of damage to the old houses.")
    page.locator("#translate-btn").click()
    # the status still holds the previous test's "Done:" until this run's first frame replaces it
    page.wait_for_function(
        "() => /3 beams.*Done:/s.test(document.querySelector('#status')?.innerText || '')", timeout=TIMEOUT_MS
    )
    assert "beam search, 3 beams" in _status(page) and "(chosen)" in _status(page), _status(page)
    for name in BACKENDS:
        summary = page.locator(f"#stats-{name} details.nbest summary").inner_text()
        assert summary.startswith("3-best"), (name, summary)
        rows = page.locator(f"#stats-{name} table.nbest tr").all()
        assert len(rows) == 4, name  # header + 3 hypotheses
        scores = [float(r.locator("td.num").text_content()) for r in rows[1:]]  # inside a closed <details>
        assert scores == sorted(scores, reverse=True) and all(s < 0 for s in scores), (name, scores)
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):  # fp32: the same beam as PyTorch
        assert "PyTorch's best is this beam's best too" in page.locator(f"#stats-{name}").inner_text()
    page.locator("#stats-ort_fp32_kv_cache details.nbest summary").click()
    page.locator("#stats-ort_fp32_kv_cache table.nbest").wait_for()
    page.screenshot(path=str(artifacts_dir / "app-beam.png"), full_page=True)
    page.locator("#decoding input").click()  # back to the model's own decoding for the other tests
    page.get_by_role("option", name="model default", exact=False).click()


def test_enter_on_empty_input_shows_a_clear_message(page):
    box = page.locator("#input-text textarea")
    box.fill("   ")
    box.press("Enter")
    page.wait_for_function(
        "() => document.querySelector('#status')?.innerText.includes('input is empty')", timeout=30_000
    )
    assert "the input is empty: type an English sentence to translate" in _status(page)
    assert page.locator("#out-pytorch textarea").input_value() == ""


def test_two_sentences_show_their_split(page, artifacts_dir):
    """A two-sentence input is translated as two segments, listed with each one's output."""
    first, second = "Click OK.", "Then save the file."
    page.locator("#input-text textarea").fill(f"{first} {second}")
    page.locator("#translate-btn").click()
    page.wait_for_function(
        "() => /Split into 2 segments\\. Done:/.test(document.querySelector('#status')?.innerText || '')",
        timeout=TIMEOUT_MS,
    )
    split = page.locator("#segments")
    assert "Input split into 2 segments" in split.inner_text()
    rows = page.locator("#segments table.segments tr").all()
    assert len(rows) == 3  # header + one row per segment
    cells = [[c.inner_text() for c in row.locator("td").all()] for row in rows[1:]]
    assert [c[:2] for c in cells] == [["1", first], ["2", second]]
    # the PyTorch panel shows the two segment outputs joined, in order
    joined = page.locator("#out-pytorch textarea").input_value()
    assert cells[0][2] and cells[1][2] and joined == join_translations([cells[0][2], cells[1][2]])
    split.screenshot(path=str(artifacts_dir / "app-segments.png"))


STREAM_SNAPSHOT = """() => {
  const status = document.querySelector('#status')?.innerText || '';
  if (!/\\d+\\/\\d+ done; running/.test(status)) return false;
  const out = {status, filled: [], waiting: []};
  for (const name of NAMES) {
    if (document.querySelector(`#out-${name} textarea`).value) out.filled.push(name);
    const stats = document.querySelector(`#stats-${name}`).innerText;
    if (stats.includes('waiting') || stats.includes('running')) out.waiting.push(name);
  }
  return out;
}"""


def test_results_stream_in_as_each_backend_finishes(page):
    """Mid-run, PyTorch's translation is on the page while later backends are still pending."""
    page.locator("#repeat input[type=number]").fill("5")
    page.locator("#repeat input[type=number]").press("Tab")
    page.locator("#input-text textarea").fill("Please save your work before closing the window.")
    page.locator("#translate-btn").click()
    js = STREAM_SNAPSHOT.replace("NAMES", str(BACKENDS))
    snapshot = page.wait_for_function(js, timeout=TIMEOUT_MS, polling=50).json_value()
    assert snapshot["filled"][:1] == ["pytorch"], snapshot
    assert snapshot["waiting"] and BACKENDS[-1] in snapshot["waiting"], snapshot
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Done:')", timeout=TIMEOUT_MS)
    assert "5 runs each" in _status(page)
    assert "run 1 (cold)" in page.locator("#latency-table").inner_text()
