"""The QwenDeployment's status, computed from its children: pure functions.

Conditions follow the Kubernetes convention (metav1.Condition):
- Ready: every stage has as many ready replicas as it wants (and wants at least one);
- Progressing: a rollout or scale change is under way;
- Degraded: the spec is invalid, the operator could not apply a child, or a Deployment reports a
  failure (ReplicaFailure, ProgressDeadlineExceeded).
"""

from __future__ import annotations

from typing import Any

from qwenserve_operator.crd import AUTOSCALED_STAGES, STAGES
from qwenserve_operator.naming import router_endpoint

Condition = dict[str, Any]


def _ready(deployment: dict[str, Any] | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def stage_status(desired: int, deployment: dict[str, Any] | None, autoscaled: bool) -> dict[str, Any]:
    """One stage's status entry from its Deployment (None when it does not exist yet)."""
    ready = _ready(deployment)
    return {"desiredReplicas": desired, "readyReplicas": ready, "summary": f"{ready}/{desired}",
            "autoscaled": autoscaled}


def _rolling_out(desired: int, deployment: dict[str, Any] | None) -> bool:
    if deployment is None:
        return True
    status = deployment.get("status") or {}
    generation = (deployment.get("metadata") or {}).get("generation")
    if generation is not None and status.get("observedGeneration", generation) < generation:
        return True
    return int(status.get("updatedReplicas") or 0) < desired or int(status.get("readyReplicas") or 0) != desired


def _failure(deployment: dict[str, Any] | None) -> str | None:
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("message") or cond.get("reason") or "ReplicaFailure"
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return cond.get("message") or "ProgressDeadlineExceeded"
    return None


def conditions(desired: dict[str, int], deployments: dict[str, dict[str, Any] | None],
               errors: list[str], generation: int | None, may_idle: frozenset[str] = frozenset()) -> list[Condition]:
    """Ready, Progressing and Degraded (without timestamps; see `merge_conditions`). A stage in `may_idle`
    (autoscaled with minReplicas 0) is ready at zero replicas: it starts when a request needs it."""
    not_ready = [s for s in STAGES
                 if (desired[s] < 1 and s not in may_idle) or _ready(deployments.get(s)) < desired[s]]
    rolling = [s for s in STAGES if _rolling_out(desired[s], deployments.get(s))]
    failures = [f"{s}: {msg}" for s in STAGES if (msg := _failure(deployments.get(s)))]
    problems = errors + failures

    def cond(kind: str, ok: bool, reason: str, message: str) -> Condition:
        c: Condition = {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message}
        if generation is not None:
            c["observedGeneration"] = generation
        return c

    ready = not not_ready and not errors
    ready_reason = "AllStagesReady" if ready else ("InvalidSpec" if errors else "StagesNotReady")
    ready_message = "all stages ready" if not not_ready else "waiting for: " + ", ".join(not_ready)
    return [
        cond("Ready", ready, ready_reason, ready_message),
        cond("Progressing", bool(rolling) and not errors, "RollingOut" if rolling else "Reconciled",
             "updating: " + ", ".join(rolling) if rolling else "every stage is at its desired state"),
        cond("Degraded", bool(problems), "ReconcileFailed" if problems else "AsExpected",
             "; ".join(problems) if problems else "no problems"),
    ]


def merge_conditions(old: list[Condition], new: list[Condition], now: str) -> list[Condition]:
    """New conditions, keeping lastTransitionTime where the status did not change."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"] and before.get("lastTransitionTime")
        out.append({**cond, "lastTransitionTime": before["lastTransitionTime"] if same else now})
    return out


def compute_status(name: str, namespace: str, spec: dict[str, Any], desired: dict[str, int],
                   deployments: dict[str, dict[str, Any] | None], old_status: dict[str, Any],
                   errors: list[str], generation: int | None, now: str) -> dict[str, Any]:
    """The full status to store, given the children as they are now."""
    stages = {}
    for stage in STAGES:
        autoscaled = stage in AUTOSCALED_STAGES and bool(spec["stages"][stage].get("autoscaling", {}).get("enabled"))
        entry = stage_status(desired[stage], deployments.get(stage), autoscaled)
        previous = ((old_status.get("stages") or {}).get(stage)) or {}
        for key in ("lastScaleTime", "lastScaleReason"):
            if previous.get(key):
                entry[key] = previous[key]
        stages[stage] = entry
    may_idle = frozenset(s for s in AUTOSCALED_STAGES
                         if (scaling := spec["stages"][s].get("autoscaling", {})).get("enabled")
                         and scaling.get("minReplicas") == 0)
    new_conditions = conditions(desired, deployments, errors, generation, may_idle)
    return {
        "observedGeneration": generation,
        "routerEndpoint": router_endpoint(name, namespace),
        "stages": stages,
        "conditions": merge_conditions(old_status.get("conditions") or [], new_conditions, now),
    }
