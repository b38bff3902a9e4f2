"""docs/report.schema.json against every committed report and a freshly built one (the schema is
the published contract of report.json: harness/analyse.py writes it, every format reads it)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest

from harness import analyse

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
COMMITTED = sorted(ROOT.glob("reports/*/*/report.json"))
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _errors(report: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(VALIDATOR.iter_errors(report), key=lambda e: list(e.absolute_path))]


def test_schema_is_valid_and_versioned():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    # the newest version the schema knows is the one analyse writes; older committed reports stay valid
    assert max(SCHEMA["properties"]["schema_version"]["enum"]) == analyse.SCHEMA_VERSION
    assert SCHEMA["$id"].endswith(f".v{analyse.SCHEMA_VERSION}.json")


def test_committed_reports_exist():
    assert len(COMMITTED) >= 3, COMMITTED  # the H200 verdicts the README lists


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_committed_report_matches_the_schema(path):
    assert _errors(json.loads(path.read_text())) == []


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    from test_report import build_run_dir  # tests/ is on sys.path

    loaded, run_dir = build_run_dir(tmp_path_factory.mktemp("schema"))
    return json.loads(json.dumps(analyse.build_report(loaded, run_dir)))


def test_fresh_report_matches_the_schema(fresh):
    assert _errors(fresh) == []


@pytest.mark.parametrize("change, where", [
    (lambda r: r["gates"][0].update(status="UNDECIDED"), "gates/0/status"),
    (lambda r: r.update(verdict="PASS"), "verdict"),
    (lambda r: r["rows"][0].update(stop="resolved"), "rows/0"),  # a new row field must be declared first
    (lambda r: r["rows"][0]["bases"]["eager"].update(pairs_used=3), "rows/0/bases/eager"),
    (lambda r: r["rows"][0]["bases"].update(wall=r["rows"][0]["bases"]["eager"]), "rows/0/bases"),
    (lambda r: r["rows"][0].pop("bases"), "rows/0"),  # version 2 rows carry their bases
    (lambda r: r.pop("measurement"), "(top)"),
    (lambda r: r["rows"][0]["baseline"].pop("p90"), "rows/0/baseline"),
    (lambda r: r["rows"][0]["speedup"].update(lo="0.9"), "rows/0/speedup/lo"),
    (lambda r: r.update(schema_version=3), "schema_version"),
    (lambda r: r["geomeans"][0].update(extra=1), "geomeans/0"),
])
def test_schema_rejects(fresh, change, where):
    broken = copy.deepcopy(fresh)
    change(broken)
    assert any(e.startswith(where + ":") for e in _errors(broken)), _errors(broken)
