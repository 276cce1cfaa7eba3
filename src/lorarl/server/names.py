"""The namespace and job name a caller puts in a URL, checked before they reach a store.

They end up as path segments of Kubernetes API URLs and in a trainer's host name; a name such
as `.` or `..` would be collapsed by URL normalisation into a different request (a `get` turned
into a namespace-wide `list`). Kubernetes itself only accepts DNS-1123 names, so anything else
cannot name a job and is refused with a message naming the parameter.
"""

from __future__ import annotations

import re

from lorarl.api.spec.k8s import DNS1123_LABEL, DNS1123_SUBDOMAIN

NAMESPACE_MAX = 63
NAME_MAX = 253
_LABEL = re.compile(DNS1123_LABEL)
_SUBDOMAIN = re.compile(DNS1123_SUBDOMAIN)
_RULE = "lowercase letters, digits and '-', starting and ending with a letter or digit"


def _shown(value: str) -> str:
    return repr(value if len(value) <= 70 else value[:64] + "...")


def namespace_problem(value: str, field: str = "namespace") -> str | None:
    """Why `value` is not a namespace (a DNS-1123 label), or None."""
    if len(value) <= NAMESPACE_MAX and _LABEL.fullmatch(value):
        return None
    return f"{field} {_shown(value)}: must be a DNS-1123 label ({_RULE}; at most 63 characters)"


def name_problem(value: str, field: str = "name") -> str | None:
    """Why `value` is not an object name (a DNS-1123 subdomain), or None."""
    if len(value) <= NAME_MAX and _SUBDOMAIN.fullmatch(value):
        return None
    return (
        f"{field} {_shown(value)}: must be a DNS-1123 subdomain ({_RULE}, in '.'-separated "
        "parts; at most 253 characters)"
    )
