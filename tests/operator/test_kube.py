"""The operator's Kubernetes calls through the official client, against the kmock emulator."""

from __future__ import annotations

import kopf
import pytest

from qwenserve_operator.kube import KubeClient, KubeError, configuration

CONFIGMAPS = "v1/configmaps"
NAMESPACE = "ns1"


def test_configuration_uses_the_login_token_and_certificate_files() -> None:
    info = kopf.ConnectionInfo(server="https://10.0.0.1:6443/", token="secret", ca_path="/sa/ca.crt",
                               certificate_path="/c/tls.crt", private_key_path="/c/tls.key")
    config = configuration(info)
    assert config.host == "https://10.0.0.1:6443" and config.verify_ssl is True
    assert config.auth_settings()["BearerToken"]["value"] == "Bearer secret"
    assert (config.ssl_ca_cert, config.cert_file, config.key_file) == ("/sa/ca.crt", "/c/tls.crt", "/c/tls.key")


def test_an_inline_client_certificate_is_refused_instead_of_written_to_a_file() -> None:
    with pytest.raises(KubeError, match="as files \\(ca_path"):
        configuration(kopf.ConnectionInfo(server="https://k", certificate_data=b"PEM", private_key_data=b"KEY"))


async def test_calls_return_json_and_errors_carry_the_status(k8s) -> None:
    kube = KubeClient(kopf.ConnectionInfo(server=str(k8s.url).rstrip("/")))
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"a": "1"},
                "metadata": {"name": "one", "namespace": NAMESPACE, "labels": {"team": "x", "tier": "y"}}}
    assert await kube.get("ConfigMap", NAMESPACE, "one") is None
    created = await kube.create(manifest)
    assert created["data"] == {"a": "1"} and created["metadata"]["uid"]
    patched = await kube.merge_patch("ConfigMap", NAMESPACE, "one", {"data": {"b": "2"}})
    assert patched["data"] == {"a": "1", "b": "2"}
    assert [item["metadata"]["name"] for item in await kube.list("ConfigMap", NAMESPACE, {"team": "x"})] == ["one"]
    assert await kube.list("ConfigMap", NAMESPACE, {"team": "other"}) == []
    with pytest.raises(KubeError) as missing:
        await kube.merge_patch("ConfigMap", NAMESPACE, "absent", {"data": {}})
    assert missing.value.status == 404
    await kube.close()
    with pytest.raises(KubeError, match="closed"):
        await kube.get("ConfigMap", NAMESPACE, "one")


async def test_a_manifest_the_clients_schema_refuses_is_a_kube_error(k8s) -> None:
    kube = KubeClient(kopf.ConnectionInfo(server=str(k8s.url).rstrip("/")))
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "dataa": {"a": "1"},
                "metadata": {"name": "typo", "namespace": NAMESPACE}}
    with pytest.raises(KubeError, match="dataa") as refused:
        await kube.create(manifest)
    assert refused.value.status == 422
    await kube.close()
