"""kopf's annotation storages with a cheaper copy of the object.

On every event kopf builds the object's "essence" (spec, labels, annotations) to compare it
with the last handled one, and clears its own progress keys from a copy of it; both copies were
`copy.deepcopy` of the whole body, status included, which was the largest cost kopf itself
added per event at 200 jobs. Watch bodies are JSON data, so a pickle round trip of only the kept
parts gives the same essence (same keys, values and order) for a fraction of the CPU.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterable
from typing import Any, cast

import kopf
from kopf._cogs.structs import bodies, dicts

DROPPED = ("apiVersion", "kind", "metadata", "status")
KUBECTL_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def json_copy(value: Any) -> Any:
    """A deep copy of JSON data (what the API server sends): a pickle round trip, about four
    times cheaper than `copy.deepcopy` and cheaper than a JSON one, with the same result."""
    return pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))


class DiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """`AnnotationsDiffBaseStorage.build`, step for step, copying only what the essence keeps."""

    def build(
        self, *, body: bodies.Body, extra_fields: Iterable[dicts.FieldSpec] | None = None
    ) -> bodies.BodyEssence:
        essence = json_copy({k: v for k, v in body.items() if k not in DROPPED})
        dicts.cherrypick(
            src=body,
            dst=essence,
            fields=["metadata.labels", "metadata.annotations"],
            picker=json_copy,
        )
        annotations = essence.get("metadata", {}).get("annotations", {})
        ignored_prefixes = self._detect_marked_prefixes(annotations)
        for annotation in list(annotations):  # other kopf operators' keys, kubectl's copy
            prefix = annotation.split("/", 1)[0] if "/" in annotation else None
            if prefix in ignored_prefixes or annotation == KUBECTL_LAST_APPLIED:
                del annotations[annotation]
        dicts.cherrypick(src=body, dst=essence, fields=extra_fields, picker=json_copy)
        self.remove_empty_stanzas(cast(bodies.BodyEssence, essence))
        for ignored_field in self.ignored_fields:
            with contextlib.suppress(TypeError):  # a field that cannot be deleted stays
                dicts.remove(essence, ignored_field)
        self.remove_annotations(
            cast(bodies.BodyEssence, essence), set(self.make_keys(self.key, body=body))
        )
        self.remove_empty_stanzas(cast(bodies.BodyEssence, essence))
        return cast(bodies.BodyEssence, essence)


class ProgressStorage(kopf.AnnotationsProgressStorage):
    """`AnnotationsProgressStorage.clear` on a JSON copy of the essence."""

    def clear(self, *, essence: bodies.BodyEssence) -> bodies.BodyEssence:
        essence = cast(bodies.BodyEssence, json_copy(essence))
        annotations = essence.get("metadata", {}).get("annotations", {})
        keys = {key for key in annotations if self.prefix and key.startswith(f"{self.prefix}/")}
        self.remove_annotations(essence, keys)
        self.remove_empty_stanzas(essence)
        return essence
