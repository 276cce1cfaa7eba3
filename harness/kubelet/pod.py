"""One pod on the process kubelet: its sandbox (netns, hosts file, volumes), its containers and
the status kubelet reports (phase, podIP, conditions, initContainerStatuses, containerStatuses).

Init containers run as kubelet runs them: one at a time, in order, in the pod's sandbox, each
configured like a main container; the main containers are configured and started only once all
have exited 0. A failed init container fails the pod under restartPolicy Never and is restarted
(with the containers' back-off) otherwise."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .api import Api
from .containers import ConfigError, launch
from .images import ImagePullError, load
from .network import Bridge, PodNet, unmount_under
from .policy import Endpoint
from .runtime import ContainerRun, now
from .volumes import Volume, VolumeError, prepare

Obj = dict[str, Any]
SHM_PATH = "/dev/shm"
# Pod features the process kubelet does not run (none of the operator's pods use them).
UNSUPPORTED = {"ephemeralContainers", "hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"}
BACKOFF_BASE, BACKOFF_MAX = 1.0, 10.0  # kubelet's are 10 s and 5 min; tests cannot wait that long
# A main container's state until the pod's init containers have all succeeded.
INITIALIZING = ("PodInitializing", "")


@dataclass
class PodRun:
    pod: Obj
    folder: Path
    net: PodNet | None = None
    volumes: dict[str, Volume] = field(default_factory=dict)
    containers: list[ContainerRun] = field(default_factory=list)
    init_containers: list[ContainerRun] = field(default_factory=list)
    pending: tuple[str, str] | None = None  # (reason, message): the pod cannot start yet
    started: str = field(default_factory=now)
    stopping: bool = False
    stopped: threading.Event = field(default_factory=threading.Event)
    tried: float = 0.0  # when starting was last attempted (monotonic)
    running_at: float | None = None  # when the pod was first Running (monotonic)
    hosts_file: Path | None = None
    services: dict[str, str] = field(default_factory=dict)  # the service env (containers.py)
    api: Api | None = None  # to configure the main containers once the init containers are done
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (status, at)

    @property
    def uid(self) -> str:
        return self.pod["metadata"]["uid"]

    @property
    def key(self) -> str:
        return f"{self.pod['metadata']['namespace']}/{self.pod['metadata']['name']}"

    @property
    def hostname(self) -> str:
        return self.pod["spec"].get("hostname") or self.pod["metadata"]["name"]

    def endpoint(self) -> Endpoint | None:
        if self.net is None:
            return None
        ports = {
            p["name"]: (p.get("protocol", "TCP"), p["containerPort"])
            for c in self.pod["spec"]["containers"]
            for p in c.get("ports") or []
            if p.get("name")
        }
        meta = self.pod["metadata"]
        return Endpoint(meta["namespace"], meta.get("labels") or {}, self.net.ip, ports)

    # -- setup ---------------------------------------------------------------------------------
    def sandbox(self, api: Api, bridge: Bridge, claim_dir: Any) -> None:
        """Volumes, then the network; a failure leaves the pod Pending with the reason."""
        unsupported = sorted(UNSUPPORTED & {k for k, v in self.pod["spec"].items() if v})
        unsupported += [
            f"{c['name']}.readinessProbe (not httpGet)"
            for c in self.pod["spec"]["containers"]
            if c.get("readinessProbe") and "httpGet" not in c["readinessProbe"]
        ]
        for c in self.pod["spec"].get("initContainers") or []:
            if c.get("readinessProbe"):  # the API server refuses it too
                unsupported.append(f"{c['name']}.readinessProbe (init container)")
            if c.get("restartPolicy"):  # a sidecar: runs beside the main containers
                unsupported.append(f"{c['name']}.restartPolicy (sidecar init container)")
        if unsupported:  # said, never half-emulated; not retried
            self.pending = ("UnsupportedByHarness", f"the process kubelet cannot run {unsupported}")
            self.tried = float("inf")
            return
        fs_group = (self.pod["spec"].get("securityContext") or {}).get("fsGroup")
        volumes = self.folder / "volumes"
        if volumes.exists():  # a retry: start from nothing
            unmount_under(volumes)
            shutil.rmtree(volumes)
        self.pending = None
        try:
            self.volumes = prepare(api, self.pod, self.folder, claim_dir, fs_group)
        except VolumeError as exc:
            self.pending = (exc.reason, str(exc))
            return
        self.net = bridge.attach(self.key)

    def create_containers(self, api: Api, hosts_file: Path, services: dict[str, str]) -> None:
        """The init containers are configured now; the main containers wait (PodInitializing)
        until those have all succeeded, as kubelet resolves a container's config at its start."""
        self.hosts_file = hosts_file
        self.services = services
        self.api = api
        for c in self.pod["spec"].get("initContainers") or []:
            run = self._container(c, "init-containers")
            self.init_containers.append(run)
            self._configure(api, run, c)
        for c in self.pod["spec"]["containers"]:
            run = self._container(c, "containers")
            self.containers.append(run)
            if self.init_containers:
                run.waiting = INITIALIZING
            else:
                self._configure(api, run, c)

    def _container(self, c: Obj, kind: str) -> ContainerRun:
        return ContainerRun(
            name=c["name"],
            image=c.get("image", ""),
            folder=self.folder / kind / c["name"],
            hostname=self.hostname,
            netns=self.net.netns if self.net else "",
            termination_policy=c.get("terminationMessagePolicy", "File"),
            probe=c.get("readinessProbe"),
        )

    def _configure(self, api: Api, run: ContainerRun, c: Obj) -> None:
        try:
            image = load(c.get("image", ""))
            run.launch = launch(api, self.pod, c, image, self.services)
            run.mounts = self._mounts(c, self.hosts_file)
            if any(m["mountPath"] == SHM_PATH for m in c.get("volumeMounts") or []):
                run.shm = "0"  # replaced by the pod's own volume
            run.waiting = None
        except ImagePullError as exc:
            run.waiting = ("ErrImagePull", str(exc))
        except ConfigError as exc:
            run.waiting = (exc.reason, str(exc))

    def retry_config(self, api: Api) -> None:
        """kubelet retries a container whose Secret/ConfigMap was missing (not a bad image)."""
        spec = self.pod["spec"]
        for runs, specs in ((self.init_containers, spec.get("initContainers") or []),
                            (self.containers, spec["containers"])):  # fmt: skip
            by_name = {c["name"]: c for c in specs}
            for run in runs:
                if run.waiting and run.waiting[0] == ConfigError.reason:
                    self._configure(api, run, by_name[run.name])

    def waiting_to_start(self) -> bool:
        if self.net is None:
            return self.pending is not None
        runs = [*self.init_containers, *self.containers]
        return any(r.waiting and r.waiting[0] == ConfigError.reason for r in runs)

    def initialized(self) -> bool:
        """Every init container has exited 0 (true of a pod without any)."""
        return all(_succeeded(r) for r in self.init_containers)

    def _init_failed(self) -> bool:
        """An init container failed and will not run again: the pod has failed."""
        never = self.pod["spec"].get("restartPolicy", "Always") == "Never"
        return never and any(
            r.terminated and r.terminated["exitCode"] and r.restart_at is None
            for r in self.init_containers
        )

    def _mounts(self, container: Obj, hosts_file: Path) -> list[dict[str, Any]]:
        # The cluster's names are in the hosts file; any other name fails at once (a refused
        # query on the pod's own loopback), as a cluster DNS answers NXDOMAIN, instead of
        # waiting out the host's resolver, which a pod's network cannot reach.
        resolv = self.folder / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\noptions ndots:1 attempts:1 timeout:1\n")
        resolv.chmod(0o644)
        out = [{"src": str(hosts_file), "dst": "/etc/hosts", "ro": True},
               {"src": str(resolv), "dst": "/etc/resolv.conf", "ro": True}]  # fmt: skip
        for m in container.get("volumeMounts") or []:
            vol = self.volumes.get(m["name"])
            if vol is None:
                raise ConfigError(f"volumeMount {m['name']}: no volume of that name in the pod")
            src = vol.path / m["subPath"] if m.get("subPath") else vol.path
            ro = bool(m.get("readOnly")) or vol.read_only
            out.append({"src": str(src), "dst": m["mountPath"], "ro": ro})
        return out

    def start_containers(self) -> None:
        """The first init container not done yet, if it has not started; once all are done,
        the main containers (configured now, the first time)."""
        if self.stopping:
            return
        for run in self.init_containers:
            if _succeeded(run):
                continue
            if run.launch is not None and run.waiting is None and not run.started_once:
                run.start()
            return  # running, backing off, failed for good, or waiting on its config
        specs = {c["name"]: c for c in self.pod["spec"]["containers"]}
        for run in self.containers:
            if run.waiting == INITIALIZING and self.api is not None:
                self._configure(self.api, run, specs[run.name])
            if run.launch is not None and run.waiting is None and not run.started_once:
                run.start()

    # -- supervision ---------------------------------------------------------------------------
    def step(self) -> None:
        """Reap exits and restart containers per restartPolicy (with back-off); an init
        container only after a failure, unless the policy is Never. Then start what may start
        now (the next init container, or the main containers)."""
        policy = self.pod["spec"].get("restartPolicy", "Always")
        runs = [(r, True) for r in self.init_containers] + [(r, False) for r in self.containers]
        for run, init in runs:
            if run.poll():
                code = run.terminated["exitCode"]
                again = policy == "Always" or (policy == "OnFailure" and code)
                if init:
                    again = policy != "Never" and code != 0
                if not self.stopping and again:
                    delay = min(BACKOFF_MAX, BACKOFF_BASE * 2**run.restarts)
                    run.restart_at = time.monotonic() + delay
            if run.restart_at is not None and time.monotonic() >= run.restart_at:
                run.restart()
        self.start_containers()

    def probe(self) -> None:
        """Readiness probes, from the node as kubelet sends them: an httpGet to the pod's
        address every periodSeconds (at most 2 s here: tests cannot wait 10), a 2xx/3xx
        within timeoutSeconds is ready. Other probe kinds are refused when the pod starts."""
        for run in self.containers:
            if run.probe is None or run.proc is None or run.proc.poll() is not None:
                run.probe_ok = False
                continue
            period = min(2.0, float(run.probe.get("periodSeconds", 10)))
            if time.monotonic() - run.probed_at < period or self.net is None:
                continue
            run.probed_at = time.monotonic()
            get = run.probe["httpGet"]
            port = get["port"]
            if isinstance(port, str):
                port = next(p["containerPort"] for c in self.pod["spec"]["containers"]
                            for p in c.get("ports") or [] if p.get("name") == port)  # fmt: skip
            url = f"http://{self.net.ip}:{port}{get.get('path', '/')}"
            try:
                code = httpx.get(url, timeout=float(run.probe.get("timeoutSeconds", 1))).status_code
                run.probe_ok = 200 <= code < 400
            except httpx.HTTPError:
                run.probe_ok = False

    def phase(self) -> str:
        runs = self.containers
        if self._init_failed():
            return "Failed"
        if self.pending or not runs or not all(r.started_once for r in runs):
            return "Pending"
        finished = [r.terminated for r in runs if r.terminated and r.restart_at is None]
        if len(finished) == len(runs):
            return "Succeeded" if all(t["exitCode"] == 0 for t in finished) else "Failed"
        return "Running"

    def status(self, host_ip: str) -> Obj:
        phase = self.phase()
        ready = phase == "Running" and all(r.status()["ready"] for r in self.containers)
        out: Obj = {
            "phase": phase,
            "hostIP": host_ip,
            "startTime": self.started,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                self._initialized_condition(),
                {"type": "ContainersReady", "status": str(ready)},
                {"type": "Ready", "status": str(ready)},
            ],
        }
        if self.pending:
            reason, message = self.pending
            out["conditions"][0] = {"type": "PodScheduled", "status": "False", "reason": reason,
                                    "message": message}  # fmt: skip
        for condition in out["conditions"]:
            # When each condition last changed, as kubelet records it: the Deployment
            # controller counts minReadySeconds from the Ready condition's transition.
            seen = self.transitions.get(condition["type"])
            if seen is None or seen[0] != condition["status"]:
                seen = self.transitions[condition["type"]] = (condition["status"], now())
            condition["lastTransitionTime"] = seen[1]
        if self.net is not None:
            out["podIP"] = self.net.ip
            out["podIPs"] = [{"ip": self.net.ip}]
        if self.init_containers:
            out["initContainerStatuses"] = [_init_status(r) for r in self.init_containers]
        if self.containers:
            out["containerStatuses"] = [r.status() for r in self.containers]
        return out

    def _initialized_condition(self) -> Obj:
        if self.initialized():
            return {"type": "Initialized", "status": "True"}
        left = " ".join(r.name for r in self.init_containers if not _succeeded(r))
        return {"type": "Initialized", "status": "False", "reason": "ContainersNotInitialized",
                "message": f"containers with incomplete status: [{left}]"}  # fmt: skip

    # -- teardown ------------------------------------------------------------------------------
    def stop(self, grace: float, bridge: Bridge) -> None:
        """Kill every container (in parallel, each with the grace period), then the sandbox."""
        self.stopping = True
        runs = [*self.init_containers, *self.containers]
        killers = [threading.Thread(target=r.kill, args=(grace,)) for r in runs]
        for t in killers:
            t.start()
        for t in killers:
            t.join()
        if self.net is not None:
            bridge.detach(self.net)
        unmount_under(self.folder)
        for run in runs:  # the roots are empty mount points now; logs stay
            for root in run.folder.glob("*.root*"):
                shutil.rmtree(root, ignore_errors=True)
        self.stopped.set()


def _succeeded(run: ContainerRun) -> bool:
    return run.terminated is not None and run.terminated["exitCode"] == 0


def _init_status(run: ContainerRun) -> Obj:
    """As kubelet reports an init container: ready once it has succeeded, never before."""
    return {**run.status(), "ready": _succeeded(run)}
