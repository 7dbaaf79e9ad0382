"""The CRD: one source (operator/qwenserve_operator/crd.py), valid for Kubernetes, structural, with defaults; examples fit it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from qwenserve_operator import crd

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts/qwen-serve/crds/qwendeployments.qwenserve.io.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("qwendeployment-*.yaml"))
K8S_VERSION = "1.37.0"


def test_chart_crd_is_exactly_the_generated_one() -> None:
    assert CHART_CRD.read_text() == crd.render_yaml(), "run: python -m qwenserve_operator.crd > " + str(CHART_CRD)


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(yaml.safe_load(CHART_CRD.read_text()), K8S_VERSION, strict=True)


def _walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        nodes += _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        nodes += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        nodes += _walk(schema["additionalProperties"], f"{path}{{}}")
    return nodes


def test_schema_is_structural_every_node_has_a_type() -> None:
    for path, node in _walk(crd.openapi_schema()):
        exempt = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or exempt, f"{path} has no type"
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf"):
            assert forbidden not in node, f"{path} uses {forbidden}"


def test_crd_has_status_subresource_and_the_printer_columns() -> None:
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Ready", "Tokenizer", "Prefill", "Decode", "Router", "Age"]


def test_defaults_fill_every_stage_from_a_minimal_spec() -> None:
    spec = crd.with_defaults({"model": {"name": "Qwen/Qwen3-0.6B"}})
    assert spec["kvTransfer"]["mode"] == "network"
    assert set(spec["stages"]) == {"tokenizer", "prefill", "decode", "router"}
    assert spec["stages"]["decode"]["autoscaling"]["targetKVUsage"] == 0.75
    assert "autoscaling" not in spec["stages"]["router"]
    assert spec["stages"]["decode"]["terminationGracePeriodSeconds"] > spec["stages"]["tokenizer"][
        "terminationGracePeriodSeconds"]


def test_defaults_never_override_what_the_user_set() -> None:
    spec = crd.with_defaults({"model": {"name": "m", "source": "pvc", "pvc": {"claimName": "c"}},
                              "stages": {"prefill": {"replicas": 0}}})
    assert spec["model"]["source"] == "pvc" and spec["model"]["pvc"]["subPath"] == ""
    assert spec["stages"]["prefill"]["replicas"] == 0


def _object_validator() -> jsonschema.Validator:
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum).
    return jsonschema.Draft4Validator(crd.openapi_schema())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_match_the_crd_schema(path: Path) -> None:
    example = yaml.safe_load(path.read_text())
    assert example["apiVersion"] == f"{crd.GROUP}/{crd.VERSION}" and example["kind"] == crd.KIND
    _object_validator().validate(example)
    # The part kubernetes-validate knows: the object metadata.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": example["metadata"]},
                                 K8S_VERSION, strict=True)


def test_there_is_a_cpu_a_gpu_and_a_per_stage_precision_example() -> None:
    assert {p.name for p in EXAMPLES} == {"qwendeployment-cpu.yaml", "qwendeployment-gpu.yaml",
                                          "qwendeployment-w4a16-decode.yaml"}


@pytest.mark.parametrize("bad", [
    {"model": {}},
    {"model": {"name": "m"}, "kvTransfer": {"mode": "carrier-pigeon"}},
    {"model": {"name": "m"}, "stages": {"decode": {"replicas": -1}}},
    {"model": {"name": "m"}, "stages": {"decode": {"autoscaling": {"targetKVUsage": 1.5}}}},
    {"model": {"name": "m"}, "slo": {"ttftSeconds": 0}},
    {"model": {"name": "m"}, "unknownField": 1},
    {"model": {"name": "m"}, "stages": {"decode": {"model": {"name": "awq", "source": "s3"}}}},
    {"model": {"name": "m"}, "stages": {"decode": {"model": {"source": "hf", "hf": {"repo": "Qwen/x"}}}}},
])
def test_schema_rejects_invalid_specs(bad: dict[str, Any]) -> None:
    obj = {"apiVersion": "qwenserve.io/v1alpha1", "kind": "QwenDeployment", "metadata": {"name": "x"}, "spec": bad}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(_strict(crd.openapi_schema())).validate(obj)


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    # The API server prunes unknown fields; in plain JSON Schema that is additionalProperties: false.
    out = dict(schema)
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
    return out


def test_a_too_long_name_is_rejected_services_need_room_for_the_stage_suffix() -> None:
    obj = {"apiVersion": "qwenserve.io/v1alpha1", "kind": "QwenDeployment",
           "metadata": {"name": "x" * 53}, "spec": {"model": {"name": "m"}}}
    with pytest.raises(jsonschema.ValidationError):
        _object_validator().validate(obj)
