"""The CRD's verdict on a manifest, from the real API server: a server-side dry-run create
(schema, defaults, CEL rules; nothing stored). What tests compare the pydantic models against."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from harness.cluster.controlplane import ControlPlane


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    status: int
    message: str
    body: dict[str, Any]


class CrdServer:
    """LoRARLJob dry-run creates in one namespace of a control plane with the CRD installed."""

    def __init__(self, cp: ControlPlane, namespace: str = "crd-verdicts") -> None:
        if cp.kubectl("get", "namespace", namespace).returncode != 0:
            cp.create_namespace(namespace)
        self.namespace = namespace
        self.http: httpx.Client = cp.http()
        self.url = f"/apis/lorarl.dev/v1alpha1/namespaces/{namespace}/lorarljobs"

    def validate(self, doc: dict[str, Any]) -> Verdict:
        doc = json.loads(json.dumps(doc))
        doc.setdefault("metadata", {})["namespace"] = self.namespace
        reply = self.http.post(
            self.url, params={"dryRun": "All", "fieldValidation": "Strict"}, json=doc
        )
        if reply.status_code not in (201, 400, 422):
            raise AssertionError(f"unexpected answer {reply.status_code}: {reply.text[:500]}")
        body = reply.json()
        return Verdict(reply.status_code == 201, reply.status_code, body.get("message", ""), body)

    def close(self) -> None:
        self.http.close()
