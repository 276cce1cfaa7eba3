"""`python -m lorarl.server`: the in-cluster status API (the Helm chart's entry point).

Configuration from the environment, as the chart sets it: `LORARL_NAMESPACE` (empty: all
namespaces), `LORARL_SERVER_HOST`, `LORARL_SERVER_PORT`; flags override. Kubernetes credentials
come from the pod's service account. Local runs get their server from `lorarl run --local`, which
registers its jobs with a LocalStore instead.
"""

from __future__ import annotations

import argparse
import os

from lorarl.server.auth import KubeAuth
from lorarl.server.kube_api import KubeApi, KubeApiError
from lorarl.server.serve import serve
from lorarl.server.stores.kube import DEFAULT_PROGRESS_URL, KubeStore


def main(argv: list[str] | None = None) -> None:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m lorarl.server", description=__doc__)
    parser.add_argument("--host", default=env.get("LORARL_SERVER_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env.get("LORARL_SERVER_PORT", "8088")))
    parser.add_argument(
        "--namespace",
        default=env.get("LORARL_NAMESPACE", ""),
        help="serve only this namespace (default: all)",
    )
    parser.add_argument(
        "--progress-url",
        default=DEFAULT_PROGRESS_URL,
        help="trainer progress URL template with {name} and {namespace}",
    )
    parser.add_argument(
        "--auth-cache-seconds",
        type=float,
        default=10.0,
        help="how long TokenReview/SubjectAccessReview results are reused",
    )
    args = parser.parse_args(argv)
    try:
        api = KubeApi.in_cluster()
    except KubeApiError as exc:
        parser.error(str(exc))
    store = KubeStore(api, progress_url=args.progress_url, namespace=args.namespace or None)
    serve(store, auth=KubeAuth(api, ttl=args.auth_cache_seconds), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
