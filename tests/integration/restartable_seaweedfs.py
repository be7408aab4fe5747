"""A SeaweedFS that can crash and come back on the same ports and data (test_supervised.py, benchmarks/chaos.py)."""

from __future__ import annotations

import os
import signal

from vllm_batch_embedded.seaweedfs import SeaweedFS


class RestartableSeaweedFS(SeaweedFS):
    """A SeaweedFS that can crash and come back on the same ports and data.

    The deployment's ``aws_default`` connection names the endpoint, so a restart must reuse
    the ports; the first start picks free ones as usual.
    """

    def _launch(self) -> None:
        if not self._ports:
            super()._launch()
            return
        # SIGKILL leaves the S3 gateway's Unix socket behind; weed would not bind it again.
        (self.data_dir / "s3.sock").unlink(missing_ok=True)
        self._spawn(self._ports)

    def crash(self) -> None:
        """SIGKILL the whole server at once (no graceful close of connections), then reap it."""
        assert self.pid is not None
        os.killpg(self.pid, signal.SIGKILL)
        self.stop()
