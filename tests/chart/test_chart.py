"""The Helm chart rendered by Helm's engine, linted, and every manifest validated for Kubernetes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from qwenserve_operator import crd, naming

K8S_VERSION = "1.37.0"
CHART = Path(__file__).resolve().parents[2] / "charts/qwen-serve"
NAMESPACE = "serving"  # the release namespace the `render` fixture uses

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "example-and-redis": {"example": {"enabled": True}, "redis": {"enabled": True}},
    "cluster-wide": {"operator": {"clusterWide": True, "verbose": True}},
    "two-namespaces": {"operator": {"watchNamespaces": ["team-a", "team-b"]}},
    "custom": {"image": {"repository": "registry.local/qs", "tag": "dev", "pullPolicy": "Always"},
               "imagePullSecrets": [{"name": "regcred"}],
               "serviceAccount": {"name": "custom-sa", "annotations": {"x": "y"}},
               "operator": {"nodeSelector": {"role": "system"}, "interval": 5,
                            "tolerations": [{"key": "system", "operator": "Exists"}],
                            "podAnnotations": {"a": "b"}},
               "example": {"enabled": True, "name": "mine",
                           "spec": {"model": {"name": "Qwen/Qwen3-8B", "source": "pvc",
                                              "pvc": {"claimName": "w"}}, "kvTransfer": {"mode": "shm"}}}},
    "no-rbac-no-sa": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}},
}


def _kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_manifest_is_valid_for_kubernetes(render, name: str) -> None:
    docs = render(VALUE_SETS[name])
    assert docs
    for doc in docs:
        if doc["kind"] == crd.KIND:
            jsonschema.Draft4Validator(crd.openapi_schema()).validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_is_clean(name: str) -> None:
    report = helm_python.lint(CHART, VALUE_SETS[name], strict=True, kube_version=f"v{K8S_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_install_is_operator_serviceaccount_and_namespaced_rbac(render) -> None:
    docs = render()
    assert _kinds(docs) == ["Deployment", "Role", "RoleBinding", "ServiceAccount"]
    role = next(d for d in docs if d["kind"] == "Role")
    assert role["metadata"]["namespace"] == NAMESPACE


def test_rbac_is_least_privilege(render) -> None:
    role = next(d for d in render() if d["kind"] == "Role")
    verbs = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
             for group in rule["apiGroups"] for resource in rule["resources"]}
    assert all("delete" not in v and "*" not in v and "update" not in v for v in verbs.values())
    assert not any("*" in (group, resource) for group, resource in verbs)
    assert verbs[("", "secrets")] == {"create"}  # each deployment's stage secret, made once; never read
    assert verbs[("qwenserve.io", "qwendeployments/status")] == {"get", "patch"}
    assert verbs[("", "events")] == {"create"}
    assert verbs[("", "pods")] == {"get", "list"}
    assert verbs[("networking.k8s.io", "networkpolicies")] == {"get", "create", "patch"}
    assert verbs[("apps", "deployments")] >= {"get", "create", "patch"}


def test_the_stages_network_policies_admit_the_operator_pods_to_the_metrics_ports(render) -> None:
    operator = next(d for d in render() if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert naming.OPERATOR_POD_LABELS.items() <= operator.items()


def test_watch_namespaces_get_a_role_each_and_the_operator_their_names(render) -> None:
    docs = render(VALUE_SETS["two-namespaces"])
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role") == ["team-a", "team-b"]
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--namespace") + 1] == "team-a" and args.count("--namespace") == 2


def test_cluster_wide_uses_a_cluster_role(render) -> None:
    docs = render(VALUE_SETS["cluster-wide"])
    assert "ClusterRole" in _kinds(docs) and "Role" not in _kinds(docs)
    args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and "--namespace" not in args


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_pod_is_non_root_read_only_without_capabilities(render, name: str) -> None:
    for doc in render(VALUE_SETS[name]):
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["allowPrivilegeEscalation"] is False


def test_example_uses_the_chart_image_and_the_in_cluster_redis(render) -> None:
    docs = render(VALUE_SETS["example-and-redis"])
    example = next(d for d in docs if d["kind"] == crd.KIND)
    assert example["spec"]["image"]["tag"] == "0.1.0"
    assert example["spec"]["redis"]["url"] == f"redis://qs-qwen-serve-redis.{NAMESPACE}.svc.cluster.local:6379/0"
    redis_service = next(d for d in docs if d["kind"] == "Service")
    assert redis_service["metadata"]["name"] == "qs-qwen-serve-redis"


def test_chart_ships_the_operator_crd(chart) -> None:
    assert [c["filename"].split("/", 1)[-1] for c in chart.crds] == ["crds/qwendeployments.qwenserve.io.yaml"]
    assert yaml.safe_load(chart.crds[0]["data"]) == crd.crd()


@pytest.mark.parametrize("bad", [
    {"operator": {"interval": 0}},
    {"operator": {"watchNamespaces": ["Not_A_Namespace"]}},
    {"image": {"pullPolicy": "Sometimes"}},
    {"example": {"name": "x" * 60}},
    {"typo": True},
])
def test_values_schema_rejects_bad_values(chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(chart.merge_values(bad))


def test_notes_explain_how_to_deploy(chart) -> None:
    notes = chart.render(values={"example": {"enabled": True}}, name="qs", namespace=NAMESPACE)[
        "qwen-serve/templates/NOTES.txt"]
    assert "kubectl apply" in notes and "qwen-example-router" in notes
