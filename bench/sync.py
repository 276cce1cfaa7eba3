"""Weight sync: shipping the LoRA adapter vs shipping the merged weights (what verl does).

    python -m bench.sync [--reps 5] [--ranks 8 32 64]

Both paths use the same transport (SyncSender -> one SyncReceiver process, gloo on loopback,
default buckets), so the difference is only what travels: the adapter's A/B tensors, in the
trainer's wire dtype (fp32 where it computes in fp32, as on CPU; bf16 under FSDP2 mixed precision
on GPU), or every weight of the model with the adapter merged in, in the engine dtype (bf16), as
a full-weights sync ships them (embeddings and norms included, a tied head once). `merge_s` is
the sidecar's cost for the adapter path in merged mode: W_base + s·B@A for every module, from the
pristine base, cast to bf16. Seconds are wall time of one `send()` (pack, broadcast, every ack),
median of `--reps` after one warm-up. Writes bench/results/sync.json and prints a table.

    python -m bench.sync --engine-push [--reps 8]

measures instead the merged push into a real vLLM CPU server on SmolLM2 (needs .venv-engine or
LORARL_ENGINE_PYTHON): the sidecar merge + full-weight file vs the adapter handed to the engine's
workers, which merge themselves (issue 36 #3); it updates only the `engine_push` entry.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from bench.common import machine, write_results
from harness.workloads.tiny_models import tiny_config
from lorarl.sync.buckets import SyncHeader
from lorarl.sync.errors import SyncClosed
from lorarl.sync.merge import BaseWeights, lora_scaling, merge_adapter
from lorarl.sync.names import group_lora_pairs
from lorarl.sync.transport import DEFAULT_BUCKET_BYTES, SyncReceiver, SyncSender

RESULTS = Path(__file__).resolve().parent / "results" / "sync.json"
HOST = "127.0.0.1"
SYNC_KEY = "bench-sync-key"  # the channel is signed; both ends only need to agree
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ENGINE_DTYPE = torch.bfloat16
# The adapter's wire dtype: the trainer's compute dtype (trainer/model/parallel.py compute_dtype),
# fp32 on CPU, bf16 under FSDP2 mixed precision on GPU.
WIRE_DTYPES = (torch.float32, torch.bfloat16)


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M's architecture (no hub access here, so the weights are random)."""
    return LlamaConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=2048,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
    )  # fmt: skip


def base_weights(config: LlamaConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A randomly initialised model's weights in the engine dtype: the all-linear projections
    (LoRA targets) and the rest (a tied head counted once)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(ENGINE_DTYPE)
    projections, rest, seen = {}, {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        is_target = name.endswith(".weight") and name.split(".")[-2] in ALL_LINEAR
        (projections if is_target else rest)[name] = t.detach().clone()
    return projections, rest


def lora_for(
    base: dict[str, torch.Tensor], rank: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    out = {}
    for name, w in base.items():
        module = name.removesuffix(".weight")
        out_f, in_f = w.shape
        A, B = torch.randn(rank, in_f, generator=g), torch.randn(out_f, rank, generator=g)
        out[f"base_model.model.{module}.lora_A.weight"] = A.to(dtype)
        out[f"base_model.model.{module}.lora_B.weight"] = B.to(dtype)
    return out


def receiver_main(port: int) -> None:
    """A sidecar that only receives and acknowledges: the transport alone is measured."""
    receiver = SyncReceiver(HOST, port, 0, backend="gloo", timeout=300, key=SYNC_KEY)
    while True:
        try:
            header, _ = receiver.recv(timeout=600)
        except SyncClosed:
            return
        receiver.ack(header.version)


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float, Any]:
    """Median and min wall seconds of `reps` calls after one warm-up, and the last result.

    The min is there because the machine is shared: it is the least-disturbed sample.
    """
    result = fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples), result


class Bench:
    def __init__(self, sender: SyncSender, reps: int):
        self.sender, self.reps, self.version = sender, reps, 0

    def sync_seconds(self, tensors: dict[str, torch.Tensor], rank: int) -> tuple[float, float, int]:
        modules = tuple(sorted({n.removeprefix("base_model.model.").split(".lora_")[0]
                                for n in tensors if ".lora_" in n}))  # fmt: skip

        def once():
            self.version += 1
            header = SyncHeader(
                version=self.version,
                mode="merged",
                rank=rank,
                alpha=2.0 * rank,
                scaling=lora_scaling(2.0 * rank, rank),
                target_modules=modules,
            )
            result = self.sender.send(tensors, header)
            assert result.ok, result.failed
            return result.stats.bytes

        return timed(once, self.reps)

    def record(self, model: str, weights: str, base: tuple[dict, dict], rank: int,
               lora_dtype: torch.dtype = torch.float32) -> dict:  # fmt: skip
        projections, rest = base
        lora = lora_for(projections, rank, lora_dtype)
        pairs = group_lora_pairs(lora)
        scaling = lora_scaling(2.0 * rank, rank)
        base_weights = BaseWeights(projections)

        def merge_all() -> dict[str, torch.Tensor]:
            return dict(merge_adapter(base_weights, pairs, scaling, ENGINE_DTYPE))

        merge_s, merge_min, merged = timed(merge_all, self.reps)
        adapter_s, adapter_min, adapter_bytes = self.sync_seconds(lora, rank)
        full_s, full_min, full_bytes = self.sync_seconds(merged | rest, rank)
        return {
            "model": model,
            "weights": weights,
            "rank": rank,
            "targets": "all-linear",
            "modules": len(pairs),
            "lora_dtype": str(lora_dtype).removeprefix("torch."),
            "engine_dtype": "bfloat16",
            "adapter_bytes": adapter_bytes,
            "full_bytes": full_bytes,
            "adapter_fraction": round(adapter_bytes / full_bytes, 4),
            "adapter_s": round(adapter_s, 5),
            "full_s": round(full_s, 5),
            "merge_s": round(merge_s, 5),
            "adapter_plus_merge_s": round(adapter_s + merge_s, 5),
            "bytes_ratio": round(full_bytes / adapter_bytes, 2),
            "time_ratio": round(full_s / adapter_s, 2),
            "adapter_s_min": round(adapter_min, 5),
            "full_s_min": round(full_min, 5),
            "merge_s_min": round(merge_min, 5),
        }


# ---------------------------------------------------------------- merged push into a real vLLM


def _random_lora(shapes: dict, targets: list[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lora: dict[str, torch.Tensor] = {}
    for name in targets:
        module, (out_f, in_f) = name.removesuffix(".weight"), shapes[name]
        lora[f"base_model.model.{module}.lora_A.weight"] = (
            torch.randn(rank, in_f, generator=g) * 0.02
        )
        lora[f"base_model.model.{module}.lora_B.weight"] = (
            torch.randn(out_f, rank, generator=g) * 0.02
        )
    return lora


def _sidecar_rss(url: str, model: str, where: str, dtype: str, rank: int, shm: str, q) -> None:
    """A fresh process as a sidecar: RSS before any update and after three merged pushes."""
    from bench.common import rss_mb
    from lorarl.rollout.applier import UpdateApplier
    from lorarl.rollout.vllm_engine import VLLMEngine, checkpoint_weight_shapes
    from lorarl.sync.buckets import pack

    shapes = checkpoint_weight_shapes(model)
    targets = [n for n in shapes if n.endswith(".weight") and n.split(".")[-2] in ALL_LINEAR]
    engine = VLLMEngine(url, shm_dir=Path(shm) / where, known_shapes=shapes, timeout=600)
    applier = UpdateApplier(engine, model, "merged", rank, dtype, Path(shm) / where, where)
    before = rss_mb(os.getpid())
    for version in range(1, 4):
        lora = _random_lora(shapes, targets, rank, version)
        header = SyncHeader(
            version=version, mode="merged", rank=rank, alpha=2.0 * rank,
            scaling=lora_scaling(2.0 * rank, rank),
            target_modules=tuple(sorted(group_lora_pairs(lora))),
        ).with_buckets(pack(lora, DEFAULT_BUCKET_BYTES))  # fmt: skip
        applier.apply(header, lora)
    engine.close()
    q.put({"before_MB": before["VmRSS"], **{f"after_3_pushes_{k}_MB": v
           for k, v in rss_mb(os.getpid()).items()}})  # fmt: skip


def engine_push(reps: int, dtype: str = "bfloat16", rank: int = 8) -> dict[str, Any]:
    """Per-step merged push into a real vLLM CPU server on SmolLM2-135M-Instruct, both ways.

    `sidecar`: the sidecar merges W0 + s·B@A from its host base copy and pushes every targeted
    weight as a safetensors file on /dev/shm for vLLM's `reload_weights`; `engine`: the sidecar
    hands the A/B tensors only and each vLLM worker merges from its own pristine copy
    (`lorarl_merge_adapter`). Both run through `UpdateApplier.apply` on the same server,
    alternating per step, median/min of `reps` after one warm-up each; `bytes_to_engine` is what
    the sidecar wrote for the engine to read. The last step's weights are read back through the
    worker extension and compared bit for bit between the two paths.
    """
    import shutil
    import subprocess

    from safetensors.torch import load_file

    from harness.engines.vllm_serve import stop_server_group
    from lorarl.local.ports import free_port
    from lorarl.rollout.applier import UpdateApplier
    from lorarl.rollout.vllm_engine import (
        VLLMEngine,
        checkpoint_weight_shapes,
        vllm_launch_command,
    )
    from lorarl.sync.buckets import pack

    root = Path(__file__).resolve().parents[1]
    model = root / ".cache" / "lorarl" / "models" / "SmolLM2-135M-Instruct"
    if not (model / "config.json").is_file():
        from lorarl.local.models import prepare_smollm2

        prepare_smollm2(model.parent)
    python = os.environ.get("LORARL_ENGINE_PYTHON", str(root / ".venv-engine" / "bin" / "python"))
    run_dir = Path(f"/tmp/lorarl-bench-sync-{os.getpid()}")
    shm = Path(f"/dev/shm/lorarl-bench-sync-{os.getpid()}")
    port = free_port()
    argv, env = vllm_launch_command(model, port, served_model_name="m", run_dir=run_dir,
                                    dtype=dtype, max_model_len=512, python=python)  # fmt: skip
    Path(env["TMPDIR"]).mkdir(parents=True)
    shapes = checkpoint_weight_shapes(model)
    targets = [n for n in shapes if n.endswith(".weight") and n.split(".")[-2] in ALL_LINEAR]
    probe = [targets[0], targets[len(targets) // 2], targets[-1]]
    with open(run_dir / "vllm.log", "w") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        engine = VLLMEngine(f"http://127.0.0.1:{port}", shm_dir=shm / "merged",
                            known_shapes=shapes, timeout=600)  # fmt: skip
        try:
            engine.wait_ready(600)
            appliers = {
                where: UpdateApplier(engine, model, "merged", rank, dtype, shm / "adapters", where)
                for where in ("sidecar", "engine")
            }
            samples: dict[str, list[dict[str, float]]] = {where: [] for where in appliers}
            served: dict[str, dict[str, torch.Tensor]] = {}
            version = 0
            for step in range(reps + 1):
                lora = _random_lora(shapes, targets, rank, 100 + step)
                modules = tuple(sorted(group_lora_pairs(lora)))
                for where, applier in appliers.items():
                    version += 1
                    header = SyncHeader(
                        version=version, mode="merged", rank=rank, alpha=2.0 * rank,
                        scaling=lora_scaling(2.0 * rank, rank), target_modules=modules,
                    ).with_buckets(pack(lora, DEFAULT_BUCKET_BYTES))  # fmt: skip
                    start = time.perf_counter()
                    applied = applier.apply(header, lora)
                    total = time.perf_counter() - start
                    if step > 0:
                        samples[where].append({"total_s": total, **applied.seconds,
                                               "bytes": engine.last_push_bytes})  # fmt: skip
                    if step == reps:
                        out = run_dir / f"readback-{where}.safetensors"
                        engine.collective_rpc("lorarl_read_weights", names=probe,
                                              out_path=str(out))  # fmt: skip
                        served[where] = load_file(str(out))
            worker = engine.last_worker_report[0] if engine.last_worker_report else {}
            base_copy = appliers["sidecar"]._base
            rss = {}
            ctx = mp.get_context("spawn")
            for where in appliers:
                q = ctx.Queue()
                url = f"http://127.0.0.1:{port}"
                args = (url, str(model), where, dtype, rank, str(shm), q)
                child = ctx.Process(target=_sidecar_rss, args=args)
                child.start()
                rss[where] = q.get(timeout=600)
                child.join(timeout=60)
        finally:
            engine.close()
            stop_server_group(proc)
            shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # the server's log and temp dirs

    def stats(where: str) -> dict[str, Any]:
        rows = samples[where]
        med = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0] if k != "bytes"}
        return {"median_s": med, "min_total_s": round(min(r["total_s"] for r in rows), 4),
                "bytes_to_engine": int(rows[-1]["bytes"])}  # fmt: skip

    return {
        "model": "SmolLM2-135M-Instruct (real checkpoint, fp32 on disk)",
        "engine": f"vLLM CPU, {dtype}, TP=1",
        "rank": rank,
        "targets": "all-linear",
        "modules": len(targets),
        "lora_dtype": "float32",
        "sidecar": stats("sidecar"),
        "engine_merge": stats("engine"),
        "bitwise_equal": all(torch.equal(served["engine"][n], served["sidecar"][n]) for n in probe),
        "sidecar_base_copy_bytes": {
            "sidecar": sum(t.numel() * t.element_size() for t in (base_copy or {}).values()),
            "engine_merge": 0,
        },
        "engine_pristine_copy_bytes": int(worker.get("pristine_bytes", 0)),
        "sidecar_rss": {"sidecar": rss["sidecar"], "engine_merge": rss["engine"]},
        "worker_last_step_s": {
            k: round(float(v), 4) for k, v in worker.items() if k.endswith("_s")
        },
    }


def table(records: list[dict]) -> str:
    lines = ["| model | r | adapter dtype | adapter MB | full MB | adapter/full | adapter s | "
             "full s | time x | merge s |", "|---" * 10 + "|"]  # fmt: skip
    for r in records:
        lines.append(
            f"| {r['model']} | {r['rank']} | {r['lora_dtype']} | {r['adapter_bytes'] / 1e6:.2f} | "
            f"{r['full_bytes'] / 1e6:.2f} | {r['adapter_fraction']} | {r['adapter_s']:.4f} | "
            f"{r['full_s']:.4f} | {r['time_ratio']} | {r['merge_s']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--engine-push",
        action="store_true",
        help="only the merged push into a real vLLM (sidecar vs engine merge); "
        "updates the `engine_push` entry of --out and keeps its records",
    )
    args = parser.parse_args()
    if args.engine_push:
        host = machine(engine="vLLM CPU server, same machine")
        result = {**engine_push(args.reps), "reps": args.reps}
        host["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
        result["machine"] = host
        report = json.loads(args.out.read_text()) if args.out.is_file() else {"benchmark": "sync"}
        report["engine_push"] = result
        write_results(args.out, report)
        print(json.dumps(result, indent=1))
        return

    host = machine(transport="gloo, loopback, 1 receiver process",
                   bucket_bytes=DEFAULT_BUCKET_BYTES)  # fmt: skip
    sender = SyncSender(HOST, 0, backend="gloo", timeout=300, key=SYNC_KEY)
    proc = mp.get_context("spawn").Process(target=receiver_main, args=(sender.port,))
    proc.start()
    if len(sender.wait_registered(1, timeout=120)) != 1:
        raise SystemExit("the receiver process never registered")
    bench = Bench(sender, args.reps)
    records = []
    try:
        tiny = base_weights(tiny_config("llama"))
        records.append(bench.record("tiny-llama", "random (harness tiny_config)", tiny, 8))
        smol = base_weights(smollm2_config())
        for rank in args.ranks:
            for dtype in WIRE_DTYPES:
                records.append(bench.record("SmolLM2-135M", "random (SmolLM2-135M config)", smol,
                                            rank, dtype))  # fmt: skip
                print(table(records[-1:]).splitlines()[-1], flush=True)
    finally:
        sender.close()
        proc.join(timeout=30)
    host["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    for r in records:
        r["machine"] = host
    report = {"benchmark": "sync", "reps": args.reps, "machine": host, "records": records}
    write_results(args.out, report)
    print(table(records))


if __name__ == "__main__":
    main()
