"""The report and the reports index in a real headless Chromium, opened from disk (file://), at a
1400 px wide window and a laptop screen: tables fit, plot labels do not overprint, no number is
blank or out of sight. Screenshots go to the `artifacts` folder (conftest.py; printed at the end
of the run), under browser/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import analyse, report

CHROMIUM = Path("/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[1]
WINDOWS = {"wide": (1400, 900), "laptop": (1280, 720)}
COMMITTED = sorted(ROOT.glob("reports/*/*/report.json"))
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (CI: apt-get install -y chromium)"),
]

# Scroll every section into view (sections below the fold are laid out when they come into view),
# open every folded raw record, and measure what a reader would see.
LAYOUT_PROBLEMS = """async () => {
  // two frames let a section scrolled into view lay out; the timer ends the wait if this page
  // paints no frames (a headless page in the background may not), which once held CI for an hour
  const frame = () => new Promise(r => { requestAnimationFrame(() => requestAnimationFrame(r)); setTimeout(r, 250); });
  const problems = [];
  const main = document.querySelector('main').getBoundingClientRect();
  document.querySelectorAll('details.raw, details.row-plots').forEach(d => d.open = true);
  const sections = Array.from(document.querySelectorAll('main > section'));
  for (const s of sections) {
    s.scrollIntoView(); await frame();
    for (const t of s.querySelectorAll('table')) {
      if (!t.offsetParent || t.closest('.dump')) continue;
      const r = t.getBoundingClientRect();
      if (r.right > main.right + 1 || r.left < main.left - 1)
        problems.push(`table ${t.id || t.className} spans ${Math.round(r.left)}-${Math.round(r.right)} px, the page ${Math.round(main.left)}-${Math.round(main.right)}`);
    }
    for (const d of s.querySelectorAll('.dump')) {
      if (!d.offsetParent) continue;
      const box = d.getBoundingClientRect();
      if (box.right > main.right + 1) problems.push(`a raw record box ends at ${Math.round(box.right)} px`);
      for (const td of d.querySelectorAll('td')) {
        const text = td.textContent.trim();
        if (!/^[-+]?[0-9.,]+/.test(text) || td.querySelector('table')) continue;
        const c = td.getBoundingClientRect();
        if (c.left > box.left + d.clientWidth) problems.push(`number ${text} out of sight (${Math.round(c.left)} px)`);
      }
    }
    for (const td of s.querySelectorAll('td.n')) {
      if (td.offsetParent && td.textContent.trim() === '') problems.push(`empty numeric cell in ${td.closest('table').id}`);
    }
    for (const svg of s.querySelectorAll('svg.plot')) {
      if (!svg.getBoundingClientRect().width) continue;
      const outer = svg.getBoundingClientRect();
      const boxes = Array.from(svg.querySelectorAll('text')).map(t => [t.textContent, t.getBoundingClientRect()])
        .filter(([text, b]) => text.trim() && b.width > 0);
      for (const [text, b] of boxes) {
        if (b.left < outer.left - 1 || b.right > outer.right + 1 || b.top < outer.top - 1 || b.bottom > outer.bottom + 1)
          problems.push(`label '${text}' cut off by ${svg.getAttribute('aria-label')}'s edge`);
      }
      for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
        const [ta, a] = boxes[i], [tb, b] = boxes[j];
        const dx = Math.min(a.right, b.right) - Math.max(a.left, b.left);
        const dy = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
        if (dx > 1 && dy > 1) problems.push(`labels '${ta}' and '${tb}' overlap in ${svg.getAttribute('aria-label')}`);
      }
    }
  }
  if (document.documentElement.scrollWidth > document.documentElement.clientWidth)
    problems.push(`page is ${document.documentElement.scrollWidth} px wide in a ${document.documentElement.clientWidth} px window`);
  return problems;
}"""


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
def shots(artifacts) -> Path:
    out = artifacts / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield b
        b.close()


def _open(browser, path: Path, window: str = "wide"):
    width, height = WINDOWS[window]
    page = browser.new_page(viewport={"width": width, "height": height})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: problems.append(f"request: {r.url}") if not r.url.startswith(("file:", "data:"))
            else None)
    page.goto(path.resolve().as_uri())
    page.wait_for_load_state("load")
    return page, problems


def _shoot(page, folder: Path, name: str) -> None:
    """The window as opened, and the whole page with every section laid out."""
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(folder / f"{name}.png"))
    page.add_style_tag(content="section.s { content-visibility: visible; }")
    page.screenshot(path=str(folder / f"{name}-full.png"), full_page=True)


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
    # the verdict box: one line per deciding gate, the full reasons folded
    assert len(page.query_selector_all("#deciding > li")) == len(data["deciding_gates"])
    assert not page.is_visible("#verdict-details > ul")
    page.click("#verdict-details > summary")
    assert page.is_visible("#verdict-details > ul")

    page.evaluate("document.querySelectorAll('details.row-plots').forEach(d => d.open = true)")
    page.evaluate("document.getElementById('series').scrollIntoView()")
    svgs = page.query_selector_all("svg.plot")
    assert len(svgs) >= 1 + 2 * len(data["rows"])
    for svg in svgs:
        svg.scroll_into_view_if_needed()
        box = svg.bounding_box()
        assert box and box["width"] > 50 and box["height"] > 50, box

    # sorting: click the speedup column twice (ascending, then descending by each line's point)
    col = page.eval_on_selector_all("#speedup-table thead th", "hs => hs.map(h => h.textContent.trim())").index("speedup")
    keys = f"rows => rows.map(r => parseFloat(r.cells[{col}].getAttribute('data-sort')))"
    page.click(f"#speedup-table thead th:nth-child({col + 1})")
    ascending = page.eval_on_selector_all("#speedup-table > tbody > tr", keys)
    assert ascending == sorted(ascending) and len(ascending) >= len(data["rows"])
    page.click(f"#speedup-table thead th:nth-child({col + 1})")
    assert page.eval_on_selector_all("#speedup-table > tbody > tr", keys) == sorted(ascending, reverse=True)
    # text column: gate names sort alphabetically
    page.click("#gates-table thead th:nth-child(1)")
    assert _column(page, "#gates-table", 0) == sorted(g["name"] for g in data["gates"])

    # the gate links land on their evidence
    page.click("#gates-table a[href='#peak']")
    assert page.evaluate("location.hash") == "#peak"
    assert not problems, problems


@pytest.mark.parametrize("window", sorted(WINDOWS))
def test_report_fits_the_window(browser, site, shots, window):
    """The demo report and every committed H200 report: no table wider than the page, no plot
    label over another or cut off, no blank or hidden number, no horizontal scroll."""
    tmp, data, html, _ = site
    pages = {"demo": html}
    for path in COMMITTED:
        out = tmp / "committed" / path.parent.parent.name / path.parent.name / "index.html"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report.render_html(json.loads(path.read_text())))
        pages[f"{path.parent.parent.name}-{path.parent.name}"] = out
    found = {}
    for name, path in pages.items():
        page, problems = _open(browser, path, window)
        _shoot(page, shots, f"report-{name}-{window}")
        found[name] = page.evaluate(LAYOUT_PROBLEMS) + problems
        page.close()
    assert found == {name: [] for name in pages}


def test_old_layout_problems_are_caught(browser, site, tmp_path):
    """The probe itself fails on what the issue saw: a table wider than the page, a number pushed out
    of its raw-record box, two labels on top of each other."""
    page_file = tmp_path / "bad.html"
    long = "x" * 400
    page_file.write_text(
        "<html><body><main style='max-width:600px'>"
        f"<section class='s'><table id='wide'><tr><td style='white-space:nowrap'>{long}</td></tr></table></section>"
        "<section class='s'><div class='dump' style='overflow-x:auto'><table><tr><td style='white-space:nowrap'>"
        f"{long}</td><td>42</td></tr></table></div></section>"
        "<section class='s'><svg class='plot' aria-label='p' width='200' height='50'>"
        "<text x='10' y='20'>threshold 1.1x</text><text x='14' y='22'>threshold 1.08x</text></svg></section>"
        "</main></body></html>")
    page, _ = _open(browser, page_file)
    problems = page.evaluate(LAYOUT_PROBLEMS)
    assert any(p.startswith("table wide spans") for p in problems), problems
    assert any(p.startswith("number 42 out of sight") for p in problems), problems
    assert any("overlap in p" in p for p in problems), problems
    assert any(p.startswith("page is") for p in problems), problems


def test_index_page(browser, site, shots):
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
    assert page.evaluate(LAYOUT_PROBLEMS) == []
    _shoot(page, shots, "index")
    # the link opens the run's report from disk
    page.click(f"#runs-table a:text('{data['run']['id']}')")
    page.wait_for_load_state("load")
    assert page.inner_text("#verdict-text").strip() == data["verdict"]
    assert not problems, problems
