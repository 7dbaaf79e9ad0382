"""Small pure parts of the reconciler and the command line."""

from __future__ import annotations

from qwenserve_operator.main import parse_args
from qwenserve_operator.reconciler import is_subset, metrics_url


def test_drift_ignores_fields_the_api_server_adds_but_not_changed_values() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x:1"}]}}}
    defaulted = {"spec": {"replicas": 2, "progressDeadlineSeconds": 600,
                          "template": {"containers": [{"name": "a", "image": "x:1", "terminationMessagePath": "p"}]}}}
    assert is_subset(desired, defaulted)
    assert not is_subset(desired, {"spec": {**defaulted["spec"], "replicas": 5}})
    edited = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x:2"}]}}}
    assert not is_subset(desired, edited)
    sidecar = {"spec": {"replicas": 2, "template": {"containers": [{"name": "a", "image": "x:1"}, {"name": "b"}]}}}
    assert not is_subset(desired, sidecar)


def test_metrics_url_uses_the_port_named_metrics_of_running_pods() -> None:
    pod = {"status": {"phase": "Running", "podIP": "10.0.0.7"},
           "spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": 50052},
                                              {"name": "metrics", "containerPort": 9191}]}]}}
    assert metrics_url(pod) == "http://10.0.0.7:9191/metrics"
    assert metrics_url({**pod, "status": {"phase": "Pending"}}) is None
    assert metrics_url({**pod, "metadata": {"deletionTimestamp": "now"}}) is None
    assert metrics_url({"status": {"phase": "Running", "podIP": "10.0.0.8"}}) == "http://10.0.0.8:9090/metrics"


def test_command_line_and_environment(monkeypatch) -> None:
    monkeypatch.setenv("QWENSERVE_OPERATOR_NAMESPACES", "a,b")
    monkeypatch.setenv("QWENSERVE_OPERATOR_INTERVAL", "7")
    args = parse_args([])
    assert args.namespaces == ["a", "b"] and args.interval == 7.0 and not args.all_namespaces
    args = parse_args(["-n", "x", "--interval", "3", "-A"])
    assert args.namespaces == ["x"] and args.interval == 3.0 and args.all_namespaces
