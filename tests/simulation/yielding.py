"""The fault simulator's stand-in for a warm server shared with interactive users, whose queue fills and drains.

:class:`SimYieldingEngine` is the simulated server engine (the real ``produce``: checkpoint
parts, resume, the last try's set-aside lines) with the warm engine's real way of deciding
how to yield (``ConnectionEngine.neighbour_plan``: the priority only for a server that says
it runs priority scheduling) and the real :class:`~airflow_vllm_batch.serving.neighbour.InFlightController`
moving the bound. :class:`SimSharedServer` answers in *rounds*: a round answers as many
requests as the bound allows (at least the floor), while the interactive users' requests on
the server follow a random walk drawn from the seed (a burst fills the queue, then it drains);
between rounds the controller reads the server's load and moves the bound.

Checked here, in every schedule (a violation raises, and the campaign reports the seed): the
bound stays between the floor and the maximum, every round answers at least one request (the
batch always progresses), and a server that does not say it runs priority scheduling is never
sent a priority. The run protocol's invariants are checked by the campaign as for every engine.

New files only (``world.py`` and ``engines.py`` are used, not changed): the engine is registered
in :data:`~tests.simulation.engines.SIM_ENGINES` at import, and :func:`run_yielding_schedule` runs
the plan of a seed with it.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_vllm_batch.engines.options import WarmVLLMServer, YieldToInteractive
from airflow_vllm_batch.engines.server import ConnectionEngine
from airflow_vllm_batch.serving.neighbour import InFlightController, NeighbourPlan, Reading, ServerLoad
from tests.simulation.engines import SIM_ENGINES, SimServer, SimServerEngine
from tests.simulation.world import World, make_plan, simulation

if TYPE_CHECKING:
    from airflow_vllm_batch.serving import StreamStats

ENGINE = "sim-yielding"
#: The running places of the simulated server: beyond them, requests wait.
SLOTS = 6


class _SaidPolicy:
    """What the simulated warm server says about itself (``/server_info``), and the connection's extra."""

    def __init__(self, said: str | None) -> None:
        self.said = said
        self.stated_scheduling_policy = None
        self.base_url = "http://vllm.sim:8000"

    def scheduling_policy(self) -> str | None:
        return self.said


class SimSharedServer(SimServer):
    """The simulated server, shared with interactive users: answers in rounds of at most the bound."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.max_in_flight = world.rng.choice((4, 8, 16))
        self.warm_hook = _SaidPolicy(world.rng.choice(("priority", "fcfs", None)))
        self.neighbour: NeighbourPlan | None = None
        self.bounds: list[int] = []

    def run(self, requests: Any, *, journal: Any, skip: Any = None, **kwargs: Any) -> StreamStats:
        plan = self.neighbour
        assert plan is not None, "the yielding engine set no plan before the stream"
        if self.warm_hook.said != "priority":
            assert plan.priority is None, (
                f"a server that says {self.warm_hook.said!r} was to be sent priority {plan.priority}"
            )
        return super().run(self._in_rounds(requests, plan), journal=journal, skip=skip, **kwargs)

    def _in_rounds(self, requests: Any, plan: NeighbourPlan) -> Iterator[tuple[int, bytes]]:
        """The requests, a round at a time: between rounds the interactive load moves and the controller reads it."""
        rng, world = self.world.rng, self.world
        controller = InFlightController(self.max_in_flight, plan.min_in_flight, metrics=rng.random() < 0.9)
        others = rng.choice((0, 0, 3, 12))
        bound = controller.start(self._load(0, others) if controller.metrics else None).bound
        sent_in_round = 0
        for item in requests:
            if sent_in_round >= bound:
                # A round ends: the server's queue of interactive requests fills or drains, the controller checks.
                world.scheduler.sleep(1.0)
                others = max(0, others + rng.choice((-4, -2, -1, 0, 1, 2, 5)))
                readable = controller.metrics and rng.random() < 0.9
                reading = Reading(
                    self._load(sent_in_round, others) if readable else None,
                    sent_in_round,
                    rejections=int(rng.random() < 0.05),
                )
                bound = controller.update(reading).bound
                assert controller.floor <= bound <= self.max_in_flight, (
                    bound,
                    controller.floor,
                    self.max_in_flight,
                )
                self.bounds.append(bound)
                sent_in_round = 0
            sent_in_round += 1
            yield item

    def _load(self, in_flight: int, others: int) -> ServerLoad:
        total = in_flight + others
        return ServerLoad(
            waiting=max(0, total - SLOTS),
            running=min(total, SLOTS),
            kv_cache_usage=min(1.0, total / (4 * SLOTS)),
        )


class SimYieldingEngine(SimServerEngine):
    """The simulated server engine, yielding to the interactive users of a :class:`SimSharedServer`."""

    name = "sim-yielding"

    @property
    def server(self) -> SimSharedServer:  # type: ignore[override]
        if "_shared" not in self.__dict__:
            assert self.world is not None
            self.__dict__["_shared"] = SimSharedServer(self.world)
        return self.__dict__["_shared"]

    def identity(self) -> dict[str, Any]:
        return ConnectionEngine.identity(self)  # type: ignore[arg-type]

    def before_stream(self, info: Any, job: Any) -> None:
        yielding = self.options.yielding
        assert yielding is not None
        self.server.neighbour = ConnectionEngine.neighbour_plan(self, yielding)  # type: ignore[arg-type]


@dataclasses.dataclass(kw_only=True)
class SimYieldingOptions(WarmVLLMServer):
    """A warm server's options with ``yield_to_interactive`` on; ``args`` only because the world passes them (unused)."""

    args: Sequence[str] = ()
    yield_to_interactive: bool | YieldToInteractive = True

    def engine_class(self) -> type[SimYieldingEngine]:
        return SimYieldingEngine

    def mask_secrets(self) -> None:
        from airflow_vllm_batch.redaction import register_engine_secrets

        register_engine_secrets(list(self.args), None)


SIM_ENGINES[ENGINE] = SimYieldingOptions


def run_yielding_schedule(seed: int, workdir: Path) -> World:
    """Run the plan of ``seed`` (kills, zombies, S3 faults...) with the yielding engine; return its world for the invariants."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    plan = make_plan(seed)
    if plan.engine != "sim-server":
        # The server's faults: die, answer 429/5xx through every retry, answer twice, fail, stall.
        plan.engine_faults = {"die": 0.03, "transient": 0.05, "twice": 0.1, "fail": 0.05, "stall": 0.02}
    plan.engine = ENGINE
    world = World(plan, workdir)
    with simulation(world):
        world.run()
    world.s3.scheduler = None
    world.s3.faults = None
    return world
