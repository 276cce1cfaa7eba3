"""The Kubernetes API emulator behaves like an API server for kopf, the client and kubectl."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import kopf
import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.support.kube.store import Store
from tests.support.kube_emulator import KubeApi, KubeEmulator, kube_api

GROUP, VERSION, PLURAL = "lorarl.dev", "v1alpha1", "lorarljobs"
LRJ = f"{GROUP}/{VERSION}/{PLURAL}"
BASE = f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}"
TABLE = "application/json;as=Table;g=meta.k8s.io;v=v1"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "plural": PLURAL,
            "singular": "lorarljob",
            "kind": "LoRARLJob",
            "shortNames": ["lrj"],
            "categories": ["all", "lorarl"],
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.rollout.replicas",
                        "statusReplicasPath": ".status.rolloutReplicas",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {
                        "name": "Ready",
                        "type": "string",
                        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                    },
                    {"name": "Rollouts", "type": "integer", "jsonPath": ".spec.rollout.replicas"},
                ],
            }
        ],
    },
}


def job(name: str, replicas: int = 1, **labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = labels
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LoRARLJob",
        "metadata": meta,
        "spec": {"rollout": {"replicas": replicas}},
    }


@pytest.fixture
def kube() -> Iterator[KubeApi]:
    with kube_api(crds=[CRD]) as api:
        yield api
        assert api.emulator.errors == []  # no request hit an emulator bug (a 500)


@pytest.fixture
def http(kube: KubeApi) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=kube.url, timeout=10, headers={"Authorization": f"Bearer {kube.token}"}
    ) as session:
        yield session


@pytest.fixture
def custom(kube: KubeApi) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube.api_client())


@pytest.fixture
def core(kube: KubeApi) -> client.CoreV1Api:
    return client.CoreV1Api(kube.api_client())


def merge_patch(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    return http.patch(
        path, content=json.dumps(body), headers={"Content-Type": "application/merge-patch+json"}
    )


# -- object bookkeeping ----------------------------------------------------------------------


def test_create_answers_201_with_server_filled_metadata(http: httpx.Client) -> None:
    body = job("a")
    body["status"] = {"phase": "Faked"}  # a status subresource: ignored on create
    reply = http.post(BASE, json=body)
    assert reply.status_code == 201
    meta = reply.json()["metadata"]
    uuid4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert re.fullmatch(uuid4, meta["uid"])
    assert meta["resourceVersion"].isdigit()
    assert meta["generation"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert meta["namespace"] == "default"
    assert "status" not in reply.json()
    assert http.get(f"{BASE}/a").json() == reply.json()


def test_duplicate_name_is_409_already_exists(custom: client.CustomObjectsApi) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job("dup"))
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job("dup"))
    assert err.value.status == 409
    assert json.loads(err.value.body)["reason"] == "AlreadyExists"


def test_generate_name_makes_unique_names(http: httpx.Client) -> None:
    body = {"kind": "LoRARLJob", "metadata": {"generateName": "run-"}, "spec": {}}
    names = {http.post(BASE, json=body).json()["metadata"]["name"] for _ in range(3)}
    assert len(names) == 3
    assert all(re.fullmatch(r"run-[a-z0-9]{5}", n) for n in names)
    missing = http.post(BASE, json={"metadata": {}, "spec": {}})
    assert missing.status_code == 422
    assert "name or generateName is required" in missing.json()["message"]


def test_resource_version_is_global_and_monotonic(http: httpx.Client) -> None:
    rv1 = int(http.post(BASE, json=job("a")).json()["metadata"]["resourceVersion"])
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    rv2 = int(
        http.post("/api/v1/namespaces/default/pods", json=pod).json()["metadata"]["resourceVersion"]
    )
    patched = merge_patch(http, f"{BASE}/a", {"spec": {"x": 1}})
    rv3 = int(patched.json()["metadata"]["resourceVersion"])
    assert rv1 < rv2 < rv3
    assert http.get(BASE).json()["metadata"]["resourceVersion"] == str(rv3)
    pods = http.get("/api/v1/namespaces/default/pods").json()
    assert (pods["kind"], pods["apiVersion"]) == ("PodList", "v1")  # the core group is plain v1
    assert pods["items"][0]["apiVersion"] == "v1"


def test_generation_moves_on_spec_changes_only(http: httpx.Client) -> None:
    http.post(BASE, json=job("a"))
    after_spec = merge_patch(http, f"{BASE}/a", {"spec": {"rollout": {"replicas": 2}}}).json()
    assert after_spec["metadata"]["generation"] == 2
    after_label = merge_patch(http, f"{BASE}/a", {"metadata": {"labels": {"x": "y"}}}).json()
    assert after_label["metadata"]["generation"] == 2
    assert int(after_label["metadata"]["resourceVersion"]) > int(
        after_spec["metadata"]["resourceVersion"]
    )
    after_status = merge_patch(http, f"{BASE}/a/status", {"status": {"phase": "Running"}}).json()
    assert after_status["metadata"]["generation"] == 2
    # A write that changes nothing keeps the resourceVersion (and emits no watch event).
    noop = merge_patch(http, f"{BASE}/a", {"metadata": {"labels": {"x": "y"}}}).json()
    assert noop["metadata"]["resourceVersion"] == after_status["metadata"]["resourceVersion"]


def test_status_subresource_splits_writes(http: httpx.Client) -> None:
    http.post(BASE, json=job("a"))
    main = merge_patch(
        http, f"{BASE}/a", {"spec": {"rollout": {"replicas": 5}}, "status": {"phase": "Hacked"}}
    ).json()
    assert main["spec"]["rollout"]["replicas"] == 5
    assert "status" not in main
    status = merge_patch(
        http,
        f"{BASE}/a/status",
        {"spec": {"rollout": {"replicas": 9}}, "status": {"phase": "Running"}},
    ).json()
    assert status["status"] == {"phase": "Running"}
    assert status["spec"]["rollout"]["replicas"] == 5
    # PUT on the main resource keeps the stored status whatever the body says.
    replaced = http.put(f"{BASE}/a", json={**job("a", replicas=7), "status": {}}).json()
    assert replaced["status"] == {"phase": "Running"}


def test_stale_resource_version_conflicts_on_patch_and_put(http: httpx.Client) -> None:
    created = http.post(BASE, json=job("a", team="x")).json()
    stale = created["metadata"]["resourceVersion"]
    merge_patch(http, f"{BASE}/a", {"spec": {"rollout": {"replicas": 2}}})
    patched = merge_patch(
        http,
        f"{BASE}/a",
        {"metadata": {"resourceVersion": stale}, "spec": {"rollout": {"replicas": 3}}},
    )
    assert patched.status_code == 409
    assert patched.json()["reason"] == "Conflict"
    put_stale = http.put(f"{BASE}/a", json={**created, "spec": {"other": True}})
    assert put_stale.status_code == 409
    current = http.get(f"{BASE}/a").json()
    replacement = {
        **current,
        "metadata": {**current["metadata"], "labels": {"new": "yes"}},
        "spec": {"other": True},
    }
    put = http.put(f"{BASE}/a", json=replacement)
    assert put.status_code == 200
    assert put.json()["spec"] == {"other": True}  # a replace, not a merge
    assert put.json()["metadata"]["labels"] == {"new": "yes"}


def test_failed_json_patch_test_is_422(http: httpx.Client) -> None:
    """kopf guards JSON patches with a `test` of the resourceVersion and expects a 422."""
    http.post(BASE, json=job("a"))
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
        {"op": "add", "path": "/metadata/finalizers", "value": ["f"]},
    ]
    reply = http.patch(
        f"{BASE}/a",
        content=json.dumps(ops),
        headers={"Content-Type": "application/json-patch+json"},
    )
    assert reply.status_code == 422
    assert "finalizers" not in http.get(f"{BASE}/a").json()["metadata"]


def test_unsupported_requests_are_clear_errors(http: httpx.Client) -> None:
    http.post(BASE, json=job("a"))
    smp = http.patch(
        f"{BASE}/a",
        content="{}",
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    assert smp.status_code == 415
    bad_selector = http.get(BASE, params={"labelSelector": "a in b"})
    assert bad_selector.status_code == 400
    assert "'a in b'" in bad_selector.json()["message"]
    bad_field = http.get(BASE, params={"fieldSelector": "spec.x=1"})
    assert bad_field.status_code == 400
    assert "spec.x" in bad_field.json()["message"]
    assert http.get("/apis/nope.dev/v1/things").status_code == 404
    assert http.get(f"{BASE}/missing").json()["reason"] == "NotFound"


# -- lists, selectors, watches ---------------------------------------------------------------


def test_lists_carry_kind_api_version_and_resource_version(
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job("a"))
    listed = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)
    assert (listed["kind"], listed["apiVersion"]) == ("LoRARLJobList", f"{GROUP}/{VERSION}")
    assert [i["metadata"]["name"] for i in listed["items"]] == ["a"]
    assert listed["metadata"]["resourceVersion"].isdigit()
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="team-b")))
    namespaces = core.list_namespace()  # GET /api/v1/namespaces
    assert sorted(n.metadata.name for n in namespaces.items) == ["default", "team-b"]
    assert core.read_namespace("team-b").metadata.uid


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("team=a", {"j1", "j2"}),
        ("team==a,size=big", {"j1"}),
        ("team!=a", {"j3", "j4"}),  # includes the object without the label
        ("team in (a,b)", {"j1", "j2", "j3"}),
        ("team notin (a)", {"j3", "j4"}),
        ("size", {"j1", "j3"}),
        ("!size", {"j2", "j4"}),
        ("team in (b),size", {"j3"}),
    ],
)
def test_label_selectors(
    kube: KubeApi, custom: client.CustomObjectsApi, selector: str, expected: set[str]
) -> None:
    for name, labels in [
        ("j1", {"team": "a", "size": "big"}),
        ("j2", {"team": "a"}),
        ("j3", {"team": "b", "size": "small"}),
        ("j4", {}),
    ]:
        kube.emulator.create(LRJ, job(name, **labels))
    listed = custom.list_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, label_selector=selector
    )
    assert {i["metadata"]["name"] for i in listed["items"]} == expected


def test_watch_streams_json_events_and_resumes(
    kube: KubeApi, http: httpx.Client, custom: client.CustomObjectsApi
) -> None:
    start_rv = http.get(BASE).json()["metadata"]["resourceVersion"]
    kube.emulator.create(LRJ, job("w1", team="a"))
    kube.emulator.patch(LRJ, "default", "w1", {"spec": {"rollout": {"replicas": 2}}})
    kube.emulator.create(LRJ, job("w2", team="b"))
    kube.emulator.patch(LRJ, "default", "w2", {"metadata": {"labels": {"team": "a"}}})
    kube.emulator.patch(LRJ, "default", "w1", {"metadata": {"labels": {"team": "c"}}})
    kube.emulator.delete(LRJ, "default", "w2")

    stream = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        "default",
        PLURAL,
        resource_version=start_rv,
        timeout_seconds=1,
    )
    seen = [(e["type"], e["object"]["metadata"]["name"]) for e in stream]
    assert seen == [
        ("ADDED", "w1"),
        ("MODIFIED", "w1"),
        ("ADDED", "w2"),
        ("MODIFIED", "w2"),
        ("MODIFIED", "w1"),
        ("DELETED", "w2"),
    ]

    # With a label selector, objects entering/leaving the selection are ADDED/DELETED.
    selected = watch.Watch().stream(
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        "default",
        PLURAL,
        resource_version=start_rv,
        label_selector="team=a",
        timeout_seconds=1,
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in selected] == [
        ("ADDED", "w1"),
        ("MODIFIED", "w1"),
        ("ADDED", "w2"),
        ("DELETED", "w1"),
        ("DELETED", "w2"),
    ]

    with http.stream("GET", BASE, params={"watch": "true", "timeoutSeconds": "1"}) as reply:
        assert reply.headers["content-type"].startswith("application/json")
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("ADDED", "w1")]


def test_live_watch_sees_writes_made_after_it_started(
    kube: KubeApi, custom: client.CustomObjectsApi
) -> None:
    events: list[tuple[str, str]] = []

    def consume() -> None:
        for event in watch.Watch().stream(
            custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            "default",
            PLURAL,
            timeout_seconds=2,
        ):
            events.append((event["type"], event["object"]["metadata"]["name"]))

    kube.emulator.create(LRJ, job("before"))
    consumer = threading.Thread(target=consume)
    consumer.start()
    wait_for(lambda: events == [("ADDED", "before")])
    kube.emulator.create(LRJ, job("after"))
    kube.emulator.delete(LRJ, "default", "before")
    consumer.join(timeout=10)
    assert events == [("ADDED", "before"), ("ADDED", "after"), ("DELETED", "before")]


def test_watch_from_an_expired_resource_version_gets_410() -> None:
    emulator = KubeEmulator(store=Store(log_size=3))
    with kube_api(crds=[CRD], emulator=emulator) as kube:
        for i in range(5):
            kube.emulator.create(LRJ, job(f"j{i}"))
        with httpx.stream(
            "GET", kube.url + BASE, params={"watch": "true", "resourceVersion": "1"}
        ) as reply:
            events = [json.loads(line) for line in reply.iter_lines() if line]
    assert [(e["type"], e["object"]["code"]) for e in events] == [("ERROR", 410)]


# -- deletion --------------------------------------------------------------------------------


def test_delete_returns_the_object_and_finalizers_gate_removal(http: httpx.Client) -> None:
    http.post(BASE, json={**job("a"), "metadata": {"name": "a", "finalizers": ["keep/me"]}})
    deleted = http.delete(f"{BASE}/a")
    assert deleted.status_code == 200
    assert deleted.json()["metadata"]["name"] == "a"
    marked = http.get(f"{BASE}/a").json()
    assert marked["metadata"]["deletionTimestamp"]
    add_more = merge_patch(http, f"{BASE}/a", {"metadata": {"finalizers": ["keep/me", "new"]}})
    assert add_more.status_code == 422
    released = merge_patch(http, f"{BASE}/a", {"metadata": {"finalizers": []}})
    assert released.status_code == 200
    assert http.get(f"{BASE}/a").status_code == 404

    http.post(BASE, json=job("plain"))
    assert http.delete(f"{BASE}/plain").json()["metadata"]["name"] == "plain"
    assert http.get(f"{BASE}/plain").status_code == 404


def test_core_events_can_be_posted(kube: KubeApi, core: client.CoreV1Api) -> None:
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="lrj-"),
        involved_object=client.V1ObjectReference(kind="LoRARLJob", name="a", namespace="default"),
        reason="Started",
        message="trainer pods created",
        type="Normal",
    )
    created = core.create_namespaced_event("default", event)
    assert created.metadata.name.startswith("lrj-")
    assert [(e["reason"], e["message"]) for e in kube.emulator.events("default")] == [
        ("Started", "trainer pods created")
    ]


# -- discovery, tables, scale, kubectl -------------------------------------------------------


def test_discovery_lists_groups_resources_and_subresources(http: httpx.Client) -> None:
    assert http.get("/api").json()["versions"] == ["v1"]
    assert http.get("/version").json()["gitVersion"].startswith("v1.")
    groups = {g["name"]: g for g in http.get("/apis").json()["groups"]}
    assert groups[GROUP]["preferredVersion"]["version"] == VERSION
    resources = {r["name"]: r for r in http.get(f"/apis/{GROUP}/{VERSION}").json()["resources"]}
    assert resources[PLURAL]["shortNames"] == ["lrj"]
    assert resources[PLURAL]["categories"] == ["all", "lorarl"]
    assert resources[PLURAL]["kind"] == "LoRARLJob"
    assert {"get", "list", "watch", "create", "patch", "delete"} <= set(resources[PLURAL]["verbs"])
    assert resources[f"{PLURAL}/status"]["kind"] == "LoRARLJob"
    assert (resources[f"{PLURAL}/scale"]["group"], resources[f"{PLURAL}/scale"]["kind"]) == (
        "autoscaling",
        "Scale",
    )
    core = {r["name"] for r in http.get("/api/v1").json()["resources"]}
    assert {"pods", "pods/status", "events", "namespaces"} <= core


def test_table_responses_evaluate_printer_columns(kube: KubeApi, http: httpx.Client) -> None:
    kube.emulator.create(LRJ, job("t", replicas=4))
    kube.emulator.patch(
        LRJ,
        "default",
        "t",
        {
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "Synced", "status": "False"},
                    {"type": "Ready", "status": "True"},
                ],
            }
        },
        subresource="status",
    )
    table = http.get(BASE, headers={"Accept": TABLE}).json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Phase", "Ready", "Rollouts"]
    assert table["rows"][0]["cells"] == ["t", "Running", "True", 4]
    assert table["rows"][0]["object"]["metadata"]["name"] == "t"


def test_kubectl_apply_get_scale_delete(kube: KubeApi) -> None:
    manifest = (
        f"apiVersion: {GROUP}/{VERSION}\nkind: LoRARLJob\nmetadata:\n  name: demo\n"
        "spec:\n  rollout:\n    replicas: 1\n"
    )
    applied = kube.kubectl("apply", "-f", "-", input=manifest)
    assert applied.returncode == 0, applied.stderr
    assert "lorarljob.lorarl.dev/demo created" in applied.stdout
    kube.emulator.patch(
        LRJ,
        "default",
        "demo",
        {"status": {"phase": "Training", "conditions": [{"type": "Ready", "status": "False"}]}},
        subresource="status",
    )

    got = kube.kubectl("get", "lrj")
    assert got.returncode == 0, got.stderr
    header, row = got.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "READY", "ROLLOUTS"]
    assert row.split() == ["demo", "Training", "False", "1"]

    scaled = kube.kubectl("scale", "lrj/demo", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    stored = kube.emulator.get(LRJ, "default", "demo")
    assert stored is not None
    assert stored["spec"]["rollout"]["replicas"] == 3
    assert stored["metadata"]["generation"] == 2
    assert stored["status"]["phase"] == "Training"

    deleted = kube.kubectl("delete", "lrj", "demo")
    assert deleted.returncode == 0, deleted.stderr
    assert kube.emulator.get(LRJ, "default", "demo") is None
    missing = kube.kubectl("get", "lrj", "demo")
    assert missing.returncode == 1
    assert 'lorarljobs.lorarl.dev "demo" not found' in missing.stderr


def test_scale_subresource_reads_and_writes_replica_paths(
    kube: KubeApi, http: httpx.Client
) -> None:
    kube.emulator.create(LRJ, job("s", replicas=2))
    kube.emulator.patch(LRJ, "default", "s", {"status": {"rolloutReplicas": 1}}, "status")
    scale = http.get(f"{BASE}/s/scale").json()
    assert (scale["kind"], scale["spec"], scale["status"]) == (
        "Scale",
        {"replicas": 2},
        {"replicas": 1},
    )
    stale = merge_patch(
        http, f"{BASE}/s/scale", {"metadata": {"resourceVersion": "1"}, "spec": {"replicas": 5}}
    )
    assert stale.status_code == 409
    negative = merge_patch(http, f"{BASE}/s/scale", {"spec": {"replicas": -1}})
    assert negative.status_code == 422
    assert "spec.replicas" in negative.json()["message"]


def test_crd_applied_through_kubectl_is_served(kube: KubeApi) -> None:
    crd = json.loads(
        json.dumps(CRD)
        .replace("lorarljobs", "widgets")
        .replace("LoRARLJob", "Widget")
        .replace("lorarljob", "widget")
        .replace('"lrj"', '"wd"')
    )
    applied = kube.kubectl("apply", "-f", "-", input=json.dumps(crd))
    assert applied.returncode == 0, applied.stderr
    assert (
        kube.kubectl(
            "wait", "--for=condition=Established", "crd/widgets.lorarl.dev", "--timeout=10s"
        ).returncode
        == 0
    )
    kube.emulator.create(f"{GROUP}/{VERSION}/widgets", {"metadata": {"name": "w"}})
    got = kube.kubectl("get", "wd", "-o", "name")
    assert got.stdout.strip() == "widget.lorarl.dev/w", got.stderr
    assert kube.kubectl("delete", "crd", "widgets.lorarl.dev").returncode == 0
    with httpx.Client(base_url=kube.url) as http:
        assert http.get(f"/apis/{GROUP}/{VERSION}/namespaces/default/widgets").status_code == 404
        assert http.get(BASE).status_code == 200  # the other CRD is still served


def test_add_crd_rejects_malformed_manifests(kube: KubeApi) -> None:
    broken = json.loads(json.dumps(CRD))
    del broken["spec"]["names"]["kind"]
    with pytest.raises(ValueError, match=r"spec\.names\.kind is required"):
        kube.add_crd(broken)


# -- playing the kubelet, the garbage collector and admission --------------------------------


def test_set_pod_phase_and_collect_garbage(kube: KubeApi, core: client.CoreV1Api) -> None:
    owner = kube.emulator.create(LRJ, job("owner"))
    other = kube.emulator.create(LRJ, job("other"))

    def ref(obj: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"],
        }

    for name, refs in [
        ("trainer-0", [ref(owner)]),
        ("shared", [ref(owner), ref(other)]),
        ("free", []),
    ]:
        kube.emulator.create(
            "v1/pods",
            {
                "metadata": {"name": name, "ownerReferences": refs},
                "spec": {"containers": [{"name": "main", "image": "i"}]},
            },
        )
    assert core.read_namespaced_pod("trainer-0", "default").status.phase == "Pending"

    kube.set_pod_phase(
        "default", "trainer-0", "Failed", exit_code=137, reason="OOMKilled", message="out of memory"
    )
    pod = core.read_namespaced_pod("trainer-0", "default")
    assert pod.status.phase == "Failed"
    terminated = pod.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason, terminated.message) == (
        137,
        "OOMKilled",
        "out of memory",
    )
    with pytest.raises(ValueError, match="phase must be one of"):
        kube.set_pod_phase("default", "trainer-0", "Exploded")

    kube.emulator.delete(LRJ, "default", "owner")
    assert kube.collect_garbage() == [("Pod", "default", "trainer-0")]
    remaining = {p.metadata.name: p for p in core.list_namespaced_pod("default").items}
    assert sorted(remaining) == ["free", "shared"]
    assert [r.name for r in remaining["shared"].metadata.owner_references] == ["other"]


def test_admission_hook_can_deny_writes(kube: KubeApi, custom: client.CustomObjectsApi) -> None:
    reviews: list[dict[str, Any]] = []

    def validate(review: dict[str, Any]) -> dict[str, Any]:
        reviews.append(review)
        replicas = review["request"]["object"]["spec"]["rollout"]["replicas"]
        allowed = replicas <= 4
        status = {} if allowed else {"code": 422, "message": "spec.rollout.replicas must be <= 4"}
        return {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": {"uid": review["request"]["uid"], "allowed": allowed, "status": status},
        }

    kube.emulator.add_admission_hook(validate, name="validate.lorarl.dev", resource="lrj")
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job("ok", 4))
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, job("no", 5))
    assert err.value.status == 422
    assert json.loads(err.value.body)["message"] == (
        'admission webhook "validate.lorarl.dev" denied the request: '
        "spec.rollout.replicas must be <= 4"
    )
    assert kube.emulator.get(LRJ, "default", "no") is None
    assert [(r["request"]["operation"], r["request"]["name"]) for r in reviews] == [
        ("CREATE", "ok"),
        ("CREATE", "no"),
    ]
    assert reviews[0]["request"]["resource"] == {
        "group": GROUP,
        "version": VERSION,
        "resource": PLURAL,
    }


def test_admission_review_omits_sub_resource_for_the_main_resource(
    kube: KubeApi, http: httpx.Client
) -> None:
    """A real API server leaves `subResource` out (omitempty) unless a subresource is written;
    kopf matches handlers on it, so an empty string here would hide a webhook bug."""
    requests: list[dict[str, Any]] = []

    def record(review: dict[str, Any]) -> dict[str, Any]:
        requests.append(review["request"])
        return {"uid": review["request"]["uid"], "allowed": True}

    kube.emulator.add_admission_hook(
        record, name="record.lorarl.dev", resource="lrj", subresources=(None, "status")
    )
    assert http.post(BASE, json=job("sub")).status_code == 201
    assert merge_patch(http, f"{BASE}/sub", {"spec": {"rollout": {"replicas": 2}}}).is_success
    assert merge_patch(http, f"{BASE}/sub/status", {"status": {"phase": "Running"}}).is_success

    assert [(r["operation"], r.get("subResource")) for r in requests] == [
        ("CREATE", None),
        ("UPDATE", None),
        ("UPDATE", "status"),
    ]
    create, update, status = requests
    for main in (create, update):
        assert "subResource" not in main and "requestSubResource" not in main
    assert status["requestSubResource"] == "status"
    assert status["object"]["status"] == {"phase": "Running"}
    assert update["object"]["spec"]["rollout"]["replicas"] == 2
    assert update["oldObject"]["spec"]["rollout"]["replicas"] == 1


def test_kmock_reactions_and_object_history_still_work(kube: KubeApi, http: httpx.Client) -> None:
    kube.emulator.create(LRJ, job("h"))
    kube.emulator.patch(LRJ, "default", "h", {"spec": {"rollout": {"replicas": 2}}})
    history = kube.emulator.objects[LRJ, "default", "h"].history
    assert [v["spec"]["rollout"]["replicas"] for v in history] == [1, 2]
    kube.emulator["get", re.compile(r".*/lorarljobs")] << 503  # fault injection via kmock's DSL
    assert http.get(BASE).status_code == 503
    assert http.get(f"{BASE}/h").status_code == 200


# -- a real kopf operator --------------------------------------------------------------------


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.05)


def test_kopf_operator_reacts_through_watch_and_status_subresource(kube: KubeApi) -> None:
    registry = kopf.OperatorRegistry()
    deleted = threading.Event()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=kube.url, token=kube.token, scheme="Bearer")

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = "lorarl.dev/test-finalizer"
        settings.watching.server_timeout = 5

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    def created(spec: kopf.Spec, patch: kopf.Patch, body: kopf.Body, **_: Any) -> None:
        patch.status["phase"] = "Accepted"
        patch.status["rollouts"] = spec["rollout"]["replicas"]
        kopf.info(body, reason="Accepted", message="job accepted")

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def removed(**_: Any) -> None:
        deleted.set()

    stop, ready = threading.Event(), threading.Event()
    operator = threading.Thread(
        target=lambda: asyncio.run(
            kopf.operator(
                registry=registry,
                standalone=True,
                namespaces=["default"],
                stop_flag=stop,
                ready_flag=ready,
            )
        ),
        daemon=True,
    )
    operator.start()
    try:
        assert ready.wait(20), "kopf did not start"
        kube.emulator.create(LRJ, job("kopfed", replicas=3))

        def status() -> dict[str, Any]:
            return (kube.emulator.get(LRJ, "default", "kopfed") or {}).get("status") or {}

        wait_for(lambda: status().get("phase") == "Accepted")
        stored = kube.emulator.get(LRJ, "default", "kopfed")
        assert stored is not None
        assert status()["rollouts"] == 3
        assert stored["metadata"]["finalizers"] == ["lorarl.dev/test-finalizer"]
        assert stored["metadata"]["generation"] == 1  # kopf wrote status and metadata only
        wait_for(lambda: [e["reason"] for e in kube.emulator.events("default")] == ["Accepted"])

        kube.emulator.delete(LRJ, "default", "kopfed")  # marked: kopf's finalizer holds it
        assert deleted.wait(15)
        wait_for(lambda: kube.emulator.get(LRJ, "default", "kopfed") is None)
    finally:
        stop.set()
        operator.join(timeout=15)
    assert not operator.is_alive()
