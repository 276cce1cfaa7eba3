"""Engine-vs-trainer logprob mismatch per sync mode, real bf16 vLLM CPU: `python -m bench.mismatch`.

Per model, two vLLM CPU servers in bf16 run as a job's engine would (the plan's flags): `merged`
(no LoRA; the sidecar's `UpdateApplier` computes `bf16(W_base + s·B@A)` from the pristine base
and reloads it through the worker extension's path) and `adapter` (`--enable-lora`; the same
applier writes the PEFT adapter and vLLM serves `bf16(W)` plus its LoRA path). The trainer is
the fp32 PEFT policy scored with the trainer's own `sequence_logprobs`. The LoRA update is drawn
at random with `s·B@A` of relative size `delta` (Frobenius, per module; ~1e-3 is a few RL steps).
Per mode and delta:
- `mismatch`: |engine sampling logprob - trainer fp32 logprob| per token of the completions the
  engine sampled (temperature 1), the gap `rolloutCorrection` sees: mean, p50, p90, p99, max;
- `update`: on fixed sequences (the base engine's samples), teacher-forced logprobs before and
  after the update. With u_e = engine(base+delta) - engine(base) and u_t the trainer's same
  difference: `survives` = <u_e,u_t>/<u_t,u_t> (1: the update arrives at full size, 0: lost),
  `error` = ||u_e - u_t|| / ||u_t|| (0: exact), `corr` their correlation;
- `throughput`: completion tokens/s of one batched request (prompts x new tokens), best of reps.
`base` holds the same for the untouched model (bf16 alone). Writes bench/results/mismatch.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.common import machine, write_results
from lorarl.local.ports import free_port
from lorarl.local.processes import Child
from lorarl.plan.engines import SERVED_MODEL_NAME
from lorarl.rollout.applier import UpdateApplier
from lorarl.rollout.vllm_engine import VLLMEngine, checkpoint_weight_shapes, vllm_launch_command
from lorarl.sync.buckets import SyncHeader, pack
from lorarl.sync.merge import lora_scaling
from lorarl.sync.names import group_lora_pairs
from lorarl.sync.protocol import adapter_name
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_state_dict
from lorarl.trainer.model.logprobs import sequence_logprobs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "mismatch.json"
MODES = ("merged", "adapter")
PROMPTS = (
    "The cat sat on the mat and", "Once upon a time there was", "The capital of France is",
    "Water boils at a temperature of", "My favourite food is", "In the morning I like to",
    "The best way to learn is", "A good friend is someone who", "The sky is blue because",
    "To make a cup of tea you", "The old man walked to the", "Scientists have discovered that",
    "The train was late so we", "When it rains the streets", "She opened the door and saw",
    "Every winter the birds",
)  # fmt: skip
START_S = 600.0


def engine_python() -> str:
    return os.environ.get("LORARL_ENGINE_PYTHON", str(ROOT / ".venv-engine" / "bin" / "python"))


# ---------------------------------------------------------------- engine side


class Server:
    """One vLLM CPU server with the plan's flags, its client and the sidecar's real applier."""

    def __init__(self, model_dir: Path, mode: str, run_dir: Path, rank: int, kv_gib: int):
        self.mode, self.port = mode, free_port()
        argv, env = vllm_launch_command(
            model_dir, self.port, served_model_name=SERVED_MODEL_NAME, run_dir=run_dir,
            dtype="bfloat16", enable_lora=mode == "adapter", max_lora_rank=rank,
            kv_cache_gib=kv_gib, max_model_len=256, python=engine_python(),
        )  # fmt: skip
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        self.argv = argv
        self.child = Child(f"vllm-{mode}", argv, {**os.environ, **env}, run_dir / "vllm.log")
        self.url = f"http://127.0.0.1:{self.port}"
        self.shm = Path("/dev/shm") / f"lorarl-mismatch-{os.getpid()}"
        self.engine = VLLMEngine(self.url, shm_dir=self.shm,
                                 known_shapes=checkpoint_weight_shapes(model_dir))  # fmt: skip
        self.applier = UpdateApplier(self.engine, model_dir, mode, rank, "bfloat16",
                                     run_dir / "adapters")  # fmt: skip
        self.served = SERVED_MODEL_NAME

    def wait(self) -> None:
        deadline = time.monotonic() + START_S
        while not self.engine.health():
            if self.child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM {self.mode} did not start:\n{self.child.tail(40)}")
            time.sleep(0.5)

    def apply(self, header: SyncHeader, tensors: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        self.applier.apply(header, tensors)
        if self.mode == "adapter":
            self.served = adapter_name(header.version)
        return time.perf_counter() - t0

    def _post(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        resp = httpx.post(f"{self.url}/v1/completions", json={"model": self.served, **body},
                          timeout=900)  # fmt: skip
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM {self.mode}: {resp.status_code} {resp.text[:500]}")
        return sorted(resp.json()["choices"], key=lambda c: c["index"])

    def sample(self, prompts: list[list[int]], new_tokens: int, seed: int):
        """Completions at temperature 1 with the engine's logprob of each sampled token."""
        t0 = time.perf_counter()
        choices = self._post({"prompt": prompts, "max_tokens": new_tokens, "temperature": 1.0,
                              "seed": seed, "logprobs": 0, "return_token_ids": True,
                              "ignore_eos": True})  # fmt: skip
        seconds = time.perf_counter() - t0
        out = [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]
        return out, seconds

    def score(self, seqs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Teacher-forced engine logprob of every completion token given its prefix.

        vLLM CPU's LoRA logits path crashes on `prompt_logprobs` (bgmv_shrink shape error) and a
        token forced with `allowed_token_ids` reports the masked logprob (0), so each prefix is
        a 1-token prompt asking `logprob_token_ids` for its next token: one request per sequence.
        """

        def one(seq: tuple[list[int], list[int]]) -> list[float]:
            prompt, completion = seq
            choices = self._post({
                "prompt": [prompt + completion[:j] for j in range(len(completion))],
                "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "logprob_token_ids": sorted(set(completion)), "return_tokens_as_token_ids": True,
            })  # fmt: skip
            return [c["logprobs"]["top_logprobs"][0][f"token_id:{t}"]
                    for c, t in zip(choices, completion, strict=True)]  # fmt: skip

        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, seqs))


@contextlib.contextmanager
def servers(model_dir: Path, run_dir: Path, rank: int, kv_gib: int) -> Iterator[dict[str, Server]]:
    """Both modes' servers, started together (start-up is mostly imports), always stopped."""
    made = {m: Server(model_dir, m, run_dir / m, rank, kv_gib) for m in MODES}
    try:
        for s in made.values():
            s.child.start()
        with ThreadPoolExecutor(len(made)) as pool:
            list(pool.map(Server.wait, made.values()))
        yield made
    finally:
        for s in made.values():
            s.engine.close()
            s.child.stop()
            shutil.rmtree(s.shm, ignore_errors=True)  # the pushes' partial checkpoints' folder


# ---------------------------------------------------------------- trainer side


def set_delta(model: torch.nn.Module, delta: float, gen: torch.Generator) -> None:
    """Random LoRA factors whose update s·B@A has norm `delta` * ||W|| in every module."""
    for module in model.modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        s = module.scaling["default"]
        with torch.no_grad():
            a.copy_(torch.randn(a.shape, generator=gen) / a.shape[1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=gen))
            b.mul_(delta * module.base_layer.weight.norm() / (s * (b @ a)).norm())


def trainer_logprobs(model, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """fp32 logprobs of each completion with the trainer's code (right-padded batch)."""
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        attn[i, :n] = 1
        resp[i, len(p) : n] = 1
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=len(seqs))
    return [lp[i, len(p) : len(p) + len(c)] for i, (p, c) in enumerate(seqs)]


def update_tensors(model, delta: float, seed: int, version: int, mode: str):
    set_delta(model, delta, torch.Generator().manual_seed(seed))
    tensors = {k: v.detach().clone() for k, v in lora_state_dict(model).items()}
    cfg = model.peft_config["default"]
    header = SyncHeader(
        version=version, mode=mode, scaling=lora_scaling(cfg.lora_alpha, cfg.r), rank=cfg.r,
        alpha=cfg.lora_alpha, target_modules=tuple(sorted(group_lora_pairs(tensors))),
    )  # fmt: skip
    return header.with_buckets(pack(tensors, 64 << 20)), tensors


# ---------------------------------------------------------------- statistics


def gap_stats(engine: list[list[float]], trainer: list[torch.Tensor]) -> dict[str, float]:
    gap = torch.cat([(torch.tensor(e, dtype=torch.float64) - t.double()).abs()
                     for e, t in zip(engine, trainer, strict=True)])  # fmt: skip
    q = gap.quantile(torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"mean": gap.mean().item(), "p50": q[0], "p90": q[1], "p99": q[2],
            "max": gap.max().item(), "tokens": gap.numel()}  # fmt: skip


def flat(rows) -> torch.Tensor:
    return torch.cat([torch.as_tensor(r, dtype=torch.float64) for r in rows])


def update_stats(e0, e1, t0, t1) -> dict[str, float]:
    ue, ut = flat(e1) - flat(e0), flat(t1) - flat(t0)
    corr = torch.corrcoef(torch.stack([ue, ut]))[0, 1].item() if ue.std() > 0 else 0.0
    return {
        "trainer_update_mean_abs": ut.abs().mean().item(),
        "engine_update_mean_abs": ue.abs().mean().item(),
        "survives": (ue @ ut / (ut @ ut)).item(),
        "error": ((ue - ut).norm() / ut.norm()).item(),
        "corr": corr,
    }


# ---------------------------------------------------------------- one model


def measure(name: str, model_dir: Path, args: argparse.Namespace, run_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[: args.prompts]]
    model = apply_lora(load_base_model(model_dir, "float32"),
                       LoraSettings(rank=args.rank, alpha=args.alpha)).eval()  # fmt: skip
    out: dict[str, Any] = {"model": name, "path": str(model_dir), "deltas": {}}
    t_start = time.perf_counter()
    with servers(model_dir, run_dir / name, args.rank, args.kv_gib) as srv:
        out["engine_start_s"] = round(time.perf_counter() - t_start, 1)
        for s in srv.values():  # warm-up: first decode with logprobs pays a one-off cost
            s.sample(prompts[:2], 4, seed=1)
        # Base: the untouched model in bf16 on both servers; its samples are the fixed
        # sequences every update is scored on.
        base_samples, base_s = srv["merged"].sample(prompts, args.new_tokens, args.seed)
        fixed = [(p, c) for p, (c, _) in zip(prompts, base_samples, strict=True)]
        with model.disable_adapter():
            t_base = trainer_logprobs(model, fixed)
        e_base = {m: s.score(fixed) for m, s in srv.items()}
        out["base"] = {
            "mismatch": gap_stats([lp for _, lp in base_samples], t_base),
            "scored_mismatch": {m: gap_stats(e, t_base)["mean"] for m, e in e_base.items()},
            "tokens_per_s": {"merged_server": len(prompts) * args.new_tokens / base_s},
        }
        _, s_lora = srv["adapter"].sample(prompts, args.new_tokens, args.seed)
        out["base"]["tokens_per_s"]["adapter_server_no_adapter"] = (
            len(prompts) * args.new_tokens / s_lora
        )
        version = 0
        for delta in args.deltas:
            per_mode: dict[str, Any] = {}
            for mode, s in srv.items():
                version += 1
                header, tensors = update_tensors(model, delta, args.seed + 1, version, mode)
                apply_s = s.apply(header, tensors)
                s.sample(prompts[:2], 4, seed=1)  # warm-up: a new adapter's first batch is slow
                runs = [s.sample(prompts, args.new_tokens, args.seed) for _ in range(args.reps)]
                samples = runs[0][0]
                seqs = [(p, c) for p, (c, _) in zip(prompts, samples, strict=True)]
                t_policy = trainer_logprobs(model, seqs)
                t_fixed = trainer_logprobs(model, fixed)
                per_mode[mode] = {
                    "mismatch": gap_stats([lp for _, lp in samples], t_policy),
                    "update": update_stats(e_base[mode], s.score(fixed), t_base, t_fixed),
                    "tokens_per_s": len(prompts) * args.new_tokens / min(r[1] for r in runs),
                    "sample_s": [round(r[1], 3) for r in runs],
                    "apply_s": round(apply_s, 3),
                }
                print(name, f"delta={delta:g}", mode, per_mode[mode], flush=True)
            out["deltas"][f"{delta:g}"] = per_mode
    return out


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model, delta and mode (plus the untouched base): the figures to compare."""
    rows = []
    for name, r in results.items():
        base = r["base"]
        rows.append({"model": name, "delta": 0, "mode": "base (no update)",
                     "mismatch_mean": base["mismatch"]["mean"],
                     "mismatch_p99": base["mismatch"]["p99"],
                     "tokens_per_s": base["tokens_per_s"]["merged_server"]})  # fmt: skip
        for delta, modes in r["deltas"].items():
            for mode, m in modes.items():
                rows.append({
                    "model": name, "delta": float(delta), "mode": mode,
                    "mismatch_mean": m["mismatch"]["mean"], "mismatch_p50": m["mismatch"]["p50"],
                    "mismatch_p90": m["mismatch"]["p90"], "mismatch_p99": m["mismatch"]["p99"],
                    "update_survives": m["update"]["survives"],
                    "update_error": m["update"]["error"], "update_corr": m["update"]["corr"],
                    "tokens_per_s": m["tokens_per_s"],
                })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny-llama", "SmolLM2-135M"])
    p.add_argument("--deltas", type=float, nargs="+", default=[1e-3, 1e-2])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=2, help="timed sampling requests per mode")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gib", type=int, default=1)
    p.add_argument("--run-dir", type=Path, default=ROOT / ".cache" / "bench-mismatch")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from lorarl.local.models import prepare_smollm2, prepare_tiny_llama

    prepare = {"tiny-llama": prepare_tiny_llama, "SmolLM2-135M": prepare_smollm2}
    torch.set_num_threads(1)  # the engines get the cores; the trainer side is small
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings.update(engine="vllm (CPU)", engine_dtype="bfloat16", trainer_dtype="float32",
                    targets="all-linear", temperature=1.0,
                    prompts_text=list(PROMPTS[: args.prompts]))  # fmt: skip
    report: dict[str, Any] = {"benchmark": "mismatch", "machine": machine(),
                              "method": __doc__, "settings": settings, "results": {}}  # fmt: skip
    for name in args.models:
        report["results"][name] = measure(name, Path(prepare[name]()), args, args.run_dir)
    report["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    report["summary"] = summary(report["results"])
    write_results(args.out, report)


if __name__ == "__main__":
    main()
