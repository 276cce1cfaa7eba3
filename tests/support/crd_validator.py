"""What the API server does with a custom resource, from the generated CRD alone.

Strict field validation (kubectl's default) against the structural schema, defaulting, then every
`x-kubernetes-validations` rule evaluated with a real CEL engine (cel-python). Used to prove that
the CRD and the pydantic models accept and reject the same manifests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import celpy
import jsonschema


@dataclass
class CrdVerdict:
    schema_errors: list[str] = field(default_factory=list)
    rule_failures: list[tuple[str, str]] = field(default_factory=list)  # (path, rule)
    rules_evaluated: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return not self.schema_errors and not self.rule_failures


class CrdValidator:
    def __init__(self, crd: dict[str, Any]):
        self.schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        self._json_schema = to_json_schema(self.schema)
        self._cel = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def all_rules(self) -> list[str]:
        out: list[str] = []
        _walk_rules(self.schema, out)
        return out

    def validate(self, manifest: dict[str, Any]) -> CrdVerdict:
        verdict = CrdVerdict()
        validator = jsonschema.Draft202012Validator(self._json_schema)
        for err in validator.iter_errors(manifest):
            verdict.schema_errors.append(f"{'.'.join(map(str, err.path))}: {err.message}")
        if verdict.schema_errors:
            return verdict  # the API server stops before CEL when the shape is wrong
        obj = apply_defaults(self.schema, copy.deepcopy(manifest))
        self._eval_rules(self.schema, obj, "", verdict)
        return verdict

    def _eval_rules(self, schema: dict, value: Any, path: str, verdict: CrdVerdict) -> None:
        if value is None:
            return
        for rule in schema.get("x-kubernetes-validations", []):
            verdict.rules_evaluated.append(rule["rule"])
            if not self._run(rule["rule"], value, schema):
                verdict.rule_failures.append((path, rule["rule"]))
        if isinstance(value, dict):
            for key, sub in schema.get("properties", {}).items():
                if key in value:
                    self._eval_rules(sub, value[key], f"{path}.{key}", verdict)
        if isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                self._eval_rules(schema["items"], item, f"{path}[{i}]", verdict)

    def _run(self, rule: str, value: Any, schema: dict) -> bool:
        program = self._programs.get(rule)
        if program is None:
            program = self._cel.program(self._cel.compile(rule))
            self._programs[rule] = program
        try:
            result = program.evaluate({"self": celpy.json_to_cel(_typed(schema, value))})
        except celpy.CELEvalError:
            return False  # an evaluation error rejects the object, as in the API server
        return bool(result)


def to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 structural schema -> JSON Schema, with unknown fields forbidden (strict)."""
    out: dict[str, Any] = {}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    elif "type" in node:
        out["type"] = [node["type"], "null"] if node.get("nullable") else node["type"]
    for key in ("enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems",
                "maxItems", "required"):  # fmt: skip
        if key in node:
            out[key] = copy.deepcopy(node[key])
    if out.get("enum") is not None and node.get("nullable"):
        out["enum"] = [*out["enum"], None]
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node:  # OpenAPI v3.0 booleans vs. JSON Schema numbers
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            if isinstance(node[key], bool):
                if node[key]:
                    out[key] = out.pop(bound)
            else:
                out[key] = node[key]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    return out


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], v) for v in value]
    return value


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """CEL is strictly typed: fields declared `number` are doubles even when written as 32."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: _typed(props.get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items", {}), v) for v in value]
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _walk_rules(schema: dict[str, Any], out: list[str]) -> None:
    out += [r["rule"] for r in schema.get("x-kubernetes-validations", [])]
    for sub in schema.get("properties", {}).values():
        _walk_rules(sub, out)
    if "items" in schema:
        _walk_rules(schema["items"], out)
