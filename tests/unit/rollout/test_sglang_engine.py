"""SGLangEngine against a small recording SGLang stand-in (real HTTP, real gloo group).

What SGLang itself accepts is pinned by tests/contract; these tests pin our side: the request
sequence, the bytes that travel, auth, and what happens when the engine refuses or restarts.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch

from lorarl.rollout.engine import EngineError
from lorarl.rollout.sglang_engine import (
    SGLangEngine,
    distributed_update_body,
    flatten_bucket,
    join_update_group,
    plan_buckets,
)

KEY = "k3y"


class FakeSGLang:
    """Records requests; a child process joins the update group as rank 1 and unpacks buckets.

    A separate process because torch registers groups by name per process, and both halves of
    one group carry the same name.
    """

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.received: dict[str, torch.Tensor] = {}
        self.server_info: dict[str, Any] = {"tp_size": 1, "dp_size": 1}
        self.health_code = 200
        self.refuse: dict[str, tuple[int, dict[str, Any]]] = {}  # path -> (status, body) once
        self.loras: set[str] = set()
        self.receiver: Any = None  # (process, pipe) of the rank-1 child
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append({"method": "GET", "path": self.path, "auth": self._auth()})
                if self.path == "/health":
                    self._send(fake.health_code, None)
                elif self.path == "/server_info":
                    self._send(200, fake.server_info)
                else:
                    self._send(404, {"detail": "not found"})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                url = urlsplit(self.path)
                body = json.loads(raw) if raw else None
                fake.requests.append(
                    {"method": "POST", "path": url.path, "query": url.query, "body": body,
                     "auth": self._auth()}
                )  # fmt: skip
                if url.path in fake.refuse:
                    self._send(*fake.refuse.pop(url.path))
                    return
                self._send(*fake.handle(url.path, body))

            def _auth(self) -> str | None:
                return self.headers.get("Authorization")

            def _send(self, code: int, body: Any) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, path: str, body: Any) -> tuple[int, Any]:
        ok = {"success": True, "message": "Success"}
        if path == "/init_weights_update_group":
            self.drop_receiver()
            parent, child = mp.get_context("spawn").Pipe()
            args = (child, body["master_address"], body["master_port"], body["world_size"],
                    body["group_name"], body["backend"], body["rank_offset"])  # fmt: skip
            proc = mp.get_context("spawn").Process(target=_receiver_main, args=args, daemon=True)
            proc.start()
            self.receiver = (proc, parent)
            if not parent.poll(60) or parent.recv() != "joined":
                return 400, {"success": False, "message": "receiver did not join"}
            return 200, ok
        if path == "/update_weights_from_distributed":
            _, pipe = self.receiver
            pipe.send((body["names"], body["dtypes"], body["shapes"]))
            self.received.update(pipe.recv())
            return 200, ok
        if path == "/load_lora_adapter":
            if body["lora_name"] in self.loras:
                msg = (
                    f"Failed to load LoRA adapter {body['lora_name']} because it is already loaded"
                )
                return 400, {"success": False, "error_message": msg}
            self.loras.add(body["lora_name"])
            return 200, {"success": True, "error_message": None}
        if path == "/unload_lora_adapter":
            self.loras.discard(body["lora_name"])
            return 200, {"success": True, "error_message": None}
        if path == "/flush_cache":
            return 200, None
        return 200, ok

    def paths(self) -> list[str]:
        return [r["path"] for r in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.drop_receiver()

    def drop_receiver(self) -> None:
        """Stop the rank-1 child, as an engine restart would."""
        if self.receiver is None:
            return
        proc, pipe = self.receiver
        self.receiver = None
        pipe.send(None)
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _receiver_main(pipe, host, port, world_size, group_name, backend, rank) -> None:
    """Rank-1 child: join the group, then unpack one flattened bucket per request."""
    group = join_update_group(host, port, world_size, group_name, backend, 30.0, rank=rank)
    pipe.send("joined")
    while (msg := pipe.recv()) is not None:
        names, dtype_names, shapes = msg
        dtypes = [getattr(torch, d) for d in dtype_names]
        sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([flat], opts).wait()
        out, offset = {}, 0
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
            out[name] = flat[offset : offset + size].view(dtype).reshape(shape).clone()
            offset += size
        pipe.send(out)
    torch.distributed.destroy_process_group(group)


@pytest.fixture
def fake() -> Iterator[FakeSGLang]:
    f = FakeSGLang()
    yield f
    f.close()


@pytest.fixture
def engine(fake: FakeSGLang) -> Iterator[SGLangEngine]:
    with SGLangEngine(fake.url, api_key=KEY, group_timeout=30.0) as e:
        yield e


def qkv(layer: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(layer)
    return [
        (f"model.layers.{layer}.self_attn.{p}.weight", torch.randn(4, 6, generator=g).to(dtype))
        for p in ("q_proj", "k_proj", "v_proj")
    ]


# ------------------------------------------------------------------------------- pure parts


def test_plan_buckets_splits_by_dtype_and_size() -> None:
    a = ("a", torch.zeros(10, dtype=torch.bfloat16))  # 20 B
    b = ("b", torch.zeros(10, dtype=torch.float32))  # 40 B
    c = ("c", torch.zeros(20, dtype=torch.bfloat16))  # 40 B
    d = ("d", torch.zeros(40, dtype=torch.bfloat16))  # 80 B: over the cap, alone
    e = ("e", torch.zeros(5, dtype=torch.bfloat16))  # 10 B
    buckets = plan_buckets([a, b, c, d, e], bucket_bytes=64)
    assert [[n for n, _ in bk] for bk in buckets] == [["a", "c"], ["d"], ["e"], ["b"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([a], bucket_bytes=0)


def test_flatten_bucket_is_the_tensors_bytes_in_order() -> None:
    x = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    y = torch.tensor([3.0, -1.0, 0.5], dtype=torch.float32).t()
    flat = flatten_bucket([("x", x), ("y", y)])
    assert flat.dtype == torch.uint8 and flat.numel() == 5 * 4
    assert flat.view(torch.float32).tolist() == [1.0, 2.0, 3.0, -1.0, 0.5]


def test_distributed_update_body_labels_only_the_last_bucket() -> None:
    bucket = [("w", torch.zeros(2, 3, dtype=torch.bfloat16))]
    assert distributed_update_body(bucket, "g", last=False, version=4) == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "g",
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "abort_all_requests": False,
    }
    last = distributed_update_body(bucket, "g", last=True, version=4)
    assert (last["flush_cache"], last["weight_version"]) == (True, "4")


# ------------------------------------------------------------------------------ merged mode


def test_push_sends_every_tensor_exactly(fake: FakeSGLang) -> None:
    named = [*qkv(0), ("model.layers.0.mlp.down_proj.weight", torch.randn(6, 4))]
    with SGLangEngine(fake.url, api_key=KEY, bucket_bytes=100, group_timeout=30.0) as e:
        e.push_merged_weights(iter(named), version=3)
        assert e.weight_version == 3
    assert fake.paths() == [
        "/server_info", "/init_weights_update_group", "/begin_weight_update",
        "/update_weights_from_distributed", "/update_weights_from_distributed",
        "/update_weights_from_distributed", "/end_weight_update",
    ]  # fmt: skip
    assert set(fake.received) == {n for n, _ in named}
    for name, tensor in named:
        assert fake.received[name].dtype == tensor.dtype
        assert torch.equal(fake.received[name], tensor), name
    init = fake.requests[1]["body"]
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    assert init["master_address"] == "127.0.0.1"
    updates = [r["body"] for r in fake.requests if r["path"] == "/update_weights_from_distributed"]
    assert [u.get("weight_version") for u in updates] == [None, None, "3"]
    assert {u["group_name"] for u in updates} == {init["group_name"]}
    assert all(r["auth"] == f"Bearer {KEY}" for r in fake.requests)


def test_second_push_reuses_the_group(fake: FakeSGLang, engine: SGLangEngine) -> None:
    engine.push_merged_weights(qkv(0), version=1)
    engine.push_merged_weights(qkv(1), version=2)
    assert fake.paths().count("/init_weights_update_group") == 1
    assert fake.paths().count("/server_info") == 1
    assert torch.equal(fake.received["model.layers.1.self_attn.v_proj.weight"], qkv(1)[2][1])


def test_unhealthy_engine_gets_a_new_group(fake: FakeSGLang, engine: SGLangEngine) -> None:
    engine.push_merged_weights(qkv(0), version=1)
    old = engine.group_name
    fake.health_code = 503
    assert engine.health() is False and engine.group_name == old  # flagged, not torn down
    fake.health_code = 200
    assert engine.health() is True
    fake.drop_receiver()  # as if the engine had restarted
    engine.push_merged_weights(qkv(0), version=2)
    destroy = [r for r in fake.requests if r["path"] == "/destroy_weights_update_group"]
    assert [r["body"] for r in destroy] == [{"group_name": old}]
    assert engine.group_name not in (None, old)
    assert fake.paths().count("/init_weights_update_group") == 2


def test_refused_update_raises_closes_session_and_drops_group(
    fake: FakeSGLang, engine: SGLangEngine
) -> None:
    engine.push_merged_weights(qkv(0), version=1)
    # The engine answers before it joins the broadcast: its error comes back at once, not
    # after the group timeout (30 s here) that our side of the broadcast would wait for.
    fake.refuse["/update_weights_from_distributed"] = (
        400, {"success": False, "message": "Failed to receive weights: boom"}
    )  # fmt: skip
    big = [(n, torch.zeros(512, 1024, dtype=torch.bfloat16)) for n, _ in qkv(0)]  # 3 MiB
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"400.*boom"):
        engine.push_merged_weights(big, version=2)
    assert time.monotonic() - t0 < 10
    assert fake.paths()[-1] == "/end_weight_update"
    assert engine.group_name is None and engine.weight_version == 1


def test_invalid_updates_never_reach_the_engine(fake: FakeSGLang, engine: SGLangEngine) -> None:
    with pytest.raises(EngineError, match="PEFT name"):
        engine.push_merged_weights(
            [("base_model.model.model.layers.0.mlp.down_proj.base_layer.weight", torch.ones(2))], 1
        )
    with pytest.raises(EngineError, match="twice"):
        engine.push_merged_weights(qkv(0) + qkv(0)[:1], 1)
    with pytest.raises(EngineError, match="partial fused group"):
        engine.push_merged_weights(qkv(0)[:1], 1)
    assert fake.requests == []


def test_data_parallel_engine_is_refused(fake: FakeSGLang, engine: SGLangEngine) -> None:
    fake.server_info = {"tp_size": 2, "dp_size": 2}
    with pytest.raises(EngineError, match="dp_size 1"):
        engine.push_merged_weights(qkv(0), version=1)
    assert "/init_weights_update_group" not in fake.paths()


# ----------------------------------------------------------------------------- adapter mode


def _adapter(tmp_path: Path, name: str = "policy-v1") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    return folder


def test_load_adapter_and_replace_a_loaded_name(
    fake: FakeSGLang, engine: SGLangEngine, tmp_path: Path
) -> None:
    folder = _adapter(tmp_path)
    engine.load_adapter(folder, "policy-v1", version=1)
    engine.load_adapter(folder, "policy-v1", version=2)
    assert engine.weight_version == 2
    assert fake.paths() == [
        "/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter", "/load_lora_adapter",
    ]  # fmt: skip
    assert fake.requests[0]["body"] == {"lora_name": "policy-v1", "lora_path": str(folder)}
    assert fake.requests[2]["body"] == {"lora_name": "policy-v1"}
    assert "/update_weight_version" not in fake.paths()  # the adapter name carries the version


def test_load_adapter_errors(fake: FakeSGLang, engine: SGLangEngine, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"adapter_config\.json"):
        engine.load_adapter(tmp_path, "x", version=1)
    fake.refuse["/load_lora_adapter"] = (
        400, {"success": False, "error_message": "rank 64 exceeds --max-lora-rank"}
    )  # fmt: skip
    with pytest.raises(EngineError, match="max-lora-rank"):
        engine.load_adapter(_adapter(tmp_path), "policy-v1", version=1)
    assert engine.weight_version is None
    engine.unload_adapter("policy-v1")
    assert fake.requests[-1]["body"] == {"lora_name": "policy-v1"}


# ------------------------------------------------------------------------- health and cache


def test_health_and_auth_headers(fake: FakeSGLang) -> None:
    with SGLangEngine(fake.url) as e:
        assert e.health() is True
    fake.health_code = 503
    with SGLangEngine(fake.url, api_key=KEY) as e:
        assert e.health() is False
    assert [r["auth"] for r in fake.requests] == [None, f"Bearer {KEY}"]
    with SGLangEngine("http://127.0.0.1:9") as e:  # nothing listens on the discard port
        assert e.health() is False


def test_flush_cache(fake: FakeSGLang) -> None:
    with SGLangEngine(fake.url, api_key=KEY, flush_timeout=2.5) as e:
        e.flush_cache()
        assert fake.requests[-1]["query"] == "timeout=2.5"
        fake.refuse["/flush_cache"] = (400, {"message": "requests are still running"})
        with pytest.raises(EngineError, match=r"flush cache.*400.*still running"):
            e.flush_cache()


def test_wait_ready_times_out(fake: FakeSGLang, engine: SGLangEngine) -> None:
    fake.health_code = 503
    with pytest.raises(EngineError, match="not healthy"):
        engine.wait_ready(timeout=0.3, poll=0.05)
