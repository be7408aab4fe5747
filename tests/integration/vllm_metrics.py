"""What a running vLLM server says it answered: the tests' way to count requests really sent."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

_SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*\} (\S+)$", re.MULTILINE)


def requests_answered(base_url: str, *, starting: bool = False) -> float:
    """The server's ``vllm:request_success_total`` (summed over its labels), from ``/metrics``.

    ``/metrics`` needs no API key. With ``starting=True`` a server that is not listening
    yet counts 0 instead of raising (its process is up, its HTTP port not yet).
    """
    try:
        with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    except urllib.error.URLError:
        if starting:
            return 0.0
        raise
    return sum(float(v) for v in _SUCCESS.findall(metrics))
