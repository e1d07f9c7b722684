"""Flow control on the virtual clock: the router's own gate and queue (routing/scheduling/flow.py, `FlowControl`)
in front of the simulated engines.

What runs is the platform's code: `saturated`, `FlowControl._saturated`, `pump` (the order by class, then fair
share across tenants, then teams; the spare slots; affinity), `DeploymentFlow` (the queue, the decayed shares),
`Ticket` (started, finished with the work it cost), `affinity`, `max_wait`, `FlowControl.arrive` (the decision to let a request through or queue it). Two things are
the simulation's:

- the event loop: `FlowControl.wake` and `_arm` schedule `pump` on the asyncio loop (next turn, or 50 ms later);
  here they schedule it as events of the simulation at the same virtual times (`VirtualFlowControl`);
- `FlowControl.enter` awaits the waiter's asyncio future under `asyncio.timeout`; here the decision to let a
  request through at once or queue it is the router's own `FlowControl.arrive`, the future is a `SimFuture` whose
  result schedules the dispatch, and the timeout is an event at the class's `max_wait` that takes the waiter out
  with `DeploymentFlow.remove`, as `enter` does.

The clock is the simulation's too, given as the router is given `time.monotonic`: `FlowControl(clock=...)`, which
every share, wait and turn is timed by.
"""

from __future__ import annotations

from collections.abc import Callable

from .django_env import ensure_django

ensure_django()

from routing.info import DeploymentInfo, KeyInfo  # noqa: E402
from routing.scheduling.flow import (  # noqa: E402
    DeploymentFlow,
    FlowControl,
    Ticket,
    Waiter,
    max_wait,
)

POLL_S = 0.05  # FlowControl._arm: a look again while requests wait (the others' loads, the KV use change)


class SimFuture:
    """What `pump` needs of a waiter's future: done, cancelled, result, set_result (which here calls back)."""

    __slots__ = ("_result", "_done", "_on_result")

    def __init__(self, on_result: Callable[[object], None]):
        self._result = None
        self._done = False
        self._on_result = on_result

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def result(self):
        return self._result

    def set_result(self, value) -> None:
        self._result, self._done = value, True
        self._on_result(value)


class Handle:
    """A scheduled look (what asyncio's call_soon/call_later return): cancellable."""

    __slots__ = ("fn", "args", "cancelled")

    def __init__(self, fn, args):
        self.fn, self.args, self.cancelled = fn, args, False

    def cancel(self) -> None:
        self.cancelled = True

    def __call__(self) -> None:
        if not self.cancelled:
            self.fn(*self.args)


class VirtualFlowControl(FlowControl):
    """The router's FlowControl with its event-loop hooks on the simulation's events."""

    def __init__(
        self, loads, call_at: Callable[[float, Handle], None], now: Callable[[], float], window_s=60.0
    ):
        super().__init__(loads, window_s, clock=now)
        self._call_at = call_at
        self._now = now

    def wake(self, flow: DeploymentFlow) -> None:
        if not flow.waiting or (flow._wakeup is not None and not flow._polling):
            return
        if flow._wakeup is not None:
            flow._wakeup.cancel()
        handle = Handle(self.pump, (flow,))
        flow._wakeup, flow._polling = handle, False
        self._call_at(self._now(), handle)

    def _arm(self, flow: DeploymentFlow) -> None:
        if flow._wakeup is None:
            handle = Handle(self.pump, (flow,))
            flow._wakeup, flow._polling = handle, True
            self._call_at(self._now() + POLL_S, handle)

    def admit(
        self,
        deployment: DeploymentInfo,
        key: KeyInfo,
        priority: str,
        work: float,
        held: dict[int, int],
        on_turn: Callable[[Ticket], None],
    ) -> Waiter | None:
        """The router's `arrive`: a request let through at once gets its ticket (`on_turn` now) and None back; one
        that must wait is queued and returned, and `on_turn` gets its ticket when `pump` lets it through."""
        holder: list[Waiter] = []

        def let_through(value) -> None:
            endpoint, ahead = value
            waiter = holder[0]
            on_turn(
                Ticket(
                    self.flow(deployment), key, priority, work, self._now() - waiter.arrived, endpoint, ahead
                )
            )

        turn = self.arrive(deployment, key, priority, work, held, lambda: SimFuture(let_through))
        if isinstance(turn, Ticket):
            on_turn(turn)
            return None
        holder.append(turn)
        return turn

    def timeout(self, deployment: DeploymentInfo, waiter: Waiter) -> bool:
        """The waiter's class limit has passed: True if it was still waiting (refused), as `enter` decides."""
        return self.flow(deployment).remove(waiter)

    @staticmethod
    def limit(deployment: DeploymentInfo, priority: str) -> float:
        return max_wait(deployment, priority)
