"""The `helm` the README test puts on PATH (readme_cluster.py): `helm install` only.

There is no Helm binary here. `helm install NAME CHART -n NS [--create-namespace]` is parsed as
Helm parses it and sent to the harness, which renders CHART with helm-python-sdk (the Helm
engine), applies the render with the real kubectl and starts the operator and status API as
their Deployments say (tests/support/chart_release.py, cluster.py). It prints what Helm prints
on success; any other helm command fails with a one-line error.

    python readme_helm.py CONTROL_URL [helm args...]
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path


def parse_install(args: list[str]) -> dict[str, object]:
    ns, create, positional = "default", False, []
    it = iter(args)
    for arg in it:
        if arg in ("-n", "--namespace"):
            ns = next(it)
        elif arg.startswith("--namespace="):
            ns = arg.split("=", 1)[1]
        elif arg == "--create-namespace":
            create = True
        elif arg.startswith("-"):
            raise SystemExit(f"Error: the README harness's helm does not take {arg}")
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise SystemExit("Error: helm install needs a release name and a chart")
    name, chart = positional
    return {"name": name, "chart": str(Path(chart).resolve()), "namespace": ns,
            "create_namespace": create}  # fmt: skip


def main(argv: list[str]) -> int:
    control, *args = argv
    if not args or args[0] != "install":
        print(f"Error: the README harness's helm serves `helm install` only, not {args}",
              file=sys.stderr)  # fmt: skip
        return 1
    body = json.dumps(parse_install(args[1:])).encode()
    request = urllib.request.Request(control + "/install", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=240) as reply:
            print(reply.read().decode(), end="")
            return 0
    except urllib.error.HTTPError as exc:
        print(exc.read().decode(), file=sys.stderr, end="")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
