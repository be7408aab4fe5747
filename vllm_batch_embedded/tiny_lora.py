"""A rank-8 LoRA adapter for the tiny chat model, built locally in a second, in PEFT's layout.

vLLM loads it as it loads any PEFT adapter (``--enable-lora --lora-modules name=path``):
an ``adapter_config.json`` and an ``adapter_model.safetensors`` whose keys are
``base_model.model.model.layers.<i>.self_attn.<proj>.lora_A.weight`` (rank x in) and
``...lora_B.weight`` (out x rank). PEFT initialises B to zero, which would make the
adapter a no-op; here both A and B are random and large next to the base weights, so
greedy answers through the adapter differ from the base model's, and two adapters built
with different seeds differ from each other. Nothing is downloaded.

Build from the command line with::

    python -m vllm_batch_embedded.tiny_lora .cache/models/tiny-lora-a 1
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from vllm_batch_embedded.tiny_model import HIDDEN_SIZE, NUM_LAYERS

__all__ = ["LORA_RANK", "LORA_TARGET_MODULES", "build_tiny_lora_adapter"]

LORA_RANK = 8
LORA_ALPHA = 16
#: The attention projections of the tiny model; all four are HIDDEN_SIZE x HIDDEN_SIZE.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# Against base weights of std 0.02, B @ A * alpha / r has entries of std ~0.6: the
# adapter dominates the attention, so its greedy answers cannot match the base's.
_WEIGHT_STD = 0.15
_STAMP_FILE = ".airflow-vllm-batch-adapter-complete"


def _adapter_config(base_model: str) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(LORA_TARGET_MODULES),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def _adapter_weights(seed: int) -> dict[str, object]:
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * _WEIGHT_STD).to(torch.bfloat16)

    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in LORA_TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = normal(LORA_RANK, HIDDEN_SIZE).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = normal(HIDDEN_SIZE, LORA_RANK).contiguous()
    return tensors


def build_tiny_lora_adapter(
    target_dir: str | os.PathLike[str], *, seed: int, base_model: str = "tiny-llama-chat"
) -> Path:
    """
    Build (once) a rank-8 LoRA adapter for the tiny chat model into ``target_dir``.

    A complete build is reused; a partial one is replaced. Two seeds give two adapters
    whose answers differ from each other and from the base model's.

    :param target_dir: the adapter's directory (created).
    :param seed: the seed of its random A and B weights.
    :param base_model: ``base_model_name_or_path`` in ``adapter_config.json``. Default
        ``"tiny-llama-chat"``.
    """
    from safetensors.torch import save_file

    target = Path(target_dir)
    if (target / _STAMP_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        (staging / "adapter_config.json").write_text(json.dumps(_adapter_config(base_model), indent=2) + "\n")
        save_file(
            _adapter_weights(seed), str(staging / "adapter_model.safetensors"), metadata={"format": "pt"}
        )
        (staging / _STAMP_FILE).write_text(f"seed={seed}\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m vllm_batch_embedded.tiny_lora TARGET_DIR SEED", file=sys.stderr)
        return 2
    print(build_tiny_lora_adapter(args[0], seed=int(args[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
