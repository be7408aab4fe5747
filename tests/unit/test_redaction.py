"""Secrets in engine_args and engine_env: found by the flag's name, masked, never in the identity (No secrets)."""

from __future__ import annotations

import pytest

from airflow_vllm_batch.redaction import (
    IDENTITY_PLACEHOLDER,
    redact_engine_args,
    redact_secrets,
    register_engine_secrets,
    secret_env_values,
    secret_values,
)
from tests.airflow_compat import redact

#: engine_args -> (their secret values, the args as logged)
CASES = {
    "hf-token": (["--hf-token", "hf_abcdef123"], ["hf_abcdef123"], ["--hf-token", "***"]),
    "hf-token-equals": (["--hf-token=hf_abcdef123"], ["hf_abcdef123"], ["--hf-token=***"]),
    "hf_token-underscore": (["--hf_token", "hf_abcdef123"], ["hf_abcdef123"], ["--hf_token", "***"]),
    "api-key": (["--api-key", "sk-12345678"], ["sk-12345678"], ["--api-key", "***"]),
    "secret-and-password": (
        ["--x-secret=abcdefgh", "--db-password", "p4ssw0rd!"],
        ["abcdefgh", "p4ssw0rd!"],
        ["--x-secret=***", "--db-password", "***"],
    ),
    "bare-hf-token-then-a-flag": (
        ["--hf-token", "--max-model-len", "512"],
        [],
        ["--hf-token", "--max-model-len", "512"],
    ),
    "not-secrets": (
        [
            "--max-num-batched-tokens",
            "4096",
            "--tokenizer",
            "tok",
            "--ssl-keyfile",
            "k.pem",
            "--kv-cache-dtype",
            "fp8",
        ],
        [],
        [
            "--max-num-batched-tokens",
            "4096",
            "--tokenizer",
            "tok",
            "--ssl-keyfile",
            "k.pem",
            "--kv-cache-dtype",
            "fp8",
        ],
    ),
}


@pytest.mark.parametrize(("args", "values", "logged"), CASES.values(), ids=CASES)
def test_secret_flags_are_found_by_name_in_both_forms(args, values, logged):
    assert secret_values(args) == values
    assert redact_engine_args(args) == logged


def test_the_identity_keeps_the_flag_with_a_placeholder():
    assert redact_engine_args(["--hf-token", "hf_a1b2c3d4"], IDENTITY_PLACEHOLDER) == [
        "--hf-token",
        "<secret>",
    ]


def test_engine_env_secrets_are_found_by_the_variables_name():
    assert secret_env_values(
        {"HF_TOKEN": "hf_zzz999", "VLLM_LOGGING_LEVEL": "INFO", "AWS_SECRET_ACCESS_KEY": "abc/def"}
    ) == [
        "hf_zzz999",
        "abc/def",
    ]


def test_registered_secrets_are_masked_by_airflows_masker_and_in_relayed_lines():
    register_engine_secrets(["--hf-token", "hf_registered_1"], {"HF_TOKEN": "hf_registered_env"})
    line = "args: Namespace(model='m', hf_token='hf_registered_1') env hf_registered_env"
    assert "hf_registered" not in redact(line)
    assert redact_secrets(line) == "args: Namespace(model='m', hf_token='***') env ***"
