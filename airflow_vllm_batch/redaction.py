"""Secrets in the engine's settings: found by the flag's name, masked where they enter, never in an identity.

Invariant *No secrets*. An engine's ``args`` may carry a credential (``--hf-token hf_...``,
``--api-key ...``): any flag whose name has the word token, key, secret, password, passwd,
credential(s) or apikey (``--hf-token``, ``--hf_token=...``; not ``--max-num-batched-tokens``
or ``--tokenizer``), in the ``--flag value`` and ``--flag=value`` forms; and its ``env``
may too (``HF_TOKEN``). As soon as the settings are read (and when the operator's templates
are rendered, before Airflow stores the rendered fields) every such value is registered
with Airflow's secrets masker (:func:`register_engine_secrets`), so every later log line,
ours or one relayed from vLLM (``args: Namespace(... hf_token='...')``), is masked; the
relays and the messages built from the engine's output also replace them explicitly
(:func:`redact_secrets`), so they stay masked where no masker runs. The run identity and
the answer cache's key hold the flag with :data:`IDENTITY_PLACEHOLDER` instead of the value
(:func:`redact_engine_args`): a rotated token is the same run.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping, Sequence

#: Words that make a flag's or a variable's name say it holds a secret.
SECRET_WORDS = frozenset(
    {"token", "key", "secret", "password", "passwd", "credential", "credentials", "apikey"}
)
#: What stands for a secret value in the run identity and cache keys.
IDENTITY_PLACEHOLDER = "<secret>"
#: What stands for a secret value in log lines and messages (Airflow's masker writes the same).
MASK = "***"

_MIN_LENGTH = 5
_WORD = re.compile(r"[-_.]+")
_known: set[str] = set()
_lock = threading.Lock()


def is_secret_name(name: str) -> bool:
    """Whether a flag (``--hf-token``) or variable (``HF_TOKEN``) name says its value is a secret."""
    return any(word in SECRET_WORDS for word in _WORD.split(name.lower().lstrip("-")))


def _secret_positions(args: Sequence[str]) -> Iterable[tuple[int, str, str | None]]:
    """``(index, flag, inline value)`` of each secret value: the next argument's index, or the ``--flag=value`` one's."""
    for index, arg in enumerate(args):
        if not isinstance(arg, str) or not arg.startswith("-"):
            continue
        flag, eq, value = arg.partition("=")
        if not is_secret_name(flag):
            continue
        if eq:
            if value:
                yield index, flag, value
        elif (
            index + 1 < len(args)
            and isinstance(args[index + 1], str)
            and not args[index + 1].startswith("--")
        ):
            # vLLM's --hf-token may stand alone (use the token of `huggingface-cli login`): a next flag is no value.
            yield index + 1, flag, None


def secret_values(args: Sequence[str]) -> list[str]:
    """The values of the secret flags in ``args`` (engine arguments, or a whole command line)."""
    return [value if value is not None else args[index] for index, _, value in _secret_positions(args)]


def redact_engine_args(args: Sequence[str], placeholder: str = MASK) -> list[str]:
    """``args`` with every secret flag's value replaced by ``placeholder`` (the flag itself kept)."""
    out = list(args)
    for index, flag, value in _secret_positions(args):
        out[index] = f"{flag}={placeholder}" if value is not None else placeholder
    return out


def secret_env_values(env: Mapping[str, str] | None) -> list[str]:
    """The values of the variables of ``env`` whose names say they are secrets (``HF_TOKEN``)."""
    return [str(value) for name, value in (env or {}).items() if is_secret_name(name) and value]


def register_engine_secrets(
    engine_args: Sequence[str] | None, engine_env: Mapping[str, str] | None = None
) -> None:
    """Register the secrets of an engine's ``args`` and ``env`` with Airflow's masker and :func:`redact_secrets`."""
    values = [*secret_values(list(engine_args or ())), *secret_env_values(engine_env)]
    if not values:
        return
    from airflow.sdk.log import mask_secret

    for value in values:
        mask_secret(value)
    with _lock:
        # As Airflow's masker: a value this short would mask every such string in every line.
        _known.update(v for v in values if len(v) >= _MIN_LENGTH)


def redact_secrets(text: str) -> str:
    """``text`` with every registered engine secret replaced by ``***`` (for relayed lines and messages)."""
    if not _known:
        return text
    with _lock:
        known = sorted(_known, key=len, reverse=True)
    for value in known:
        if value in text:
            text = text.replace(value, MASK)
    return text
