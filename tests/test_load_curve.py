"""bench/load_curve.py (the sweep of users per backend), service/load_curve.py (which curve the
Benchmark tab shows) and ui/load_plots.py (its plots' data), without an app: `drive` is replaced by
one that records what it was asked and answers like the real one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench import load as load_mod
from bench import load_curve
from service.load_curve import curve_to_show, newest_curve, read_curve, rows
from ui import load_plots

REPO = Path(__file__).resolve().parent.parent
BASE = load_mod.LoadOptions(url="http://127.0.0.1:1/", target="translate", requests=100_000)


def fake_results(backend: str, users: int, served: str | None = None) -> dict:
    return {
        "environment": {"machine": "test"},
        "latency_ms": {"end_to_end": {"p50": 100.0 * users, "p95": 150.0 * users, "p99": 200.0 * users}},
        "counts": {"ok": 10 * users, "busy": 0, "error": 1 if users == 4 else 0,
                   "error_kinds": {"timeout": 1} if users == 4 else {}},
        "memory": {"samples": [{"finished": 0, "rss_mb": 500.0}, {"finished": 9, "rss_mb": 510.0 + users}]},
        "served": {"backends": [served or backend], "decodings": []},
        "throughput_ok_per_s": 3.0 * users,
        "decoded_together": {"mean": float(users)},
        "run_s": 1.0,
    }


def test_the_sweep_drives_every_backend_at_every_user_count_in_order(monkeypatch, tmp_path):
    asked = []

    def drive(url, options, pid, log):
        asked.append((options.backend, options.users, options.duration_s, options.target, options.url, pid))
        return fake_results(options.backend, options.users)

    monkeypatch.setattr(load_mod, "drive", drive)
    options = load_curve.CurveOptions(backends=("ort_int8", "ort_fp32_kv_cache"), users=(1, 4), duration_s=2.5,
                                      base=BASE)
    curve = load_curve.run(options, tmp_path, log=lambda m: None)
    assert asked == [("ort_int8", 1, 2.5, "translate", BASE.url, None), ("ort_int8", 4, 2.5, "translate", BASE.url, None),
                     ("ort_fp32_kv_cache", 1, 2.5, "translate", BASE.url, None),
                     ("ort_fp32_kv_cache", 4, 2.5, "translate", BASE.url, None)]
    p = curve["points"][1]
    assert (p["backend"], p["users"], p["sentences_per_s"], p["p99_ms"], p["errors"], p["error_kinds"]) == (
        "ort_int8", 4, 12.0, 800.0, 1, {"timeout": 1})
    assert (p["rss_mb_start"], p["rss_mb_end"]) == (500.0, 514.0)
    assert read_curve(tmp_path / "curve.json") == json.loads(json.dumps(curve))
    assert "| ort_int8 | 4 | 12.0 | 400.0 | 600.0 | 800.0 | 40 | 0 | 1 | 500.0 → 514.0 |" in (
        tmp_path / "curve.md").read_text()


def test_a_request_served_by_another_backend_stops_the_sweep(monkeypatch, tmp_path):
    monkeypatch.setattr(load_mod, "drive", lambda url, o, pid, log: fake_results(o.backend, o.users, served="pytorch"))
    options = load_curve.CurveOptions(backends=("ort_int8",), users=(1,), duration_s=1, base=BASE)
    with pytest.raises(RuntimeError, match=r"requests named ort_int8 but were served by \['pytorch'\]"):
        load_curve.run(options, tmp_path, log=lambda m: None)


@pytest.mark.parametrize("kwargs, message", [
    ({"backends": ()}, "--backends must name at least one backend"),
    ({"users": (4, 2)}, "--users must rise without repeats, got 4,2"),
    ({"users": (0, 2)}, "--users must be positive counts"),
    ({"duration_s": 0}, "--duration must be positive"),
    ({"base": None}, "give --url or --launch"),
])
def test_curve_options_name_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_curve.CurveOptions(**{"backends": ("ort_int8",), "base": BASE, **kwargs})


def test_backend_is_for_the_translate_target_only():
    with pytest.raises(ValueError, match="--backend is for --target translate"):
        load_mod.LoadOptions(url="http://127.0.0.1:1/", target="compare", backend="ort_int8")


def test_each_request_names_its_backend():
    from bench.load_client import Answer

    class Client:
        def call(self, data, timeout_s):
            self.data = data
            return Answer({"text": "x", "error": None, "backend": "ort_int8", "decoding": {},
                           "batch": {"decoded_together": 1}, "timings_ms": {"decode": 1.0}, "segments": [],
                           "warnings": []}, 0.01, 0.02, 0)

    client = Client()
    options = load_mod.LoadOptions(url="http://127.0.0.1:1/", target="translate", backend="ort_int8")
    req = load_mod.one_request(client, "Hello.", load_mod.Request(index=0, user=0, sentence=0), options,
                               time.monotonic())
    assert client.data == ["Hello.", None, "ort_int8"] and req.outcome == "ok" and req.backend == "ort_int8"


def _curve(**extra) -> dict:
    return {"kind": "load_curve", "date_utc": "2026-12-05 08:00", "method": "closed loop",
            "points": [{"backend": "ort_int8", "users": 1, "sentences_per_s": 5.0, "p50_ms": 150.0, "p95_ms": 170.0,
                        "p99_ms": 190.0, "ok": 50, "busy": 0, "errors": 0}], **extra}


def test_this_hosts_newest_curve_comes_before_the_reference(tmp_path):
    old, new = tmp_path / "a" / "curve.json", tmp_path / "b" / "curve.json"
    for path in (old, new):
        path.parent.mkdir()
        path.write_text(json.dumps(_curve()))
    new.touch()
    later = time.time() + 5
    import os

    os.utime(new, (later, later))
    assert newest_curve(tmp_path) == new
    curve, source = curve_to_show(tmp_path, REPO / "assets" / "reference-results.json")
    assert source.startswith("measured on this host") and str(new) in source
    assert rows(curve) == [{"backend": "ort_int8", "users": 1, "sentences/s": 5.0, "P50 ms": 150.0, "P99 ms": 190.0}]


def test_without_a_curve_here_the_reference_is_shown_marked_or_the_command_is_named(tmp_path):
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"machine": "a 2-core VM", "load_curve": _curve(commit="abc1234")}))
    curve, source = curve_to_show(tmp_path / "empty", reference)
    assert curve["points"][0]["users"] == 1
    assert "reference, not measured on this host" in source and "abc1234" in source and "a 2-core VM" in source
    reference.write_text(json.dumps({"machine": "x"}))
    curve, source = curve_to_show(tmp_path / "empty", reference)
    assert curve is None and "python -m bench load-curve --launch" in source


def test_a_malformed_curve_is_named_not_shown(tmp_path):
    bad = _curve()
    del bad["points"][0]["p99_ms"]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "curve.json").write_text(json.dumps(bad))
    curve, source = curve_to_show(tmp_path, None)
    assert curve is None and "malformed load curve: point 1: no p99_ms" in source


def test_the_plots_get_one_row_per_point_and_a_header_with_refusals(tmp_path):
    (tmp_path / "x").mkdir()
    two = _curve()
    two["points"].append({**two["points"][0], "users": 16, "p99_ms": 700.0, "busy": 3, "errors": 1})
    (tmp_path / "x" / "curve.json").write_text(json.dumps(two))

    class Loaded:
        results_dir, reference_results = tmp_path, None

    data, head = load_plots.frame(Loaded())
    assert list(data["users"]) == [1, 16] and list(data["P99 ms"]) == [190.0, 700.0]
    assert "3 busy, 1 errors" in head and "measured on this host" in head
def test_the_shipped_reference_curve_is_valid_and_in_the_docs():
    data = json.loads((REPO / "assets" / "reference-results.json").read_text(encoding="utf-8"))
    from service.load_curve import check_curve

    curve = check_curve(data["load_curve"], "reference")
    doc = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    table = load_curve.markdown(curve).split("\n\n", 1)[1].strip()
    assert table in doc
