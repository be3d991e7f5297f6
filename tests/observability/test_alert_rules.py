"""The shipped Prometheus rules (deploy/prometheus/) pass `promtool test rules`, and every alert has
a unit test, a runbook annotation and a line in docs/observability.md's runbook."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import yaml

from tests.support import REPO_ROOT, require

RULES_DIR = os.path.join(REPO_ROOT, "deploy", "prometheus")
RULE_FILES = sorted(glob.glob(os.path.join(RULES_DIR, "*.yaml")))
TEST_FILES = sorted(glob.glob(os.path.join(RULES_DIR, "tests", "*.yaml")))


def promtool() -> str:
    require(shutil.which("promtool") is not None, "promtool (scripts/prometheus-tools.sh installs it)")
    return shutil.which("promtool")


def rules_of(path: str) -> list[dict]:
    with open(path) as f:
        return [rule for group in yaml.safe_load(f)["groups"] for rule in group["rules"]]


ALERTS = [rule for path in RULE_FILES for rule in rules_of(path) if "alert" in rule]


@pytest.mark.processes
def test_rule_files_are_valid():
    assert RULE_FILES and ALERTS
    result = subprocess.run([promtool(), "check", "rules", *RULE_FILES], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("test_file", [os.path.basename(p) for p in TEST_FILES])
@pytest.mark.processes
def test_promtool_unit_tests_pass(test_file):
    result = subprocess.run(
        [promtool(), "test", "rules", os.path.join(RULES_DIR, "tests", test_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rule_is_unit_tested():
    """A rule without a promtool case can silently never fire (a typo in a metric name)."""
    tested_alerts, tested_exprs, loaded = set(), set(), set()
    for path in TEST_FILES:
        with open(path) as f:
            spec = yaml.safe_load(f)
        loaded |= {os.path.normpath(os.path.join(os.path.dirname(path), p)) for p in spec["rule_files"]}
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                # A case that only expects silence proves nothing: each alert needs one that fires.
                if check["exp_alerts"]:
                    tested_alerts.add(check["alertname"])
            tested_exprs |= {check["expr"] for check in case.get("promql_expr_test", [])}
    assert set(RULE_FILES) <= loaded, "rule files no test loads"
    assert {rule["alert"] for rule in ALERTS} <= tested_alerts
    recorded = {rule["record"] for path in RULE_FILES for rule in rules_of(path) if "record" in rule}
    assert recorded <= tested_exprs


def test_every_alert_has_a_runbook():
    with open(os.path.join(REPO_ROOT, "docs", "observability.md")) as f:
        docs = f.read()
    for rule in ALERTS:
        assert rule["annotations"].get("runbook"), f"{rule['alert']} has no runbook annotation"
        assert rule["annotations"].get("summary"), f"{rule['alert']} has no summary annotation"
        assert f"`{rule['alert']}`" in docs, f"docs/observability.md's runbook does not cover {rule['alert']}"
