"""Deterministic cooperative scheduling on a virtual clock: one schedule = one seed.

Every try of the task instance, and every thread the run code starts (the lease's
heartbeat), is an :class:`Actor`: a real thread that runs only while it holds the
scheduler's token. An actor gives the token back at every *step* (each S3 call, each
request an engine stand-in answers) and whenever it waits (a virtual ``sleep``, a
``threading.Event.wait``, a ``Thread.join``); the scheduler then picks who runs next with
the schedule's random generator. So only one actor runs at a time, and the seed alone
decides the interleaving: a replay of a seed is the same schedule, call for call.

Virtual time passes only in :meth:`Scheduler.sleep` and waits: when no actor can run, the
clock jumps to the earliest wake-up. The lease's heartbeat thread and its ``Event`` are
put on this clock by swapping the ``threading`` module that ``airflow_vllm_batch.lease``
sees (:func:`virtual_threading`): no production change, and the heartbeat's real code runs.

A try is killed (SIGKILL: no clean-up reaches S3) by raising :class:`TryKilled` at one of
its steps; from then on every step and wake-up of its actors raises it again.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Seconds of real time a schedule may take before it is declared hung (a bug in the simulator or a deadlock).
REAL_TIME_LIMIT_S = 60.0


class TryKilled(BaseException):
    """The try was killed at this step (a BaseException: the run code's ``except Exception`` does not see it)."""


@dataclass
class TryState:
    """One try of the task instance, as the simulator sees it."""

    number: int
    label: str
    dead: bool = False
    zombie: bool = False
    outcome: Any = None
    error: BaseException | None = None
    steps: int = 0
    kill_at: int | None = None
    zombie_at: int | None = None
    engine_steps: int = 0
    ended: bool = False
    #: Faults met by this try's calls and engine requests (S3 faults, engine faults); kills and zombies aside.
    faults: int = 0
    #: The input's ETags while it ran (what a manifest it returns may pin).
    inputs_seen: set = field(default_factory=set)
    #: While set, the try's whole process is stopped (every thread of it: the heartbeat too, as a
    #: suspended VM or a SIGSTOP stops them): none of its actors runs until this returns True or the
    #: virtual clock reaches :attr:`frozen_until`.
    frozen: Callable[[], bool] | None = None
    frozen_until: float = 0.0

    @property
    def run(self) -> str:
        """The task instance (DAG run) of this try: ``run-1``, ``run-2``, ``prior``."""
        return self.label.split("/")[0]


@dataclass(eq=False)
class Actor:
    name: str
    owner: TryState | None
    go: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    wake_at: float | None = None
    until: Callable[[], bool] | None = None
    blocked: bool = False

    @property
    def try_label(self) -> str | None:
        return self.owner.label if self.owner is not None else None

    def runnable(self, now: float) -> bool:
        if self.done:
            return False
        owner = self.owner
        if owner is not None and owner.frozen is not None and not owner.dead:
            if owner.frozen() or now >= owner.frozen_until:
                owner.frozen = None
            else:
                return False
        if not self.blocked or (self.owner is not None and self.owner.dead):
            return True
        if self.until is not None and self.until():
            return True
        return self.wake_at is not None and now >= self.wake_at


class Scheduler:
    """Runs actors one at a time on a virtual clock, choosing who runs next with ``rng``.

    :param rng: the schedule's random generator.
    :param on_step: called at every step of a try's actor, before it yields (kills, zombies, input rewrites).
    :param time_limit_s: virtual seconds after which every try still running is stopped (a Bounded violation).
    :param stay: the chance that the running actor keeps running at a step (swarm testing: each
        schedule draws its own, from long bursts to a switch at almost every step).
    """

    def __init__(
        self,
        rng: random.Random,
        on_step: Callable[[Actor], None] | None = None,
        time_limit_s: float = 6 * 3600,
        stay: float = 0.5,
    ) -> None:
        self.rng = rng
        self.stay = stay
        self.now = 0.0
        self.actors: list[Actor] = []
        self.on_step = on_step
        self.time_limit_s = time_limit_s
        self.out_of_time = False
        self.deadlocked = False
        self._current: Actor | None = None
        self._finished = threading.Event()
        self._errors: list[BaseException] = []

    def current_actor(self) -> Actor | None:
        return self._current

    # -- actors ---------------------------------------------------------------------

    def spawn(
        self,
        name: str,
        target: Callable[[], Any],
        owner: TryState | None,
        on_exit: Callable[[Actor, BaseException | None], None] | None = None,
    ) -> Actor:
        """Add an actor; it runs when the scheduler picks it."""
        actor = Actor(name, owner)
        self.actors.append(actor)

        def main() -> None:
            actor.go.wait()
            actor.go.clear()
            error: BaseException | None = None
            try:
                target()
            except BaseException as err:  # noqa: BLE001 - the simulator records every ending
                error = err
            if on_exit is not None:
                try:
                    on_exit(actor, error)
                except BaseException as err:  # noqa: BLE001
                    self._errors.append(err)
            actor.done = True
            self._pass_on(actor)

        threading.Thread(target=main, name=f"sim-{name}", daemon=True).start()
        return actor

    def run(self) -> None:
        """Run every actor to its end; return when none is left."""
        first = self._pick(None)
        if first is None:
            return
        self._current = first
        first.go.set()
        if not self._finished.wait(REAL_TIME_LIMIT_S):
            raise RuntimeError("the schedule hung in real time (a simulator bug or a real deadlock)")
        if self._errors:
            raise self._errors[0]

    # -- what actors call -----------------------------------------------------------

    def step(self, label: str) -> None:
        """One step of the current actor: maybe killed here; then maybe another actor runs."""
        actor = self._current
        if actor is None:
            return
        owner = actor.owner
        if owner is not None:
            if owner.dead:
                raise TryKilled(label)
            owner.steps += 1
            if self.on_step is not None:
                self.on_step(actor)
            if owner.dead:
                raise TryKilled(label)
        self._yield(actor)

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass for the current actor."""
        actor = self._current
        if actor is None:
            return
        self._block(actor, None, self.now + seconds)

    def wait_until(self, predicate: Callable[[], bool], timeout: float | None) -> None:
        """Block the current actor until ``predicate()`` or ``timeout`` virtual seconds."""
        actor = self._current
        if actor is None or predicate():
            return
        self._block(actor, predicate, None if timeout is None else self.now + timeout)

    # -- the token ------------------------------------------------------------------

    def _block(self, actor: Actor, until: Callable[[], bool] | None, wake_at: float | None) -> None:
        actor.blocked, actor.until, actor.wake_at = True, until, wake_at
        self._yield(actor)
        actor.blocked, actor.until, actor.wake_at = False, None, None
        if actor.owner is not None and actor.owner.dead:
            raise TryKilled("woken")

    def _yield(self, actor: Actor) -> None:
        nxt = self._pick(actor)
        if nxt is actor or nxt is None:
            return
        self._current = nxt
        nxt.go.set()
        actor.go.wait()
        actor.go.clear()

    def _pass_on(self, actor: Actor) -> None:
        nxt = self._pick(actor)
        if nxt is None:
            self._current = None
            self._finished.set()
            return
        self._current = nxt
        nxt.go.set()

    def _pick(self, current: Actor | None) -> Actor | None:
        while True:
            live = [a for a in self.actors if not a.done]
            if not live:
                return None
            runnable = [a for a in live if a.runnable(self.now)]
            if runnable:
                # Mostly keep running who runs (a try's steps come in bursts), else anyone.
                if current in runnable and self.rng.random() < self.stay:
                    return current
                return self.rng.choice(runnable)
            # A frozen try's actors wake no earlier than its thaw (their own wake-up may have passed).
            wakes = [
                a.owner.frozen_until if a.owner is not None and a.owner.frozen is not None else a.wake_at
                for a in live
                if a.wake_at is not None or (a.owner is not None and a.owner.frozen is not None)
            ]
            if not wakes or self.now > self.time_limit_s:
                # Nobody can ever run again (or time is up): stop every try still running.
                if wakes:
                    self.out_of_time = True
                else:
                    self.deadlocked = True
                for a in live:
                    if a.owner is not None:
                        a.owner.dead = True
                    else:
                        a.done = True
                continue
            self.now = max(self.now, min(wakes))


# -- the lease's threads on the virtual clock ----------------------------------------


class VirtualEvent:
    """``threading.Event`` whose ``wait`` passes virtual time."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.flag = False

    def set(self) -> None:
        self.flag = True

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout: float | None = None) -> bool:
        self.scheduler.wait_until(lambda: self.flag, timeout)
        return self.flag


class VirtualThread:
    """``threading.Thread`` run as an actor of the scheduler, owned by the try that starts it."""

    def __init__(
        self,
        scheduler: Scheduler,
        target: Callable[[], Any] | None = None,
        name: str | None = None,
        daemon: bool | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.target = target
        self.name = name or "thread"
        self.args, self.kwargs = args, kwargs or {}
        self.actor: Actor | None = None

    def start(self) -> None:
        current = self.scheduler.current_actor()
        owner = current.owner if current is not None else None
        label = f"{owner.label}/{self.name}" if owner is not None else self.name
        self.actor = self.scheduler.spawn(
            label, lambda: self.target(*self.args, **self.kwargs) if self.target else None, owner
        )

    def join(self, timeout: float | None = None) -> None:
        actor = self.actor
        if actor is not None:
            self.scheduler.wait_until(lambda: actor.done, timeout)

    def is_alive(self) -> bool:
        return self.actor is not None and not self.actor.done


class VirtualThreading:
    """What ``airflow_vllm_batch.lease`` uses of the ``threading`` module, on the scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def Event(self) -> VirtualEvent:
        return VirtualEvent(self.scheduler)

    def Thread(self, *args: Any, **kwargs: Any) -> VirtualThread:
        return VirtualThread(self.scheduler, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


class VirtualTime:
    """What the runner's stall bound uses of the ``time`` module: the scheduler's clock."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def monotonic(self) -> float:
        return self.scheduler.now


@contextlib.contextmanager
def virtual_threading(scheduler: Scheduler) -> Iterator[None]:
    """Put the lease's and the runner's stall bound's threads, events and clock on the scheduler's, for one schedule."""
    from airflow_vllm_batch import lease
    from airflow_vllm_batch.engines import stall

    saved = lease.threading, stall.threading, stall.time
    lease.threading = stall.threading = VirtualThreading(scheduler)  # type: ignore[assignment]
    stall.time = VirtualTime(scheduler)  # type: ignore[assignment]
    try:
        yield
    finally:
        lease.threading, stall.threading, stall.time = saved
