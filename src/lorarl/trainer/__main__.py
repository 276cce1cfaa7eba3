"""`python -m lorarl.trainer --config job.yaml` (under torchrun: one process per GPU)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys

from lorarl.sync.auth import key_from_env
from lorarl.sync.errors import SyncKeyMissing
from lorarl.trainer.checkpoint.manager import CheckpointError
from lorarl.trainer.data.prompts import DataError
from lorarl.trainer.model.loading import AdapterError, ModelLoadError
from lorarl.trainer.settings import ConfigError, Endpoints, load_job

# Errors that mean "the job is wrong", reported as one line instead of a traceback.
USER_ERRORS = (
    ConfigError,
    ModelLoadError,
    AdapterError,
    DataError,
    CheckpointError,
    SyncKeyMissing,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorarl.trainer")
    parser.add_argument("--config", default=os.environ.get("LORARL_CONFIG"), required=False)
    args = parser.parse_args(argv)
    # A native crash (gloo, NCCL, a CUDA kernel) kills the rank with no Python traceback: print
    # every thread's stack to the pod log, so the restart event says where it died.
    faulthandler.enable(sys.__stderr__ or sys.stderr, all_threads=True)
    logging.basicConfig(
        level=os.environ.get("LORARL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(name)s: %(message)s",
    )
    if not args.config:
        print("lorarl-trainer: error: --config (or LORARL_CONFIG) is required", file=sys.stderr)
        return 2
    from lorarl.trainer.loop import Trainer
    from lorarl.trainer.model.parallel import init_distributed, shutdown_distributed

    try:
        job = load_job(args.config)
        endpoints = Endpoints.from_env()
        if endpoints.sync_world_size > 1:
            key_from_env()  # no sync key, no start: checked before anything loads
        ctx = init_distributed()
        Trainer.from_job(job, endpoints, ctx).run()
    except USER_ERRORS as exc:
        print(f"lorarl-trainer: error: {exc}", file=sys.stderr, flush=True)
        return 2
    # Every rank leaves together: a rank that tears its group down while rank 0 still closes the
    # sync channel aborts inside gloo. (On errors torchrun stops the group; no barrier then.)
    shutdown_distributed(ctx, barrier=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
