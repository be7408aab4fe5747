"""The model names an engine answers to: ``--served-model-name`` values and LoRA adapters.

vLLM 0.32 matches each request's ``body.model`` against the names of its base model and of
its LoRA adapters (``OpenAIServingModels``, built by ``init_app_state`` for the server and
the batch runner alike):

- the base model answers to every ``--served-model-name`` value, and to ``--model`` only
  when there is none: with ``--served-model-name`` the path is *not* a name any more;
- each adapter of ``--lora-modules`` answers to its own name. vLLM reads two forms,
  ``name=path`` and JSON ``{"name": ..., "path": ..., "base_model_name": ...}``, and
  loads adapters only with ``--enable-lora``.

:func:`served_models` reads those names from an engine's ``args`` (files only, vLLM is not
imported); :func:`check_adapters` checks, before any engine starts, that every adapter is
where the engine will look for it and has an ``adapter_config.json``. Both raise
deterministic errors that name the argument and the fix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_vllm_batch.docs_links import doc_ref
from airflow_vllm_batch.engines.vllm.model_files import (
    COMMIT,
    HUB_ID,
    downloads_off,
    hub_cache,
    hub_snapshot,
    read_options,
    switch_setting,
)
from airflow_vllm_batch.exceptions import AdapterNotFoundError, EngineArgumentsError

_ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoraAdapter:
    """One ``--lora-modules`` entry.

    :param name: the name requests use as ``body.model``.
    :param path: where vLLM loads it from: a local directory or a Hugging Face repo id.
    :param base_model_name: the base model it was trained for, when given (JSON form).
    """

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class ServedModels:
    """The names one engine answers to.

    :param base_names: the base model's names: ``--served-model-name`` values, else ``(model,)``.
    :param adapters: the LoRA adapters, in the order given.
    """

    base_names: tuple[str, ...]
    adapters: tuple[LoraAdapter, ...] = ()

    @property
    def default_name(self) -> str:
        """The base model's first name: what vLLM reports as the base model's ``model``."""
        return self.base_names[0]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may use: the base model's, then the adapters'."""
        return self.base_names + tuple(adapter.name for adapter in self.adapters)


def served_models(model: str, engine_args: Sequence[str] = (), *, engine: str = "VLLMRunner") -> ServedModels:
    """Return the names an engine started with ``--model model`` and ``engine_args`` answers to.

    :param model: the ``model`` argument (``--model``).
    :param engine_args: the further engine arguments; ``--served-model-name``,
        ``--lora-modules`` and ``--enable-lora`` are read.
    :param engine: the options class whose ``args`` these are, as messages name them (``VLLMRunner(args=...)``).
    :raises EngineArgumentsError: an adapter entry cannot be read, two names clash, or
        adapters are given without ``--enable-lora``.
    """
    options = read_options(engine_args)
    base = tuple(options.get("--served-model-name") or [model])
    adapters = tuple(_parse_adapter(item, engine) for item in options.get("--lora-modules") or () if item)
    if adapters and not _lora_enabled(engine_args):
        raise EngineArgumentsError(
            f"{engine}(args=...): --lora-modules names adapters ({', '.join(a.name for a in adapters)}) but vLLM loads "
            "adapters only with --enable-lora. Add '--enable-lora' (and '--max-lora-rank' at least the adapters' "
            "rank) to args."
        )
    names = base + tuple(a.name for a in adapters)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise EngineArgumentsError(
            f"{engine}(args=...): the model name(s) {', '.join(map(repr, repeated))} are given twice (--served-model-name "
            "and --lora-modules); vLLM could not tell which model a request means. Give each adapter its own name."
        )
    return ServedModels(base_names=base, adapters=adapters)


def served_models_of_server(cards: Sequence[Mapping[str, Any]], model: str) -> ServedModels:
    """Return the names a running server answers to, from its model cards (``GET /v1/models``).

    vLLM lists the base model's served names first (cards without ``parent``), then its
    adapters (cards whose ``parent`` is the base model). A warm server's arguments are not
    the task's to know; its listing is what it answers to.

    :param cards: the listing's ``data``.
    :param model: the ``model`` argument: the name the batch is run under, which the server
        must list (checked before, by the connection's hook).
    """
    base = tuple(str(c["id"]) for c in cards if not c.get("parent"))
    adapters = tuple(
        LoraAdapter(str(c["id"]), str(c.get("root") or ""), c.get("parent")) for c in cards if c.get("parent")
    )
    if model not in base + tuple(a.name for a in adapters):
        base = (model, *base)
    return ServedModels(base_names=base or (model,), adapters=adapters)


def check_adapters(
    served: ServedModels, env: Mapping[str, str] | None = None, *, engine: str = "VLLMRunner"
) -> None:
    """Check that every LoRA adapter is where the engine will load it from, with an ``adapter_config.json``.

    The engine's own rule (``get_adapter_absolute_path``): an absolute path or one starting
    with ``~`` is a directory; a relative path is one when it exists; anything else is a
    Hugging Face repo id, which must be in the local cache when downloads are off and is
    left to the engine when they are on.

    :param served: the engine's names, from :func:`served_models`.
    :param env: the engine's environment (``HF_HUB_OFFLINE``, ``HF_HOME``...). Default: this process's.
    :param engine: the options class whose ``args`` name the adapters, as messages name them.
    :raises AdapterNotFoundError: an adapter directory is missing or lacks ``adapter_config.json``.
    """
    env = os.environ if env is None else env
    for adapter in served.adapters:
        path = adapter.path
        if os.path.isabs(path) or path.startswith("~") or os.path.exists(path) or not HUB_ID.match(path):
            _require_adapter_dir(adapter, Path(path).expanduser(), engine)
            continue
        snapshot = _cached_adapter_snapshot(path, env)
        if snapshot is not None:
            _require_adapter_dir(adapter, snapshot, engine)
        elif downloads_off(env):
            raise AdapterNotFoundError(
                f"{engine}(args=...): LoRA adapter {adapter.name!r} ({path!r}) is neither a local directory nor in the "
                f"local Hugging Face cache ({hub_cache(env)}), and downloads are off (HF_HUB_OFFLINE or "
                f"TRANSFORMERS_OFFLINE). Give its local directory in --lora-modules, or run `hf download {path}`."
            )


#: The first vLLM whose CPU LoRA kernels leave base-model rows alone: its
#: ``vllm/lora/ops/torch_ops/lora_ops.py`` masks the rows whose index is -1
#: (``no_lora_mask``) instead of indexing the weights with it.
CPU_LORA_SLOTS_FIXED_IN = "0.33.0"


def _before(version: str | None, release: str) -> bool:
    """Whether ``version`` is older than ``release``; an unknown or unreadable version counts as older."""
    from packaging.version import InvalidVersion, Version

    try:
        return version is None or Version(version) < Version(release)
    except InvalidVersion:
        return True


def cpu_lora_slots_problem(
    served: ServedModels,
    engine_args: Sequence[str],
    requests_per_model: Mapping[str, int],
    vllm_version: str | None = None,
    *,
    engine: str = "VLLMRunner",
) -> str | None:
    """Return why vLLM on CPU would answer base-model lines through an adapter, or None.

    vLLM 0.32's CPU LoRA kernels (``vllm/lora/ops/torch_ops``, fixed in 0.33) pick each row's adapter
    weights with ``weights[index]``, and a base-model row's index is -1: Python's last
    element. Adapters take the first free of ``--max-loras`` slots, so when a batch uses as
    many adapters as there are slots, the last slot holds one and base-model lines batched
    with adapter lines are answered through it (silently: the answers look normal). A slot
    more than the adapters keeps the last one empty (zeros), and base lines right.

    :param served: the engine's names.
    :param engine_args: the engine arguments (``--max-loras``, default 1).
    :param requests_per_model: the batch's requests per name, from preflight.
    :param vllm_version: the engine's vLLM version: from :data:`CPU_LORA_SLOTS_FIXED_IN` on
        there is no problem; unknown counts as affected.
    :param engine: the options class whose ``args`` these are, as the answer names them.
    """
    if not _before(vllm_version, CPU_LORA_SLOTS_FIXED_IN):
        return None
    adapters = {a.name for a in served.adapters}
    used = sorted(name for name in requests_per_model if name in adapters)
    if not used or not any(name in served.base_names for name in requests_per_model):
        return None
    try:
        max_loras = int((read_options(engine_args).get("--max-loras") or ["1"])[-1])
    except ValueError:
        return None  # vLLM's own argument check names it
    if max_loras > len(used):
        return None
    return (
        f"{engine}(args=...): the batch mixes base-model lines with {len(used)} LoRA adapter(s) ({', '.join(used)}) "
        f"and --max-loras is {max_loras}, too few on a CPU. Set --max-loras to at least {len(used) + 1}, or give "
        f"base-model lines a batch of their own ({doc_ref('Troubleshooting', 'LoRA on a CPU')})."
    )


def _require_adapter_dir(adapter: LoraAdapter, path: Path, engine: str) -> None:
    where = f"{engine}(args=...): LoRA adapter {adapter.name!r} ({adapter.path!r})"
    if not path.is_dir():
        raise AdapterNotFoundError(
            f"{where}: no such directory on {os.uname().nodename}. An adapter must be a directory on the worker "
            "that runs the engine (or a Hugging Face repo id); fix its path in --lora-modules."
        )
    if not (path / _ADAPTER_CONFIG).is_file():
        raise AdapterNotFoundError(
            f"{where}: {path} has no {_ADAPTER_CONFIG}, so vLLM cannot load it as a LoRA adapter. Point "
            "--lora-modules at the directory PEFT saved (adapter_config.json and adapter_model.safetensors)."
        )


def _cached_adapter_snapshot(repo_id: str, env: Mapping[str, str]) -> Path | None:
    """The cached ``main`` snapshot of a hub adapter that holds an ``adapter_config.json``, or None."""
    snapshot = hub_snapshot(repo_id, "main", env)
    return snapshot if snapshot is not None and COMMIT.match(snapshot.name) and snapshot.is_dir() else None


def _parse_adapter(item: str, engine: str = "VLLMRunner") -> LoraAdapter:
    """Read one ``--lora-modules`` value the way vLLM's ``LoRAParserAction`` does."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        if name and path:
            return LoraAdapter(name=name, path=path)
    else:
        try:
            data = json.loads(item)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("path"), str):
            base = data.get("base_model_name")
            return LoraAdapter(
                name=data["name"], path=data["path"], base_model_name=base if isinstance(base, str) else None
            )
    raise EngineArgumentsError(
        f"{engine}(args=...): cannot read the --lora-modules value {item!r}. Use name=path "
        '(e.g. "sql=/models/sql-lora") or JSON (e.g. \'{"name": "sql", "path": "/models/sql-lora"}\').'
    )


def _lora_enabled(engine_args: Sequence[str]) -> bool:
    """Whether ``--enable-lora`` is on (``--enable-lora``; off by ``--no-enable-lora``, 0.33's ``--disable-lora``; last wins)."""
    return switch_setting(engine_args, "--enable-lora") is True
