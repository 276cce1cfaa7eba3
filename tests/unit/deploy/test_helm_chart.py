"""The Helm chart: lint, render under every feature switch, schema-validate, least privilege,
restricted security contexts, and a working self-signed webhook certificate.

Rendering uses the Helm v4 SDK (helm-python-sdk), offline: `lookup` returns nothing there, so
the self-signed branch always generates a fresh CA.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorarl.operator.config import OperatorConfig

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "lorarl"
NS = "lorarl-system"
KUBE_VERSIONS = ("1.30", "1.34")

# Kinds whose schema lives in a third-party CRD: kubernetes-validate has no schema for them, so
# only their apiVersion/kind are checked.
CRD_BACKED = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}

ALL_ON: dict[str, Any] = {
    "imagePullSecrets": [{"name": "ghcr-pull"}],
    "webhook": {"certManager": {"enabled": True}},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "networkPolicy": {
        "enabled": True,
        "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        "statusApiFrom": [{"namespaceSelector": {"matchLabels": {"name": "ingress-nginx"}}}],
    },
    "statusApi": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "tls": [{"secretName": "lorarl-tls", "hosts": ["lorarl.example.com"]}],
        },
        "podAnnotations": {"example.com/a": "b"},
    },
    "operator": {
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "pool", "operator": "In", "values": ["system"]}
                            ]
                        }
                    ]
                }
            }
        },
        "priorityClassName": "system-cluster-critical",
        "extraEnv": [
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}},
            }
        ],
    },
}
SINGLE_NS: dict[str, Any] = {"singleNamespace": True}
SCENARIOS = {
    "defaults": {},
    "all-on": ALL_ON,
    "single-namespace": SINGLE_NS,
    "single-namespace-all-on": {**ALL_ON, **SINGLE_NS},
    "webhook-off": {"webhook": {"enabled": False}, "statusApi": {"enabled": False}},
    "cert-manager-issuer-ref": {
        "webhook": {
            "certManager": {
                "enabled": True,
                "issuerRef": {
                    "name": "corp-ca",
                    "kind": "ClusterIssuer",
                    "group": "cert-manager.io",
                },
            }
        }
    },
}

# Least privilege: exactly these (apiGroup, resource, verb) triples, per role, nothing more.
OPERATOR_RULES = {
    # delete: a finished job is removed after spec.runPolicy.ttlSecondsAfterFinished.
    ("lorarl.dev", "lorarljobs"): {"get", "list", "watch", "patch", "delete"},
    ("lorarl.dev", "lorarljobs/status"): {"get", "patch"},
    ("lorarl.dev", "lorarljobs/finalizers"): {"update"},
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "delete"},
    ("", "configmaps"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "secrets"): {"create"},
    ("", "events"): {"create"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "delete"},
    ("scheduling.x-k8s.io", "podgroups"): {"get", "create", "delete"},
    ("scheduling.volcano.sh", "podgroups"): {"get", "create", "delete"},
}
STATUS_API_JOB_RULES = {("lorarl.dev", "lorarljobs"): {"get", "list", "watch"}}
STATUS_API_AUTH_RULES = {
    ("authentication.k8s.io", "tokenreviews"): {"create"},
    ("authorization.k8s.io", "subjectaccessreviews"): {"create"},
}


def render_chart(
    values: dict[str, Any] | None = None, *, name: str = "lorarl", namespace: str = NS
) -> list[dict[str, Any]]:
    """Every object the chart renders (templates and test hooks; CRDs excluded)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    return [
        doc
        for path, text in sorted(out.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def render_notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values or {}, name="lorarl", namespace=NS, is_install=True)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def validate_manifest(obj: dict[str, Any], version: str) -> None:
    """Schema-validate one object (strict: unknown fields fail) against a Kubernetes version."""
    if (obj["apiVersion"], obj["kind"]) in CRD_BACKED:
        assert obj["metadata"].get("name"), obj
        return
    kubernetes_validate.validate(obj, version, strict=True)


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def pod_specs(objs: list[dict]) -> list[tuple[str, dict]]:
    """(object name, pod spec) of every Deployment and bare Pod."""
    specs = []
    for o in objs:
        if o["kind"] == "Pod":
            specs.append((o["metadata"]["name"], o["spec"]))
        elif o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            specs.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
    return specs


def granted(role: dict) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def env_of(container: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {key: render_chart(values) for key, values in SCENARIOS.items()}


# --- lint and schema -------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lint_strict_is_clean(scenario):
    report = helm.lint(CHART, SCENARIOS[scenario], strict=True, namespace=NS)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_manifest_validates(rendered, scenario, version):
    objs = rendered[scenario]
    assert objs
    for obj in objs:
        validate_manifest(obj, version)


def test_schema_validation_catches_a_bad_field(rendered):
    """Guards the guard: strict validation must reject an unknown field."""
    deployment = dict(one(rendered["defaults"], "Deployment", "lorarl-operator"))
    deployment["spec"] = {**deployment["spec"], "replica": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(deployment, "1.30")


def test_feature_switches_add_their_objects(rendered):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered["all-on"]}
    assert ("ServiceMonitor", "lorarl-operator") in kinds
    assert ("Certificate", "lorarl-webhook") in kinds
    assert ("Issuer", "lorarl-selfsigned") in kinds
    assert ("Ingress", "lorarl-status-api") in kinds
    assert ("NetworkPolicy", "lorarl-operator") in kinds
    assert ("NetworkPolicy", "lorarl-status-api") in kinds
    defaults = {o["kind"] for o in rendered["defaults"]}
    assert not defaults & {"ServiceMonitor", "Certificate", "Issuer", "Ingress", "NetworkPolicy"}
    off = {o["kind"] for o in rendered["webhook-off"]}
    assert "ValidatingWebhookConfiguration" not in off and "Secret" not in off


# --- RBAC ------------------------------------------------------------------------------------


def test_cluster_wide_rbac_is_exactly_the_allow_list(rendered):
    objs = rendered["defaults"]
    assert not find(objs, "Role") and not find(objs, "RoleBinding")
    roles = {r["metadata"]["name"]: granted(r) for r in find(objs, "ClusterRole")}
    assert roles == {
        f"lorarl-{NS}-operator": OPERATOR_RULES,
        f"lorarl-{NS}-status-api": STATUS_API_JOB_RULES,
        f"lorarl-{NS}-status-api-auth": STATUS_API_AUTH_RULES,
    }
    bound = {
        b["roleRef"]["name"]: [(s["kind"], s["name"], s["namespace"]) for s in b["subjects"]]
        for b in find(objs, "ClusterRoleBinding")
    }
    assert bound == {
        f"lorarl-{NS}-operator": [("ServiceAccount", "lorarl-operator", NS)],
        f"lorarl-{NS}-status-api": [("ServiceAccount", "lorarl-status-api", NS)],
        f"lorarl-{NS}-status-api-auth": [("ServiceAccount", "lorarl-status-api", NS)],
    }


@pytest.mark.parametrize("scenario", ["single-namespace", "single-namespace-all-on"])
def test_single_namespace_rbac_stays_in_the_release_namespace(rendered, scenario):
    objs = rendered[scenario]
    roles = {
        (r["metadata"]["name"], r["metadata"]["namespace"]): granted(r) for r in find(objs, "Role")
    }
    assert roles == {
        ("lorarl-operator", NS): OPERATOR_RULES,
        ("lorarl-status-api", NS): STATUS_API_JOB_RULES,
    }
    # The only cluster-wide grant left: TokenReview/SubjectAccessReview are cluster-scoped.
    cluster = {r["metadata"]["name"]: granted(r) for r in find(objs, "ClusterRole")}
    assert cluster == {f"lorarl-{NS}-status-api-auth": STATUS_API_AUTH_RULES}
    for binding in find(objs, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["metadata"]["namespace"] == NS
    for name in ("lorarl-operator", "lorarl-status-api"):
        container = one(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert env_of(container)["LORARL_NAMESPACE"] == NS
    webhook = one(objs, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert webhook["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NS}}


def test_cluster_wide_mode_watches_every_namespace(rendered):
    for name in ("lorarl-operator", "lorarl-status-api"):
        container = one(rendered["defaults"], "Deployment", name)["spec"]["template"]["spec"][
            "containers"
        ][0]
        assert env_of(container)["LORARL_NAMESPACE"] == ""
    webhook = one(rendered["defaults"], "ValidatingWebhookConfiguration")["webhooks"][0]
    assert "namespaceSelector" not in webhook


# --- pod security ----------------------------------------------------------------------------


def assert_restricted(where: str, pod: dict) -> None:
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True, where
    assert psc["runAsUser"] > 0, where
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
    assert "hostNetwork" not in pod and "hostPID" not in pod, where
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        at = f"{where}/{c['name']}"
        assert sc.get("runAsNonRoot") is True, at
        assert sc.get("runAsUser", 0) > 0, at
        assert sc.get("readOnlyRootFilesystem") is True, at
        assert sc.get("allowPrivilegeEscalation") is False, at
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], at
        assert not sc.get("capabilities", {}).get("add"), at
        assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, at
        assert not sc.get("privileged"), at
        assert ":latest" not in c["image"] and (":" in c["image"] or "@" in c["image"]), at


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_container_is_restricted(rendered, scenario):
    specs = pod_specs(rendered[scenario])
    names = {name for name, _ in specs}
    assert "lorarl-test" in names  # the helm test pod is covered too
    for name, pod in specs:
        assert_restricted(f"{scenario}:{name}", pod)


def test_security_check_catches_a_root_container(rendered):
    _, pod = pod_specs(rendered["defaults"])[0]
    bad = {**pod, "containers": [{**pod["containers"][0], "securityContext": {"runAsUser": 0}}]}
    with pytest.raises(AssertionError):
        assert_restricted("bad", bad)


def test_read_only_root_gets_a_writable_tmp(rendered):
    for name in ("lorarl-operator", "lorarl-status-api"):
        pod = one(rendered["defaults"], "Deployment", name)["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]], name


SECRETISH = re.compile(r"TOKEN|PASSWORD|SECRET|API_KEY|PRIVATE", re.IGNORECASE)
NAMES_SECRETS = {"LORARL_ALLOWED_SECRETS"}  # Secret names (the admin's allow-list), no secret


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_secrets_reach_containers_only_via_secret_key_ref(rendered, scenario):
    for name, pod in pod_specs(rendered[scenario]):
        for c in pod["containers"]:
            assert not any("secretRef" in src for src in c.get("envFrom", [])), name
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]) and e["name"] not in NAMES_SECRETS:
                    assert set(e) == {"name", "valueFrom"}, (name, e)
                    assert set(e["valueFrom"]) == {"secretKeyRef"}, (name, e)
    operator = one(rendered["all-on"], "Deployment", "lorarl-operator")
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert env_of(container)["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}


# --- workloads -------------------------------------------------------------------------------


def test_operator_deployment_contract(rendered):
    dep = one(rendered["defaults"], "Deployment", "lorarl-operator")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "lorarl-operator"
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/lorarl/operator:0.1.0"
    assert c["command"] == ["python", "-m", "lorarl.operator"]
    assert env_of(c) == {
        "LORARL_NAMESPACE": "",
        "LORARL_WEBHOOK_PORT": "9443",
        "LORARL_METRICS_PORT": "8080",
        "LORARL_HEALTH_PORT": "8081",
        "LORARL_ALLOWED_PRIORITY_CLASSES": "",
        "LORARL_ALLOWED_SECRETS": "",
        "LORARL_ALLOW_CONTROL_PLANE_NODES": "false",
    }
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"webhook": 9443, "metrics": 8080, "health": 8081}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["webhook-certs"]["mountPath"] == "/tmp/k8s-webhook-server/serving-certs"
    volume = next(v for v in pod["volumes"] if v["name"] == "webhook-certs")
    assert volume["secret"]["secretName"] == "lorarl-webhook-tls"
    assert {i["path"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key"}


def test_webhook_off_turns_the_server_off(rendered):
    dep = one(rendered["webhook-off"], "Deployment", "lorarl-operator")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["LORARL_WEBHOOK_PORT"] == "0"
    assert "webhook" not in {p["name"] for p in c["ports"]}
    assert "webhook-certs" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert not find(rendered["webhook-off"], "Deployment", "lorarl-status-api")


def test_allowed_priority_classes_reach_the_operator_config():
    classes = ["training-low", "training-high"]
    objs = render_chart({"webhook": {"allowedPriorityClasses": classes}})
    (c,) = one(objs, "Deployment", "lorarl-operator")["spec"]["template"]["spec"]["containers"]
    config = OperatorConfig.from_env(env_of(c))
    assert config.allowed_priority_classes == tuple(classes)


def test_tenancy_values_reach_the_operator_config():
    """The Secrets jobs may read and whether their pods may reach control-plane nodes: the
    admin's, through the chart (docs/security.md)."""
    values = {"allowedSecrets": ["wandb", "research/*"], "allowControlPlaneNodes": True}
    objs = render_chart({"webhook": values})
    (c,) = one(objs, "Deployment", "lorarl-operator")["spec"]["template"]["spec"]["containers"]
    config = OperatorConfig.from_env(env_of(c))
    assert config.allowed_secrets == ("wandb", "research/*")
    assert config.allow_control_plane_nodes is True


def test_scheduling_and_pull_values_reach_the_pod(rendered):
    pod = one(rendered["all-on"], "Deployment", "lorarl-operator")["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == ALL_ON["imagePullSecrets"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert pod[key] == ALL_ON["operator"][key], key
    test_pod = one(rendered["all-on"], "Pod", "lorarl-test")
    assert test_pod["spec"]["imagePullSecrets"] == ALL_ON["imagePullSecrets"]


def test_image_tag_and_digest_overrides():
    objs = render_chart(
        {
            "image": {"registry": "registry.local", "tag": "9.9.9", "pullPolicy": "Always"},
            "statusApi": {"image": {"digest": "sha256:" + "a" * 64}},
        }
    )
    images = {
        name: (pod["containers"][0]["image"], pod["containers"][0]["imagePullPolicy"])
        for name, pod in pod_specs(objs)
    }
    assert images == {
        "lorarl-operator": ("registry.local/lorarl/operator:9.9.9", "Always"),
        "lorarl-status-api": ("registry.local/lorarl/operator@sha256:" + "a" * 64, "Always"),
        "lorarl-test": ("registry.local/lorarl/operator:9.9.9", "Always"),
    }


def test_status_api_service_and_ingress(rendered):
    objs = rendered["all-on"]
    pod = one(objs, "Deployment", "lorarl-status-api")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["python", "-m", "lorarl.server"]
    assert env_of(c)["LORARL_SERVER_PORT"] == "8000"
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    svc = one(objs, "Service", "lorarl-status-api")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    ingress = one(objs, "Ingress", "lorarl-status-api")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == ALL_ON["statusApi"]["ingress"]["tls"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "lorarl-status-api", "port": {"number": 8000}}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_services_select_pods_that_serve_their_ports(rendered, scenario):
    objs = rendered[scenario]
    pods = [
        (d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
        for d in find(objs, "Deployment")
    ]
    for svc in find(objs, "Service"):
        selector = svc["spec"]["selector"]
        matches = [spec for labels, spec in pods if selector.items() <= labels.items()]
        assert len(matches) == 1, svc["metadata"]["name"]
        named = {p["name"] for c in matches[0]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, (svc["metadata"]["name"], port)


def test_service_monitor_scrapes_only_the_metrics_service(rendered):
    objs = rendered["all-on"]
    monitor = one(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selector = monitor["spec"]["selector"]["matchLabels"]
    picked = [
        s["metadata"]["name"]
        for s in find(objs, "Service")
        if selector.items() <= s["metadata"]["labels"].items()
    ]
    assert picked == ["lorarl-operator-metrics"]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_network_policies_admit_only_served_ports(rendered):
    objs = rendered["all-on"]
    operator_pol = one(objs, "NetworkPolicy", "lorarl-operator")
    ports = [p["port"] for rule in operator_pol["spec"]["ingress"] for p in rule["ports"]]
    assert sorted(ports) == ["health", "metrics", "webhook"]
    metrics_rule = next(
        r for r in operator_pol["spec"]["ingress"] if r["ports"][0]["port"] == "metrics"
    )
    assert metrics_rule["from"] == ALL_ON["networkPolicy"]["metricsFrom"]
    api_pol = one(objs, "NetworkPolicy", "lorarl-status-api")
    (rule,) = api_pol["spec"]["ingress"]
    test_labels = one(objs, "Pod", "lorarl-test")["metadata"]["labels"]
    admitted = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
    assert any(sel.items() <= test_labels.items() for sel in admitted)


# --- webhook and certificates ----------------------------------------------------------------


def webhook_service_ok(objs: list[dict]) -> dict:
    """The webhook points at a Service that reaches the operator's webhook port."""
    (hook,) = one(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Fail"
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    (rule,) = hook["rules"]
    assert rule["apiGroups"] == ["lorarl.dev"] and rule["resources"] == ["lorarljobs"]
    assert sorted(rule["operations"]) == ["CREATE", "UPDATE"]
    ref = hook["clientConfig"]["service"]
    assert ref["path"] == "/validate-lorarljob"
    svc = one(objs, "Service", ref["name"])
    assert svc["metadata"]["namespace"] == ref["namespace"] == NS
    assert [p["port"] for p in svc["spec"]["ports"]] == [ref["port"]]
    assert svc["spec"]["ports"][0]["targetPort"] == "webhook"
    return hook


def test_self_signed_certificate_is_valid_for_the_webhook_service(rendered):
    x509 = pytest.importorskip("cryptography.x509")
    objs = rendered["defaults"]
    hook = webhook_service_ok(objs)
    secret = one(objs, "Secret", "lorarl-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"lorarl-webhook.{NS}.svc" in sans.get_values_for_type(x509.DNSName)
    key = base64.b64decode(secret["data"]["tls.key"]).decode()
    assert "PRIVATE KEY" in key
    assert "cert-manager.io/inject-ca-from" not in one(objs, "ValidatingWebhookConfiguration")[
        "metadata"
    ].get("annotations", {})


def test_cert_manager_issues_the_mounted_secret(rendered):
    objs = rendered["all-on"]
    hook = webhook_service_ok(objs)
    assert "caBundle" not in hook["clientConfig"]
    assert not find(objs, "Secret")
    cert = one(objs, "Certificate")
    vwc = one(objs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NS}/{cert['metadata']['name']}"
    )
    assert f"lorarl-webhook.{NS}.svc" in cert["spec"]["dnsNames"]
    pod = one(objs, "Deployment", "lorarl-operator")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "webhook-certs")
    assert volume["secret"]["secretName"] == cert["spec"]["secretName"]
    assert cert["spec"]["issuerRef"] == {
        "name": one(objs, "Issuer")["metadata"]["name"],
        "kind": "Issuer",
        "group": "cert-manager.io",
    }


def test_cert_manager_can_use_an_existing_issuer(rendered):
    objs = rendered["cert-manager-issuer-ref"]
    assert not find(objs, "Issuer")
    ref = SCENARIOS["cert-manager-issuer-ref"]["webhook"]["certManager"]["issuerRef"]
    assert one(objs, "Certificate")["spec"]["issuerRef"] == ref


# --- names, tests, docs, CRDs ----------------------------------------------------------------


def test_long_release_names_still_give_valid_names():
    release = "r" * 53  # Helm's maximum release name length
    objs = render_chart(SINGLE_NS, name=release, namespace="a-rather-long-namespace-name")
    for obj in objs:
        name = obj["metadata"]["name"]
        cluster_scoped = ("ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration")
        limit = 253 if obj["kind"] in cluster_scoped else 63
        assert len(name) <= limit and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
        validate_manifest(obj, "1.34")


def test_helm_test_pod_checks_the_crd_and_the_status_api(rendered):
    objs = rendered["defaults"]
    pod = one(objs, "Pod", "lorarl-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    sa = one(objs, "ServiceAccount", pod["spec"]["serviceAccountName"])
    assert sa["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # Discovery needs no RBAC, so the test pod's account is bound to nothing.
    for binding in find(objs, "RoleBinding") + find(objs, "ClusterRoleBinding"):
        assert sa["metadata"]["name"] not in {s["name"] for s in binding["subjects"]}
    (c,) = pod["spec"]["containers"]
    script = c["command"][2]
    compile(script, "helm-test", "exec")
    assert "/apis/lorarl.dev/v1alpha1" in script and '"lorarljobs"' in script
    assert env_of(c)["STATUS_API_URL"] == f"http://lorarl-status-api.{NS}.svc:8000/healthz"


def values_lines() -> list[str]:
    return (CHART / "values.yaml").read_text().splitlines()


def undocumented_values(lines: list[str]) -> list[str]:
    """Keys with no `# --` comment on themselves or an ancestor, and a leaf below them."""
    key_re = re.compile(r"^( *)([A-Za-z][\w.-]*):(.*)$")
    stack: list[tuple[int, str, bool]] = []  # (indent, key, documented)
    missing = []
    for i, line in enumerate(lines):
        m = key_re.match(line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        comment = []
        while j >= 0 and lines[j].strip().startswith("#"):
            comment.insert(0, lines[j].strip())
            j -= 1
        documented = bool(comment) and comment[0].startswith("# --")
        inherited = any(doc for _, _, doc in stack)
        path = ".".join([k for _, k, _ in stack] + [key])
        stack.append((indent, key, documented or inherited))
        following = [n for n in lines[i + 1 :] if n.strip() and not n.strip().startswith("#")]
        child = key_re.match(following[0]) if following else None
        is_leaf = rest != "" or not child or len(child.group(1)) <= indent
        if is_leaf and not (documented or inherited):
            missing.append(path)
    return missing


def test_every_value_is_documented():
    assert undocumented_values(values_lines()) == []
    assert undocumented_values(["a:", "  b: 1", "# -- doc", "c: 2"]) == ["a.b"]


def test_notes_explain_quickstart_and_token():
    notes = render_notes()
    # the cluster quickstart (claims, not this machine's paths), in a namespace for jobs
    assert "examples/quickstart-cluster.yaml" in notes and "examples/quickstart.yaml" not in notes
    assert "kubectl apply -n rl " in notes
    assert "create token" in notes and "Authorization: Bearer" in notes
    assert "port-forward svc/lorarl-status-api 8000:8000" in notes


def test_chart_crds_equal_the_generated_crds():
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert generated
    copied = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert copied == generated, "run: python scripts/sync_chart_crds.py"
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/lorarl/crds/{name} is stale: run python scripts/sync_chart_crds.py"
        )
    with helm.Chart.load(CHART) as chart:
        assert {c["filename"] for c in chart.crds} == {f"lorarl/crds/{n}" for n in generated}


def test_chart_version_matches_images():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == "0.1.0"
    from lorarl.plan.build import DEFAULT_IMAGES

    assert set(DEFAULT_IMAGES) == {"trainer", "rollout-sglang", "rollout-vllm", "reward"}
    for name, ref in DEFAULT_IMAGES.items():
        assert ref == f"ghcr.io/lorarl/{name}:{chart['appVersion']}"
