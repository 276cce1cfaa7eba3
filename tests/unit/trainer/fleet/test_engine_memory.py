"""Colocated GPU engines release their memory for the update and take it back before the sync.

A real HTTP server stands in for each engine and records what reaches it (route, query, body,
key), and the training loop's own step runs against it, so the order generation -> release ->
update -> resume -> weight sync -> eval is what the trainer really does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from lorarl.api.spec.placement import releases_engine_memory
from lorarl.api.validation import parse_job
from lorarl.engines.flags import managed_flags, overriding_arg
from lorarl.local.ports import free_port
from lorarl.plan.engines import engine_command
from lorarl.trainer import loop
from lorarl.trainer.fleet.engine_memory import EngineMemory, EngineMemoryError, live_engine_urls
from lorarl.trainer.loop import StepState, Trainer
from lorarl.trainer.model.parallel import DistContext
from lorarl.trainer.settings import Endpoints

KEY = "job-key"


class FakeEngine:
    """A vLLM- or SGLang-shaped server: answers the memory routes as the engine does, records
    every request into `events` (shared with the test), and refuses a wrong key with 401."""

    def __init__(self, kind: str, events: list, fail: int = 0, fail_status: int = 400) -> None:
        self.kind, self.events, self.fail, self.fail_status = kind, events, fail, fail_status
        self.asleep = False
        self.wake_answer = "awake"
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                engine.handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        path, _, query = h.path.partition("?")
        self.events.append({"engine": self.url, "route": path, "query": query,
                            "body": json.loads(raw) if raw else None,
                            "auth": h.headers.get("Authorization")})  # fmt: skip
        if h.headers.get("Authorization") != f"Bearer {KEY}":
            return self.reply(h, 401, {"error": "Unauthorized"})
        if self.fail > 0:
            self.fail -= 1
            return self.reply(h, self.fail_status, {"error": "temporarily unavailable"})
        if path in ("/sleep", "/release_memory_occupation"):
            self.asleep = True
        elif path in ("/wake_up", "/resume_memory_occupation"):
            self.asleep = False
        if self.kind == "sglang":  # SGLang's memory routes answer `null` on success
            return self.reply(h, 200, None)
        if path == "/sleep":
            return self.reply(h, 200, {"status": "sleeping", "level": 1})
        return self.reply(h, 200, {"status": self.wake_answer, "tags": None})

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def events() -> list:
    return []


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=2.0) as client:
        yield client


@pytest.fixture
def engines(events: list) -> Iterator[Any]:
    made: list[FakeEngine] = []

    def make(kind: str, **kw: Any) -> FakeEngine:
        made.append(FakeEngine(kind, events, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


def job(engine: str = "vllm", gpus: int = 1, placement: str = "colocated", **training: Any):
    return parse_job({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob", "metadata": {"name": "t"},
        "spec": {
            "model": {"path": "/m"}, "data": {"trainFiles": ["t.jsonl"], "valFiles": ["v.jsonl"]},
            "rollout": {"engine": engine, "placement": placement, "gpusPerReplica": gpus},
            "trainer": {"gpusPerReplica": gpus},
            "training": {"totalSteps": 10, "evalInterval": 1, **training},
        },
    })  # fmt: skip


def memory(engine: str, urls: list[str], http: httpx.Client, live=None, **kw) -> EngineMemory:
    return EngineMemory(True, engine, http, KEY, live or (lambda: urls), sleep=lambda s: None, **kw)


def calls(events: list) -> list[tuple]:
    return [(e["route"], e["query"], e["body"], e["auth"]) for e in events]


# ------------------------------------------------------------------------------- the routes


def test_vllm_sleeps_at_level_1_and_wakes_every_tag(engines, events, http) -> None:
    a, b = engines("vllm"), engines("vllm")
    mem = memory("vllm", [a.url, b.url], http)
    mem.release()
    assert a.asleep and b.asleep and sorted(mem.released) == sorted([a.url, b.url])
    mem.resume()
    assert not a.asleep and not b.asleep and mem.released == []
    auth = f"Bearer {KEY}"
    assert sorted(calls(events)) == sorted(
        [("/sleep", "level=1", None, auth)] * 2 + [("/wake_up", "", None, auth)] * 2
    )


def test_sglang_releases_and_resumes_every_tag_with_a_json_body(engines, events, http) -> None:
    e = engines("sglang")
    mem = memory("sglang", [e.url], http)
    mem.release()
    assert e.asleep
    mem.resume()
    assert not e.asleep
    assert calls(events) == [
        ("/release_memory_occupation", "", {}, f"Bearer {KEY}"),  # no tags: weights, KV, graphs
        ("/resume_memory_occupation", "", {}, f"Bearer {KEY}"),
    ]


def test_only_a_colocated_gpu_job_releases(engines, events, http) -> None:
    e = engines("vllm")
    for spec, on in ((job().spec, True), (job(gpus=0).spec, False),
                     (job(placement="separate").spec, False),
                     (job(engine="sglang").spec, True)):  # fmt: skip
        assert releases_engine_memory(spec) is on
        mem = EngineMemory.for_job(spec, http, Endpoints([e.url], engine_api_key=KEY), lambda: None)
        assert mem.enabled is on
    ep = Endpoints([e.url], engine_api_key=KEY)
    off = EngineMemory.for_job(job(placement="separate").spec, http, ep, lambda: None)
    off.release()
    off.resume()
    off.after_update(is_main=True)
    assert events == []


# ------------------------------------------------------------------------------- failures


def test_a_live_engine_that_keeps_refusing_fails_the_step_naming_it(engines, events, http) -> None:
    good, bad = engines("sglang"), engines("sglang", fail=99)
    mem = memory("sglang", [good.url, bad.url], http)
    with pytest.raises(EngineMemoryError, match=f"release .* 3 times: {bad.url}: HTTP 400"):
        mem.release()
    assert [e["engine"] for e in events].count(bad.url) == 3  # retried while live
    assert mem.released == [good.url]


def test_a_failure_that_clears_is_retried(engines, events, http) -> None:
    e = engines("sglang", fail=1, fail_status=503)  # e.g. a proxy between us blipped
    mem = memory("sglang", [e.url], http)
    mem.release()
    assert e.asleep and len(events) == 2


def test_an_engine_that_left_the_fleet_is_skipped(engines, events, http) -> None:
    e = engines("vllm")
    gone = f"http://127.0.0.1:{free_port()}"  # its pod was deleted: nothing answers
    # the fleet still listed it when the release began, and no longer once its call failed
    mem = memory("vllm", [], http, live=lambda: [e.url] if events else [e.url, gone])
    mem.release()
    assert mem.released == [e.url]
    mem.resume()
    assert [x["route"] for x in events] == ["/sleep", "/wake_up"]


def test_a_wrong_key_is_an_error_not_a_silent_skip(engines, events, http) -> None:
    e = engines("vllm")
    mem = EngineMemory(True, "vllm", http, "other", lambda: [e.url], sleep=lambda s: None)
    with pytest.raises(EngineMemoryError, match="HTTP 401"):
        mem.release()


def test_vllm_still_asleep_after_wake_up_is_an_error(engines, events, http) -> None:
    e = engines("vllm")
    e.wake_answer = "sleeping"
    mem = memory("vllm", [e.url], http, attempts=1)
    mem.release()
    with pytest.raises(EngineMemoryError, match="not fully awake"):
        mem.resume()


def test_only_released_engines_are_resumed(engines, events, http) -> None:
    """A replica that joined during the update started awake: SGLang refuses a resume of
    memory it never released, so it is not asked."""
    a, late = engines("sglang"), engines("sglang")
    live = [a.url]
    mem = memory("sglang", [], http, live=lambda: live)
    mem.release()
    live.append(late.url)
    mem.resume()
    assert [(x["engine"], x["route"]) for x in events] == [
        (a.url, "/release_memory_occupation"), (a.url, "/resume_memory_occupation"),
    ]  # fmt: skip


def test_live_engines_come_from_the_fleet_when_there_is_one() -> None:
    member = lambda url: (SimpleNamespace(engine=url), None)  # noqa: E731
    fleet = SimpleNamespace(live=lambda: [member("http://a"), member(None), member("http://b")])
    assert live_engine_urls(fleet, ["http://env"]) == ["http://a", "http://b"]
    assert live_engine_urls(None, ["http://env"]) == ["http://env"]
    ep = Endpoints(["http://env"], engine_api_key=KEY)
    mem = EngineMemory.for_job(job().spec, None, ep, lambda: fleet)  # the trainer's wiring
    assert mem.live() == ["http://a", "http://b"] and mem.headers == {
        "Authorization": "Bearer " + KEY
    }


# ------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_plan_starts_colocated_gpu_engines_able_to_release(engine: str) -> None:
    sglang = ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    flags = ["--enable-sleep-mode"] if engine == "vllm" else sglang
    argv = engine_command(job(engine).spec, "/m", "127.0.0.1", 8000)
    assert all(argv.count(f) == 1 for f in flags)
    assert set(a for a in argv if a.startswith("--")) <= set(managed_flags(engine, cpu=False))
    for f in flags:
        assert overriding_arg(engine, [f], cpu=False) == f  # engineArgs cannot add or undo them
    separate = engine_command(job(engine, placement="separate").spec, "/m", "127.0.0.1", 8000)
    assert not set(flags) & set(separate)
    if engine == "vllm":
        assert overriding_arg("vllm", ["--no-enable-sleep-mode"], cpu=False)
        assert "--enable-sleep-mode" not in engine_command(job(gpus=0).spec, "/m", "h", 1)


# ------------------------------------------------------------------------------- the loop


def loop_trainer(monkeypatch, events: list, urls: list[str], http, **kw: Any) -> Trainer:
    """A Trainer whose step runs for real but whose model, data and sync are recorders."""
    t = Trainer.__new__(Trainer)
    t.job = job(**kw, checkpointInterval=100)
    t.ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"),
                        backend=None)  # fmt: skip
    t.endpoints = Endpoints(rollout=urls, engine_api_key=KEY)
    t.fleet = None
    t.state, t._prefetched = StepState(), None
    t.model, t.pad_id, t.tokenizer = None, 0, None
    t.tracker = SimpleNamespace(record=lambda *a: None, set_checkpoint=lambda *a: None)
    t.reward_client = None
    t.worker = SimpleNamespace(client=SimpleNamespace(set_endpoints=lambda urls: None))
    t.engine_memory = EngineMemory.for_job(t.job.spec, http, t.endpoints, lambda: t.fleet)

    def generate(position, step, version):
        events.append({"route": "generate"})
        return SimpleNamespace(samples=[], position=position)

    def update(*a, **kw):
        events.append({"route": "update"})
        return {}

    def publish():
        events.append({"route": "sync"})

    def evaluate(step):
        events.append({"route": "eval"})

    t._generate, t._publish, t._evaluate = generate, publish, evaluate
    t.updater = SimpleNamespace(set_lr=lambda step: None, update=update, lr=0.1)
    monkeypatch.setattr(loop, "shard_for_rank", lambda samples, rank, world: samples)
    monkeypatch.setattr(loop, "collate", lambda samples, pad, device=None, endpoints=None: None)
    monkeypatch.setattr(loop, "step_record", lambda *a, **kw: SimpleNamespace(eval=None))
    return t


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_step_releases_after_generation_and_resumes_before_the_sync(
    engine, monkeypatch, engines, events, http
) -> None:
    e = engines(engine)
    t = loop_trainer(monkeypatch, events, [e.url], http, engine=engine, evalInterval=1)
    for _ in range(2):
        t.train_step()
    sglang = ("/release_memory_occupation", "/resume_memory_occupation")
    release, resume = ("/sleep", "/wake_up") if engine == "vllm" else sglang
    one_step = ["generate", release, "update", resume, "sync", "eval"]
    assert [x["route"] for x in events] == one_step * 2
    assert not e.asleep and t.state.step == 2


def test_a_separate_placement_step_never_calls_the_engines(monkeypatch, events, http) -> None:
    urls = ["http://127.0.0.1:1"]
    t = loop_trainer(monkeypatch, events, urls, http, placement="separate", evalInterval=1)
    t.train_step()
    assert [x["route"] for x in events] == ["generate", "update", "sync", "eval"]


def test_a_failed_resume_fails_the_step_before_the_sync(monkeypatch, engines, events, http) -> None:
    e = engines("vllm")
    t = loop_trainer(monkeypatch, events, [e.url], http)
    t.engine_memory.attempts = 1
    e.wake_answer = "sleeping"
    with pytest.raises(EngineMemoryError, match=e.url):
        t.train_step()
    assert [x["route"] for x in events] == ["generate", "/sleep", "update", "/wake_up"]


def test_a_step_hands_the_update_a_batch_on_the_trainers_device(monkeypatch, events, http):
    """On GPU the model lives on ctx.device: a host batch fails in the first logprob gather."""
    t = loop_trainer(monkeypatch, events, ["http://127.0.0.1:1"], http, placement="separate")
    t.ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("meta"),
                        backend=None)  # fmt: skip
    seen: list[Any] = []
    monkeypatch.setattr(
        loop, "collate", lambda samples, pad, device=None, endpoints=None: seen.append(device)
    )
    t.train_step()
    assert seen == [torch.device("meta")]
