"""The report and the reports index in a real headless Chromium, opened from disk (file://)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import analyse, report

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (CI: apt-get install -y chromium)"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from test_report import build_run_dir  # tests/ is on sys.path (rootdir-relative test modules)

    tmp = tmp_path_factory.mktemp("site")
    loaded, run_dir = build_run_dir(tmp)
    data = analyse.build_report(loaded, run_dir)
    reports = tmp / "reports"
    html = analyse.write_report(data, reports / loaded.exp.name / run_dir.name)
    index = report.render_index(reports)
    return tmp, data, html, index


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, path: Path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: problems.append(f"request: {r.url}") if not r.url.startswith(("file:", "data:"))
            else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    return page, problems


def _column(page, table: str, col: int) -> list[str]:
    return page.eval_on_selector_all(f"{table} > tbody > tr", f"rows => rows.map(r => r.cells[{col}].textContent.trim())")


def test_report_page(browser, site):
    tmp, data, html, _ = site
    page, problems = _open(browser, html)
    assert page.inner_text("#verdict-text").strip() == data["verdict"]
    assert page.is_visible("#no-gpu-verdict")
    # injected markup from the description, branch and kernel name rendered as text, never run
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert "<script>alert(1)</script>" in page.inner_text("#description")
    svgs = page.query_selector_all("svg.plot")
    assert len(svgs) >= 1 + 2 * len(data["rows"])
    for svg in svgs:
        box = svg.bounding_box()
        assert box and box["width"] > 50 and box["height"] > 50, box

    # sorting: click 'speedup' twice (ascending, then descending) and check the row order
    before = _column(page, "#speedup-table", 0)
    points = {r["name"]: r["speedup"]["point"] for r in data["rows"]}
    ascending = sorted(points, key=points.get)
    page.click("#speedup-table thead th:nth-child(2)")
    assert _column(page, "#speedup-table", 0) == ascending
    page.click("#speedup-table thead th:nth-child(2)")
    assert _column(page, "#speedup-table", 0) == ascending[::-1]
    assert sorted(before) == sorted(ascending)
    # text column: gate names sort alphabetically
    page.click("#gates-table thead th:nth-child(1)")
    assert _column(page, "#gates-table", 0) == sorted(g["name"] for g in data["gates"])

    # the gate links land on their evidence
    page.click("#gates-table a[href='#peak']")
    assert page.evaluate("location.hash") == "#peak"
    page.screenshot(path=str(tmp / "report.png"), full_page=True)
    assert not problems, problems


def test_index_page(browser, site):
    tmp, data, _, index = site
    # a second, older run so there is something to sort
    older = json.loads(json.dumps(data))
    older["run"]["id"], older["run"]["started"], older["verdict"] = "20250101T000000Z-0000", "2025-01-01T00:00:00+00:00", "GO"
    d = index.parent / data["experiment"]["name"] / older["run"]["id"]
    d.mkdir(parents=True)
    (d / "report.json").write_text(json.dumps(older))
    index = report.render_index(index.parent)

    page, problems = _open(browser, index)
    runs = _column(page, "#runs-table", 2)
    assert runs == [data["run"]["id"], older["run"]["id"]]  # newest first
    page.click("#runs-table thead th:nth-child(1)")  # date, ascending
    assert _column(page, "#runs-table", 2) == [older["run"]["id"], data["run"]["id"]]
    assert page.evaluate("typeof window.__pwned") == "undefined"
    page.screenshot(path=str(tmp / "index.png"), full_page=True)
    # the link opens the run's report from disk
    page.click(f"#runs-table a:text('{data['run']['id']}')")
    page.wait_for_load_state("load")
    assert page.inner_text("#verdict-text").strip() == data["verdict"]
    assert not problems, problems
