"""Does SmolLM2-135M learn to use a calculator tool? `python -m bench.tools`.

Three parts, all in results/tools.json:

- unaided: accuracy on 3-digit products (`multiply`) with no tool, through the chat template,
  greedy and at temperature 1, scored by `math_answer`: the figure RL with a tool must beat;
- probe: the same questions with the `tool_calling` environment's messages (its `reset`): how
  often the first reply is a valid calculator call, and the accuracy once the tool's answer is
  given back (a plain re-rendered multi-turn loop, up to MAX_TURNS replies); once as the bare
  question (`system_text`: the environment's tool description is all the model gets) and once
  after two worked calls as chat turns (`demos`: the `multiply-tools` rows the example trains on);
- run: examples/tool-calling.yaml under `lorarl run --local`, shortened to `--steps`; the
  per-step reward and tool counters from the run's history.jsonl.

Each part runs only when what it needs exists (the environment, the API's `spec.environment`);
a part that cannot run says why in the results file instead of a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.common import ROOT, machine, write_results
from lorarl.data_tasks import make_rows, with_tool_demos, write_task_jsonl
from lorarl.local.ports import free_port
from lorarl.local.processes import Child
from lorarl.rewards import get_reward
from lorarl.rollout.vllm_engine import vllm_launch_command
from lorarl.trainer.data.prompts import prompt_text

RESULTS = ROOT / "bench" / "results" / "tools.json"
EXAMPLE = ROOT / "examples" / "tool-calling.yaml"
MODEL = ROOT / ".cache" / "lorarl" / "models" / "SmolLM2-135M-Instruct"
TASK_SEED = 1  # the example trains on seed 0's rows; the evaluation questions are other ones
MAX_TOKENS = 96  # per reply; the example's maxResponseTokens
MAX_TURNS = 3  # the example's environment.maxTurns
MAX_MODEL_LEN = 1536
SAMPLE_SEED = 1234
START_S = 600.0


def engine_python() -> str:
    return os.environ.get("LORARL_ENGINE_PYTHON", str(ROOT / ".venv-engine" / "bin" / "python"))


class Engine:
    """One vLLM CPU server (the plan's flags, fp32 like the example) and plain completions."""

    def __init__(self, model_dir: Path, run_dir: Path):
        port = free_port()
        argv, env = vllm_launch_command(
            model_dir, port, served_model_name="served", run_dir=run_dir, dtype="float32",
            kv_cache_gib=1, max_model_len=MAX_MODEL_LEN, python=engine_python(),
            worker_extension_cls=None,
        )  # fmt: skip
        Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{port}"
        self.child = Child("vllm", argv, {**os.environ, **env}, run_dir / "vllm.log")

    def __enter__(self) -> Engine:
        self.child.start()
        deadline = time.monotonic() + START_S
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.child.poll() is not None or time.monotonic() > deadline:
                self.child.stop()
                raise RuntimeError(f"vLLM did not start:\n{self.child.tail(40)}")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        self.child.stop()

    def complete(self, prompts: list[list[int]], temperature: float) -> list[str]:
        """One completion per token-id prompt, ended by the model's EOS or MAX_TOKENS."""
        body = {"model": "served", "prompt": prompts, "max_tokens": MAX_TOKENS,
                "temperature": temperature, "seed": SAMPLE_SEED,
                "skip_special_tokens": True}  # fmt: skip
        resp = httpx.post(f"{self.url}/v1/completions", json=body, timeout=1800)
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM: {resp.status_code} {resp.text[:500]}")
        return [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The trainer's rendering: the chat template with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def score(rows: list[dict[str, Any]], replies: list[str]) -> float:
    reward = get_reward("math_answer")
    pairs = zip(rows, replies, strict=True)
    hits = [reward(prompt_text(r["prompt"]), text, r["answer"], {}).score for r, text in pairs]
    return round(statistics.mean(hits), 4)


def unaided(engine: Engine, tokenizer: Any, rows: list[dict[str, str]]) -> dict[str, Any]:
    prompts = [render(tokenizer, [{"role": "user", "content": r["prompt"]}]) for r in rows]
    out: dict[str, Any] = {}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        t0 = time.perf_counter()
        replies = engine.complete(prompts, temperature)
        seconds = round(time.perf_counter() - t0, 1)
        out[name] = {"accuracy": score(rows, replies), "seconds": seconds, "examples": replies[:3]}
    return out


def probe(
    engine: Engine, tokenizer: Any, rows: list[dict[str, Any]], params: dict[str, Any]
) -> dict[str, Any]:
    """Episodes against the real environment, each turn re-rendered from the messages (the
    runner appends tokens instead; for counting calls and answers the two agree)."""
    from lorarl.environments.base import EpisodeItem
    from lorarl.environments.tool_calling import ToolCalling

    out: dict[str, Any] = {"params": params}
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        envs = [ToolCalling(**params) for _ in rows]
        convs = [env.reset(EpisodeItem(prompt=r["prompt"], answer=r["answer"], seed=i))
                 for i, (env, r) in enumerate(zip(envs, rows, strict=True))]  # fmt: skip
        first_msgs = len(convs[0])
        last = [""] * len(rows)
        live = list(range(len(rows)))
        calls = errors = first_valid = first_any = 0
        for turn in range(MAX_TURNS):
            replies = engine.complete([render(tokenizer, convs[i]) for i in live], temperature)
            still = []
            for i, text in zip(live, replies, strict=True):
                last[i] = text
                step = envs[i].step(text)
                n, k = step.info.get("tool_calls", 0), step.info.get("tool_errors", 0)
                calls, errors = calls + n, errors + k
                if turn == 0:
                    first_any += n > 0
                    first_valid += n > 0 and k == 0
                convs[i] = [*convs[i], {"role": "assistant", "content": text}, *step.messages]
                if not step.done:
                    still.append(i)
            live = still
            if not live:
                break
        example = next((convs[i] for i in range(len(rows)) if len(convs[i]) > first_msgs + 1),
                       convs[0])  # fmt: skip
        out[name] = {
            "valid_call_rate": round(first_valid / len(rows), 4),
            "any_call_rate": round(first_any / len(rows), 4),
            "accuracy": score(rows, last),
            "tool_calls": calls,
            "tool_errors": errors,
            "unfinished": len(live),  # still calling after MAX_TURNS replies
            "example": example[first_msgs - 1 :],
        }
    out["prompt_tokens"] = len(render(tokenizer, convs[0][:first_msgs]))
    return out


def environment_accepted() -> str | None:
    """Why the API cannot run the example yet, or None when it can."""
    proc = subprocess.run([sys.executable, "-m", "lorarl.cli.main", "validate", str(EXAMPLE)],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    return None if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()[-800:]


def train(steps: int, run_dir: Path) -> dict[str, Any]:
    """The example, shortened to `steps`, under `lorarl run --local`; figures from its history."""
    manifest = yaml.safe_load(EXAMPLE.read_text())
    for path in manifest["spec"]["data"]["trainFiles"]:  # what `lorarl prepare task` writes
        write_task_jsonl(ROOT / path, "multiply-tools", 512, seed=0)
    manifest["spec"]["training"]["totalSteps"] = steps
    manifest["spec"]["training"]["checkpointInterval"] = steps
    manifest["spec"]["training"]["export"] = ["adapter", "merged"]  # served for the re-probe
    job = run_dir / "tool-calling.yaml"
    job.write_text(yaml.safe_dump(manifest, sort_keys=False))
    command = [sys.executable, "-m", "lorarl.cli.main", "run", "--local", str(job),
               "--run-dir", str(run_dir / "run"), "--status-port", "0",
               "--engine-python", engine_python()]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"lorarl run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")  # fmt: skip
    history = run_dir / "run" / "history.jsonl"
    steps_ = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    per_step = [{key: s.get(key) for key in ("step", "rewardMean", "turnsMean", "toolCalls",
                                             "toolErrors", "environmentSeconds", "stepSeconds")}
                for s in steps_]  # fmt: skip
    rewards = [s["rewardMean"] for s in steps_]
    merged = next(iter(sorted((run_dir / "run").glob("**/merged/config.json"))), None)
    spec = manifest["spec"]
    settings = {"example": str(EXAMPLE.relative_to(ROOT)), "steps": steps,
                "prompts_per_step": spec["training"]["promptsPerStep"],
                "group_size": spec["algorithm"]["groupSize"], "lr": spec["optim"]["lr"],
                "max_turns": spec["environment"]["maxTurns"],
                "max_response_tokens": spec["data"]["maxResponseTokens"]}  # fmt: skip
    return {
        "command": " ".join(["lorarl", *command[3:]]),
        "settings": settings,
        "seconds": round(seconds, 1),
        "steps": len(steps_),
        "reward_first5": round(statistics.mean(rewards[:5]), 4),
        "reward_last5": round(statistics.mean(rewards[-5:]), 4),
        "median_step_s": round(statistics.median(s["stepSeconds"] for s in steps_), 2),
        "per_step": per_step,
        "merged": merged.parent if merged else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200, help="questions per measurement")
    parser.add_argument("--steps", type=int, default=12, help="training steps of the run")
    parser.add_argument("--skip-run", action="store_true", help="only the measurements")
    parser.add_argument("--run-only", action="store_true",
                        help="only the run; keep the measurements already in --out")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    given = " ".join(["python -m bench.tools", *(argv if argv is not None else sys.argv[1:])])
    if args.run_only:
        report = json.loads(args.out.read_text())
        report["command"] = f"{report['command']}; then {given}"
        report["run_machine"] = machine()
    else:
        report = {**measure(args.prompts), "command": given}
        write_results(args.out, report)  # the measurements survive a failed run
    if args.skip_run:
        report["run"] = {"skipped": "--skip-run"}
    elif (why := environment_accepted()) is not None:
        report["run"] = {"skipped": f"the example does not validate yet: {why}"}
    else:
        with tempfile.TemporaryDirectory(prefix="lorarl-tools-run-") as tmp:
            report["run"] = train(args.steps, Path(tmp))
            report["per_step"] = report["run"].pop("per_step")  # a table of its own
            merged = report["run"].pop("merged")
            if merged is None:
                report["trained_probe_demos"] = {"skipped": "the run wrote no merged model"}
            else:  # the trained model on the held-out questions, as probe_demos saw the base
                report["trained_probe_demos"] = reprobe(merged, args.prompts, Path(tmp))
        report.get("run_machine", report["machine"])["load_avg_1m_at_end"] = round(
            os.getloadavg()[0], 2
        )
    write_results(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if "machine" not in k}, indent=2)[:4000])


def reprobe(model: Path, prompts: int, work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [with_tool_demos(r) for r in make_rows("multiply", prompts, seed=TASK_SEED)]
    params = yaml.safe_load(EXAMPLE.read_text())["spec"]["environment"]["params"]
    with Engine(model, work / "reprobe") as e:
        out = probe(e, tokenizer, rows, params)
    print("trained_probe_demos", json.dumps({k: (v.get("valid_call_rate"), v.get("accuracy"))
          for k, v in out.items() if k in ("greedy", "sampled")}), flush=True)  # fmt: skip
    return out


def measure(prompts: int) -> dict[str, Any]:
    """The unaided accuracy and both probes, on one vLLM server."""
    from transformers import AutoTokenizer

    from lorarl.local.models import prepare_smollm2

    model = prepare_smollm2(MODEL.parent)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = make_rows("multiply", prompts, seed=TASK_SEED)
    settings = {"model": "SmolLM2-135M-Instruct", "engine": "vllm (CPU, float32)",
                "task": "multiply (3-digit x 3-digit)", "task_seed": TASK_SEED,
                "prompts": len(rows), "max_tokens_per_reply": MAX_TOKENS, "max_turns": MAX_TURNS,
                "reward": "math_answer (last number)", "sampled_temperature": 1.0,
                "sample_seed": SAMPLE_SEED}  # fmt: skip
    report: dict[str, Any] = {"machine": machine(), "settings": settings}
    with tempfile.TemporaryDirectory(prefix="lorarl-tools-") as tmp, Engine(model, Path(tmp)) as e:
        report["unaided"] = unaided(e, tokenizer, rows)
        print(json.dumps({k: v["accuracy"] for k, v in report["unaided"].items()}), flush=True)
        try:
            import lorarl.environments.tool_calling  # noqa: F401
        except ImportError as exc:
            report["probe_system_text"] = {"skipped": f"no tool_calling environment ({exc})"}
            return report
        report["probe_system_text"] = probe(e, tokenizer, rows, {"tools": ["calculator"]})
        demos = [with_tool_demos(r) for r in rows]
        params = yaml.safe_load(EXAMPLE.read_text())["spec"]["environment"]["params"]
        report["probe_demos"] = probe(e, tokenizer, demos, params)
    for name in ("probe_system_text", "probe_demos"):
        print(name, json.dumps({k: v.get("valid_call_rate") for k, v in report[name].items()
                                if k in ("greedy", "sampled")}), flush=True)  # fmt: skip
    report["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return report


if __name__ == "__main__":
    main()
