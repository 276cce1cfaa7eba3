"""The `helm` the README test puts on PATH (cluster.py): `helm install` through the Helm
SDK (helm-python-sdk, Helm's own engine and install action), into the cluster KUBECONFIG names.

There is no Helm binary here; this is a thin command line over the same library, so the
README's `helm install NAME CHART -n NS [--create-namespace]` installs exactly as Helm would:
CRDs first, then every template, into the real API server. It prints what Helm prints on
success; any other helm command fails with a one-line error.

    python helm.py [helm args...]
"""

from __future__ import annotations

import os
import sys
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
    if not argv or argv[0] != "install":
        print(f"Error: the README harness's helm serves `helm install` only, not {argv}",
              file=sys.stderr)  # fmt: skip
        return 1
    req = parse_install(argv[1:])
    import helm_python as helm

    config = helm.Config(kubeconfig_path=os.environ["KUBECONFIG"], namespace=str(req["namespace"]))
    try:
        release = config.install(
            str(req["chart"]),
            str(req["name"]),
            {},
            create_namespace=bool(req["create_namespace"]),
            timeout=120,
        )
    except Exception as exc:  # Helm's own error, as helm prints it
        print(f"Error: INSTALLATION FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        config.close()
    notes = (release.get("info") or {}).get("notes", "")
    print(f"NAME: {req['name']}\nNAMESPACE: {req['namespace']}\nSTATUS: deployed\n"
          f"REVISION: {release.get('version', 1)}\nNOTES:\n{notes}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
