"""The chart's alerts, evaluated by Prometheus' own rule engine: `promtool test rules` runs alerts_test.yaml (series
that break each rule and series that do not) against the rules the chart renders."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
PROMTOOL = shutil.which("promtool")


def _rules(render: Callable[..., list[dict[str, Any]]], values: dict[str, Any]) -> dict[str, Any]:
    docs = render({"monitoring": {"prometheusRule": {"enabled": True, **values}}})
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL, "promtool is missing: scripts/setup.sh installs it (Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def test_every_alert_fires_on_series_that_break_it_and_stays_quiet_otherwise(render, tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(_rules(render, {})))
    shutil.copy(HERE / "alerts_test.yaml", tmp_path)
    checked = _promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", str(tmp_path / "alerts_test.yaml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {r["alert"] for g in _rules(render, {})["groups"] for r in g["rules"]}
    cases = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    covered = {t["alertname"] for case in cases for t in case["alert_rule_test"]}
    assert alerts == covered, f"alerts without a test: {alerts - covered}"


def test_thresholds_come_from_values_and_the_rule_is_off_by_default(render) -> None:
    assert not [d for d in render({}) if d["kind"] == "PrometheusRule"]
    rules = _rules(render, {"objective": 0.995, "ttftSeconds": "1.0", "errorRatio": 0.01, "labels": {"release": "kps"}})
    exprs = {r["alert"] + r["labels"]["severity"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert 'le="1.0"' in exprs["QwenServeTTFTBudgetBurnpage"] and "> 0.072" in exprs["QwenServeTTFTBudgetBurnpage"]
    assert "> 0.03" in exprs["QwenServeTTFTBudgetBurnticket"] and "> 0.01" in exprs["QwenServeErrorRatepage"]
