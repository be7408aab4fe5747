"""Check a model before any engine starts, from its files only: are they there, and what kind of model is it.

:func:`inspect_model` reads files only: a local model directory must exist and look like a
model; a hub id must be in the local cache when downloads are off; and it tells whether the
model generates text or pools (embeddings, scores), the way vLLM decides it (from
``--runner``/``--convert``/``--task`` first, read with :func:`read_options`, then from the
files). Its engine-argument sibling is :mod:`~airflow_vllm_batch.engines.vllm.checks`.

Every failure is deterministic: retrying with the same settings fails the same way.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from airflow_vllm_batch.exceptions import IncompleteModelError, ModelNotFoundError

#: vLLM's default runner for an architecture name, by suffix, first match wins
#: (``_SUFFIX_TO_DEFAULTS`` in ``vllm/config/model.py``, vLLM 0.32).
_ARCHITECTURE_SUFFIX_KINDS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "generate"),
    ("ForConditionalGeneration", "generate"),
    ("ChatModel", "generate"),
    ("LMHeadModel", "generate"),
    ("ForTextEncoding", "pooling"),
    ("EmbeddingModel", "pooling"),
    ("ForSequenceClassification", "pooling"),
    ("ForTokenClassification", "pooling"),
    ("ForAudioClassification", "pooling"),
    ("ForImageClassification", "pooling"),
    ("ForVideoClassification", "pooling"),
    ("ClassificationModel", "pooling"),
    ("ForRewardModeling", "pooling"),
    ("RewardModel", "pooling"),
    ("Model", "pooling"),
)

#: Architectures vLLM's registry classifies against the suffix rule above.
_ARCHITECTURE_KINDS = {
    "ChatGLMModel": "generate",
    "BertForMaskedLM": "pooling",
    "RobertaForMaskedLM": "pooling",
}

#: ``--task`` values of vLLM before 0.10 (0.32 rejects the option; the arg check says so).
_TASK_KINDS = {
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "score": "pooling",
    "classify": "pooling",
    "reward": "pooling",
}

#: Sentence Transformers pooling modules: their presence in modules.json makes vLLM pool.
_ST_POOLING_MODULE_TYPES = frozenset(
    {
        "sentence_transformers.models.Pooling",
        "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    }
)

_CONFIG_FILES = ("config.json", "params.json")  # params.json: Mistral's own format
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TOKENIZER_FILES = frozenset(
    {"vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tekken.json"}
)
#: A Hugging Face hub repository id (``name`` or ``owner/name``).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
#: A full commit hash, as the hub cache names its snapshots.
COMMIT = re.compile(r"^[0-9a-f]{40}$")
_CLOUD_PREFIXES = ("s3://", "gs://", "az://", "http://", "https://")


@dataclass(frozen=True)
class ModelInfo:
    """What the files say about a model, before any engine loads it.

    :param model: the ``model`` value as given.
    :param kind: ``"generate"`` (chat, completions), ``"pooling"`` (embeddings, scores,
        classification) or None when the files do not tell (a hub model not in the cache).
    :param kind_source: what decided ``kind``, for messages, e.g. ``"--runner pooling"``
        or ``"config.json architectures ['LlamaForCausalLM']"``.
    :param served_names: the names requests may use as ``model``: ``--served-model-name``
        values, else ``[model]``.
    :param local_path: the model's directory or file when it is local or found in the
        Hugging Face cache, else None.
    :param architectures: ``architectures`` from config.json, when it was read.
    """

    model: str
    kind: Literal["generate", "pooling"] | None
    kind_source: str | None
    served_names: list[str]
    local_path: Path | None = None
    architectures: list[str] = field(default_factory=list)


def inspect_model(
    model: str,
    engine_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
) -> ModelInfo:
    """Check that ``model`` can be found, and tell what kind of model it is, from its files.

    A local model (an absolute path, one starting with ``./``, ``../`` or ``~``, or an
    existing directory) must exist and hold a config, weights and a tokenizer. A hub id
    (``org/name``) must be in the local Hugging Face cache when downloads are off
    (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``); with downloads on it is left to the
    engine. ``kind`` follows vLLM 0.32's rule: ``--runner``, else ``--convert``, else a
    Sentence Transformers pooling module, else the architecture name.

    :param model: the model name or directory, as the operator passes it to ``--model``.
    :param engine_args: the further engine arguments; ``--runner``, ``--convert``,
        ``--task`` (older vLLM), ``--served-model-name``, ``--tokenizer``,
        ``--skip-tokenizer-init``, ``--load-format`` and ``--revision`` are read.
    :param env: the engine's environment (``HF_HUB_OFFLINE``, ``HF_HOME``,
        ``HF_HUB_CACHE``). Default: this process's.
    :raises ModelNotFoundError: the local path does not exist, or the hub model is not
        cached while downloads are off.
    :raises IncompleteModelError: the local directory lacks a config, weights or a tokenizer.
    """
    env = os.environ if env is None else env
    options = read_options(engine_args)
    served = options.get("--served-model-name") or [model]
    flag_kind = _kind_from_flags(options)

    local = _local_model_path(model)
    if local is not None:
        _require_model_files(model, local, options)
        config_kind = _kind_from_files(local) if local.is_dir() else (None, None, [])
    elif model.startswith(_CLOUD_PREFIXES):
        # Object-store models are streamed by the engine (Run:ai streamer); nothing to read here.
        config_kind = (None, None, [])
    else:
        local = _cached_snapshot(model, _last(options.get("--revision")) or "main", env)
        if local is None and downloads_off(env):
            raise ModelNotFoundError(
                f"model: {model!r} is not in the local Hugging Face cache ({hub_cache(env)}) and downloads "
                f"are off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE). Run `hf download {model}` on the worker, "
                "point HF_HOME or HF_HUB_CACHE at a cache that has it, or give model= its local directory."
            )
        config_kind = _kind_from_files(local) if local is not None else (None, None, [])

    kind, source, architectures = config_kind
    if flag_kind[0] is not None:
        kind, source = flag_kind
    return ModelInfo(
        model=model,
        kind=kind,  # type: ignore[arg-type]
        kind_source=source,
        served_names=list(served),
        local_path=local,
        architectures=architectures,
    )


def option_name(arg: str) -> str | None:
    """Return the option ``arg`` names, normalised as vLLM does (``--a_b=1`` -> ``--a-b``), or None."""
    if arg.startswith("--"):
        return "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
        return arg[:2]
    return None


def read_options(engine_args: Sequence[str]) -> dict[str, list[str]]:
    """Return the values of each ``--option`` in ``engine_args`` (``--a x y``, ``--a=x``), last occurrence wins."""
    options: dict[str, list[str]] = {}
    args = [] if isinstance(engine_args, (str, bytes)) else [str(a) for a in engine_args]
    i = 0
    while i < len(args):
        name = option_name(args[i]) if args[i].startswith("--") else None
        if name is None:
            i += 1
            continue
        if "=" in args[i]:
            options[name] = [args[i].split("=", 1)[1]]
            i += 1
            continue
        values = []
        i += 1
        while i < len(args) and not (args[i].startswith("-") and option_name(args[i])):
            values.append(args[i])
            i += 1
        options[name] = values
    return options


_OFF_VALUES = ("false", "0", "no", "off")


def switch_setting(engine_args: Sequence[str], name: str) -> bool | None:
    """Whether vLLM's on/off option ``name`` (``--enable-x``) is on in ``engine_args``; None when not given.

    Every spelling vLLM takes counts, the last one wins: ``--enable-x``, ``--no-enable-x``,
    ``--enable-x=false`` (older releases took a value), and ``--disable-x``, which vLLM 0.33
    adds for every ``--enable-x`` (``EnableDisableAction``).

    :param engine_args: the engine arguments.
    :param name: the option's ``--enable-`` form, e.g. ``--enable-chunked-prefill``.
    """
    feature = name.removeprefix("--enable-")
    off = {f"--no-enable-{feature}", f"--disable-{feature}"}
    args = [] if isinstance(engine_args, (str, bytes)) else [str(a) for a in engine_args]
    setting = None
    for i, arg in enumerate(args):
        option = option_name(arg) if arg.startswith("--") else None
        if option == name:
            value = arg.split("=", 1)[1] if "=" in arg else None
            if (
                value is None
                and i + 1 < len(args)
                and args[i + 1].strip().lower() in (*_OFF_VALUES, "true", "1", "yes", "on")
            ):
                value = args[i + 1]
            setting = value is None or value.strip().lower() not in _OFF_VALUES
        elif option in off:
            setting = False
    return setting


def _last(values: list[str] | None) -> str | None:
    return values[-1] if values else None


def _kind_from_flags(options: Mapping[str, list[str]]) -> tuple[str | None, str | None]:
    """Return the kind ``--runner``, ``--convert`` or ``--task`` asks for, as vLLM resolves them."""
    runner = _last(options.get("--runner"))
    if runner in ("generate", "pooling"):
        return runner, f"--runner {runner}"
    convert = _last(options.get("--convert"))
    if convert in ("embed", "classify"):
        return "pooling", f"--convert {convert}"
    task = _last(options.get("--task"))
    if task in _TASK_KINDS:
        return _TASK_KINDS[task], f"--task {task}"
    return None, None


def _local_model_path(model: str) -> Path | None:
    """Return the path ``model`` names when it is meant as a local path, else None (a hub id)."""
    if model.startswith(("/", "./", "../", "~")) or model in (".", ".."):
        return Path(model)
    path = Path(model)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if not HUB_ID.match(model) and not model.startswith(_CLOUD_PREFIXES):
        # Not a valid hub id either (e.g. "models/a/b"): vLLM can only mean a path.
        return path
    return None


def _require_model_files(model: str, path: Path, options: Mapping[str, list[str]]) -> None:
    """Raise unless ``path`` exists and holds what vLLM loads: config, weights, tokenizer."""
    if not path.exists():
        hint = " ('~' is not expanded: give the full path)" if model.startswith("~") else ""
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        where = "" if path.is_absolute() else f" ({path.absolute()})"
        raise ModelNotFoundError(
            f"model: the local model directory {model!r}{where} does not exist{hint}"
            + (f" (the nearest existing parent is {str(parent)!r})" if parent is not None else "")
            + ". Give model= an existing model directory (with config.json and weights), "
            "or a Hugging Face id such as 'org/name'."
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return
        raise IncompleteModelError(
            f"model: {model!r} is a file, not a model directory. Give model= the directory "
            "that holds config.json, the weights and the tokenizer (a single file works only for .gguf)."
        )
    names = {p.name for p in path.iterdir()}
    missing = []
    if not names.intersection(_CONFIG_FILES):
        missing.append("config.json")
    load_format = _last(options.get("--load-format"))
    if load_format != "dummy" and not _has_weights(names):
        missing.append("weights (*.safetensors, *.bin or an index of them)")
    if "--tokenizer" not in options and "--skip-tokenizer-init" not in options and not _has_tokenizer(names):
        missing.append("tokenizer files (tokenizer.json, tokenizer.model or vocab files)")
    if missing:
        raise IncompleteModelError(
            f"model: the directory {model!r} does not look like a model: no {', no '.join(missing)}. "
            "Give model= the directory that holds the downloaded model (the one with config.json), "
            "or finish copying it there."
        )


def _has_weights(names: set[str]) -> bool:
    return any(n.endswith(_WEIGHT_SUFFIXES) or n.endswith(".index.json") for n in names)


def _has_tokenizer(names: set[str]) -> bool:
    return any(n.startswith("tokenizer") or n in _TOKENIZER_FILES or n.endswith(".tiktoken") for n in names)


def _kind_from_files(path: Path) -> tuple[str | None, str | None, list[str]]:
    """Return ``(kind, what decided it, architectures)`` from a model directory, as vLLM decides it."""
    if not path.is_dir():
        return None, None, []
    # vLLM pools any Sentence Transformers model with a pooling module, whatever its architecture.
    modules = _read_json(path / "modules.json")
    if isinstance(modules, list) and any(
        isinstance(m, dict) and m.get("type") in _ST_POOLING_MODULE_TYPES for m in modules
    ):
        return "pooling", "modules.json (a Sentence Transformers pooling model)", _architectures(path)
    architectures = _architectures(path)
    if not (path / "config.json").is_file():
        return None, None, architectures
    for arch in architectures:
        if arch in _ARCHITECTURE_KINDS:
            return _ARCHITECTURE_KINDS[arch], f"config.json architectures {architectures}", architectures
        for suffix, kind in _ARCHITECTURE_SUFFIX_KINDS:
            if arch.endswith(suffix):
                return kind, f"config.json architectures {architectures}", architectures
    # vLLM's default when no architecture tells.
    return "generate", f"config.json architectures {architectures} (vLLM's default)", architectures


def _architectures(path: Path) -> list[str]:
    config = _read_json(path / "config.json")
    archs = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def _read_json(path: Path) -> object:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_true(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def downloads_off(env: Mapping[str, str]) -> bool:
    """Whether the engine's environment turns Hugging Face downloads off (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``)."""
    return _is_true(env.get("HF_HUB_OFFLINE")) or _is_true(env.get("TRANSFORMERS_OFFLINE"))


def hub_cache(env: Mapping[str, str]) -> Path:
    """Return the Hugging Face hub cache the engine would use (huggingface_hub's own precedence)."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path(env.get("HOME", str(Path.home()))) / ".cache"
    return base / "huggingface" / "hub"


def hub_snapshot(repo_id: str, revision: str, env: Mapping[str, str]) -> Path | None:
    """Return where the hub cache keeps ``repo_id`` at ``revision`` (a commit, or a ref such as ``main``), or None.

    None when the cache has no such ref; the directory itself may not exist (the cache
    layout of huggingface_hub).
    """
    repo_dir = hub_cache(env) / f"models--{repo_id.replace('/', '--')}"
    if COMMIT.match(revision):
        commit = revision
    else:
        try:
            commit = (repo_dir / "refs" / revision).read_text(encoding="utf-8").strip()
        except OSError:
            return None
    return repo_dir / "snapshots" / commit


def _cached_snapshot(repo_id: str, revision: str, env: Mapping[str, str]) -> Path | None:
    """Return the cached snapshot of a hub model that has a config, or None."""
    snapshot = hub_snapshot(repo_id, revision, env)
    if snapshot is not None and any((snapshot / name).is_file() for name in _CONFIG_FILES):
        return snapshot
    return None
