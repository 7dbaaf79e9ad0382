"""Status and conditions computed from the children."""

from __future__ import annotations

from qwenserve_operator import status
from qwenserve_operator.crd import STAGES

DESIRED = {s: 1 for s in STAGES}


def _deployment(ready: int, updated: int | None = None, generation: int = 1, observed: int = 1,
                conditions: list | None = None) -> dict:
    return {"metadata": {"generation": generation},
            "status": {"readyReplicas": ready, "updatedReplicas": ready if updated is None else updated,
                       "observedGeneration": observed, "conditions": conditions or []}}


def _by_type(conds: list[dict]) -> dict[str, dict]:
    return {c["type"]: c for c in conds}


def test_all_ready_is_ready_not_progressing_not_degraded() -> None:
    conds = _by_type(status.conditions(DESIRED, {s: _deployment(1) for s in STAGES}, [], 3))
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["observedGeneration"] == 3
    assert conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "False"


def test_a_missing_stage_is_not_ready_and_progressing() -> None:
    deployments = {s: _deployment(1) for s in STAGES}
    deployments["decode"] = None
    conds = _by_type(status.conditions(DESIRED, deployments, [], 1))
    assert conds["Ready"]["status"] == "False" and "decode" in conds["Ready"]["message"]
    assert conds["Progressing"]["status"] == "True"


def test_an_unobserved_generation_is_progressing() -> None:
    deployments = {s: _deployment(1) for s in STAGES}
    deployments["router"] = _deployment(1, generation=2, observed=1)
    assert _by_type(status.conditions(DESIRED, deployments, [], 1))["Progressing"]["status"] == "True"


def test_deployment_failures_and_errors_are_degraded() -> None:
    deployments = {s: _deployment(1) for s in STAGES}
    deployments["prefill"] = _deployment(0, conditions=[
        {"type": "ReplicaFailure", "status": "True", "message": "exceeded quota"}])
    conds = _by_type(status.conditions(DESIRED, deployments, ["Service x: 403"], 1))
    assert conds["Degraded"]["status"] == "True"
    assert "exceeded quota" in conds["Degraded"]["message"] and "403" in conds["Degraded"]["message"]


def test_a_stage_scaled_to_zero_is_not_ready() -> None:
    desired = {**DESIRED, "prefill": 0}
    assert _by_type(status.conditions(desired, {s: _deployment(1) for s in STAGES}, [], 1))["Ready"][
        "status"] == "False"


def test_a_stage_the_autoscaler_may_take_to_zero_is_ready_at_zero(make_spec) -> None:
    spec = make_spec(stages={"decode": {"autoscaling": {"enabled": True, "minReplicas": 0}}})
    desired = {**DESIRED, "decode": 0}
    deployments = {s: _deployment(0 if s == "decode" else 1) for s in STAGES}
    built = status.compute_status("q", "ns", spec, desired, deployments, {}, [], 1, "2026-12-01T00:00:00Z")
    assert _by_type(built["conditions"])["Ready"]["status"] == "True"
    assert built["stages"]["decode"]["summary"] == "0/0"


def test_transition_time_moves_only_when_the_status_changes() -> None:
    old = [{"type": "Ready", "status": "False", "lastTransitionTime": "T0"},
           {"type": "Degraded", "status": "False", "lastTransitionTime": "T0"}]
    new = [{"type": "Ready", "status": "True"}, {"type": "Degraded", "status": "False"}]
    merged = _by_type(status.merge_conditions(old, new, "T1"))
    assert merged["Ready"]["lastTransitionTime"] == "T1"
    assert merged["Degraded"]["lastTransitionTime"] == "T0"


def test_compute_status_summarises_each_stage_and_keeps_scale_notes(make_spec) -> None:
    spec = make_spec(stages={"decode": {"autoscaling": {"enabled": True}}})
    old = {"stages": {"decode": {"lastScaleTime": "T0", "lastScaleReason": "why"}}}
    deployments = {s: _deployment(1) for s in STAGES}
    deployments["decode"] = _deployment(2)
    result = status.compute_status("demo", "ns1", spec, {**DESIRED, "decode": 3}, deployments, old, [], 4, "T1")
    assert result["stages"]["decode"] == {"desiredReplicas": 3, "readyReplicas": 2, "summary": "2/3",
                                          "autoscaled": True, "lastScaleTime": "T0", "lastScaleReason": "why"}
    assert result["stages"]["tokenizer"]["autoscaled"] is False
    assert result["routerEndpoint"] == "http://demo-router.ns1.svc.cluster.local:8000"
    assert result["observedGeneration"] == 4
