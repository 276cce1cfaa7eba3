"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

Strategic merge is approximated with the merge keys of the core types the project touches (pod
containers, env, volumes, conditions, ...); other lists are replaced, as in a merge patch.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch  # a dependency of kmock
import jsonpointer

from .errors import ApiError

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Field name -> merge key of list items, from the `patchMergeKey` tags of the core API types.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
}
# Lists of scalars with `patchStrategy: merge` (set union).
_PRIMITIVE_MERGE = frozenset({"finalizers"})


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, `null` deletes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge patch plus merge-by-key lists, `$patch: delete` and `$deleteFromPrimitiveList`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [v for v in result.get(field) or [] if v not in value]
        elif key.startswith("$"):
            continue  # $setElementOrder, $retainKeys: ordering/pruning hints only
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in _MERGE_KEYS:
            result[key] = _merge_keyed_list(result.get(key) or [], value, _MERGE_KEYS[key])
        elif isinstance(value, list) and key in _PRIMITIVE_MERGE:
            old = list(result.get(key) or [])
            result[key] = old + [v for v in value if v not in old]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _merge_keyed_list(old: list[Any], new: list[Any], merge_key: str) -> list[Any]:
    merged = [copy.deepcopy(item) for item in old]
    for item in new:
        if not isinstance(item, dict) or merge_key not in item:
            return copy.deepcopy(new)  # not a keyed list after all: replace like a merge patch
        index = next(
            (
                i
                for i, cur in enumerate(merged)
                if isinstance(cur, dict) and cur.get(merge_key) == item[merge_key]
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                merged.pop(index)
        elif index is None:
            merged.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            merged[index] = strategic_merge_patch(merged[index], item)
    return merged


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902; a failed `test` (kopf's resourceVersion guard) or a bad op is a 422."""
    if not isinstance(ops, list):
        raise ApiError(400, "BadRequest", "json patch body must be a JSON array of operations")
    try:
        return jsonpatch.apply_patch(target, ops, in_place=False)
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise ApiError(
            422,
            "Invalid",
            f"the server rejected our request due to an error in our "
            f"request: json patch failed: {exc}",
        ) from exc


def apply_patch(content_type: str, target: dict[str, Any], body: Any) -> dict[str, Any]:
    """Dispatch on the PATCH Content-Type; unsupported types are a 415 as on a real server."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == JSON_PATCH:
        return json_patch(target, body)
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", f"{media} patch body must be a JSON object")
    if media == MERGE_PATCH:
        return merge_patch(target, body)
    if media == STRATEGIC_PATCH:
        return strategic_merge_patch(target, body)
    raise ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types "
        f"include: {JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_PATCH} (got {media!r}; "
        f"server-side apply is not emulated)",
    )
