"""The docs pages the provider's messages send a reader to, named so that a pip user can find them.

A message that says "see docs/troubleshooting.md" helps only a reader of a clone: a pip install
has no ``docs/``. So a message names the page by its title and the section by its heading
(:func:`doc_ref`), as the built docs show them, and adds the page's address when the installed
distribution declares one: the ``Documentation`` entry of ``[project.urls]`` in
``pyproject.toml`` (``pip show -v airflow-vllm-batch`` lists it), the docs folder of the
project's repository, to which the page's file name and the heading's anchor are appended.

``tests/unit/test_messages.py`` checks that every page title named here is the first heading of
its ``docs/`` page and that every section a message names is a heading of that page.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re

DISTRIBUTION = "airflow-vllm-batch"

#: The title of each docs page a message may name (its first heading), and its file in ``docs/``.
PAGES = {
    "Troubleshooting": "troubleshooting.md",
    "The OpenAI Files and Batches API": "openai-api.md",
    "The run protocol and its invariants": "protocol.md",
}


@functools.cache
def documentation_url() -> str | None:
    """The ``Documentation`` URL the installed distribution declares (``[project.urls]``), without a trailing ``/``; None without one."""
    try:
        entries = importlib.metadata.metadata(DISTRIBUTION).get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in entries:
        label, _, url = entry.partition(",")
        if label.strip().lower() == "documentation" and url.strip():
            return url.strip().rstrip("/")
    return None


def anchor(heading: str) -> str:
    """The anchor of a heading, as MyST (``myst_heading_anchors``) and GitHub make it.

    :param heading: the heading's text, e.g. ``The engine kept dying``.
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def doc_ref(page: str, section: str | None = None) -> str:
    """Where to read on: ``see "<section>" in the docs' <page> page``, and its URL when the distribution declares one.

    :param page: the page's title, a key of :data:`PAGES` (e.g. ``Troubleshooting``).
    :param section: a heading of that page, as written there; None for the whole page.
    :raises KeyError: ``page`` is not a page of :data:`PAGES`.
    """
    file = PAGES[page]
    text = f'see "{section}" in the docs\' {page} page' if section else f"see the docs' {page} page"
    url = documentation_url()
    if url:
        text += f", {url}/{file}" + (f"#{anchor(section)}" if section else "")
    return text
