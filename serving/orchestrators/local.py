"""The local orchestrator: one engine process per pool replica on this machine, supervised.

Each reconcile looks at what really runs (processes carrying our marks, and their /health), compares it with
the deployment, and acts: start what is missing, restart what crashed (with exponential backoff) or runs an old
configuration, stop what is no longer wanted. It records one Endpoint row per engine. Running it twice in a row
changes nothing but health and last_seen_at.

Over 400 lines: reconciling, starting and supervising a pool's processes share the marks and state each reads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from django.conf import settings
from django.utils import timezone

from inference_platform.config_version import bump_config_version_on_commit
from inference_platform.ports import free_port, port_is_free

from .. import drain
from ..engine_command import (
    ENGINE_HOST,
    EngineCommand,
    EnginePorts,
    UnsupportedEngineOption,
    render_engine_command,
)
from ..lifetimes import lifetime_close, lifetime_open, lifetime_ready
from ..models import (
    DesiredStatus,
    Endpoint,
    EngineKind,
    Health,
    KvConnector,
    ModelDeployment,
    ObservedStatus,
    OrchestratorKind,
    Pool,
)
from . import processes
from .base import Orchestrator, ReconcileResult
from .processes import Slot

log = logging.getLogger(__name__)

FAILED = "failed"  # a slot that cannot run as configured (beside the Health values)


@dataclass(frozen=True)
class SlotState:
    name: str
    health: str
    note: str
    # Starting, or waiting to be restarted: on its way rather than broken.
    settling: bool = False


def endpoint_name(deployment: ModelDeployment, pool: Pool, index: int) -> str:
    return f"{deployment.name}-{pool.name}-{index}"


def _port(address: str) -> int | None:
    """The port of `http://host:port`, `tcp://host:port` or `host:port`; None for an empty address."""
    if not address:
        return None
    return urlsplit(address if "://" in address else f"//{address}").port


def slot_index(deployment: ModelDeployment, pool: Pool, name: str) -> int | None:
    """The replica index an endpoint's name carries (see `endpoint_name`); None for a name not of the pool."""
    prefix = f"{deployment.name}-{pool.name}-"
    tail = name[len(prefix) :] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def _retire(endpoint: Endpoint) -> None:
    """An endpoint whose engine is gone for good: its lifetime ends, its row goes."""
    lifetime_close(endpoint)
    endpoint.delete()  # routers reload (routing/apps.py)


def _reserved_ports(excluding: Endpoint | None) -> set[int]:
    rows = Endpoint.objects.exclude(pk=getattr(excluding, "pk", None))
    ports = set()
    for url, events, side in rows.values_list("url", "kv_events_endpoint", "kv_side_channel"):
        ports |= {_port(url), _port(events), _port(side)}
    return ports - {None}


class LocalOrchestrator(Orchestrator):
    kind = OrchestratorKind.LOCAL
    orphans_draining = 0  # engines of deleted deployments the last sweep left draining

    def reconcile(self, deployment: ModelDeployment) -> ReconcileResult:
        running = {
            slot: procs
            for slot, procs in processes.find_engines().items()
            if slot.deployment_id == deployment.pk
        }
        wanted, draining = self._plan(deployment)
        for slot, procs in running.items():
            if slot not in wanted and slot not in draining:
                log.info("stopping %s: no longer wanted", slot.mark())
                processes.stop(procs)
        kept = {(pool.pk, endpoint_name(deployment, pool, slot.index)) for slot, pool in wanted.items()} | {
            (endpoint.pool_id, endpoint.name) for endpoint in draining.values()
        }
        for endpoint in Endpoint.objects.filter(pool__deployment=deployment):
            if (endpoint.pool_id, endpoint.name) not in kept:
                _retire(endpoint)

        states = [
            self._reconcile_slot(deployment, pool, slot, running.get(slot, []))
            for slot, pool in sorted(wanted.items())
        ]
        leaving = [
            state
            for slot, endpoint in sorted(draining.items())
            if (state := self._drain(endpoint, running.get(slot, []))) is not None
        ]
        result = self._summary(deployment, states)
        if leaving:
            names = ", ".join(state.name for state in leaving)
            if result.status == ObservedStatus.STOPPED:
                return ReconcileResult(
                    ObservedStatus.PROGRESSING, f"Stopping; draining: {names}.", [], settling=True
                )
            note = f" Draining: {names}."
            result = ReconcileResult(result.status, result.message + note, result.endpoints, settling=True)
        return result

    def _plan(self, deployment: ModelDeployment) -> tuple[dict[Slot, Pool], dict[Slot, Endpoint]]:
        """The slots whose engines should serve, and the endpoints draining (kept running until drained).

        A pool with more serving endpoints than replicas drains the ones whose removal loses least
        (serving/drain.py); one with fewer takes draining ones back first (warm), then starts new slots at the
        lowest free indexes."""
        existing: dict[int, list[Endpoint]] = {}
        for endpoint in Endpoint.objects.filter(pool__deployment=deployment).select_related("lifetime"):
            existing.setdefault(endpoint.pool_id, []).append(endpoint)
        wanted: dict[Slot, Pool] = {}
        draining: dict[Slot, Endpoint] = {}
        if deployment.desired_status == DesiredStatus.STOPPED:
            # Stopping drains every engine, as a scale-down does.
            for pool in deployment.pools.all():
                mine = existing.get(pool.pk, [])
                drain.start_draining([e for e in mine if e.draining_since is None])
                for endpoint in mine:
                    index = slot_index(deployment, pool, endpoint.name)
                    if index is not None:
                        draining[Slot(deployment.pk, pool.pk, index)] = endpoint
            return wanted, draining
        for pool in deployment.pools.all():
            mine = {}
            for endpoint in existing.get(pool.pk, []):
                index = slot_index(deployment, pool, endpoint.name)
                if index is not None:
                    mine[index] = endpoint
            serving = [e for i, e in sorted(mine.items()) if e.draining_since is None]
            leaving = [e for i, e in sorted(mine.items()) if e.draining_since is not None]
            excess = len(serving) - pool.replicas
            if excess > 0:
                victims = drain.choose_victims(self.redis, serving, excess)
                drain.start_draining(victims)
                serving = [e for e in serving if e not in victims]
                leaving += victims
            elif excess < 0 and leaving:
                back = sorted(leaving, key=lambda e: e.health != Health.HEALTHY)[:-excess]
                drain.stop_draining(back)
                serving += back
                leaving = [e for e in leaving if e not in back]
            index_of = {e.pk: i for i, e in mine.items()}
            for endpoint in serving:
                wanted[Slot(deployment.pk, pool.pk, index_of[endpoint.pk])] = pool
            for endpoint in leaving:
                draining[Slot(deployment.pk, pool.pk, index_of[endpoint.pk])] = endpoint
            used = set(mine)
            index = 0
            while len([s for s in wanted if s.pool_id == pool.pk]) < pool.replicas:
                if index not in used:
                    wanted[Slot(deployment.pk, pool.pk, index)] = pool
                index += 1
        return wanted, draining

    def _drain(self, endpoint: Endpoint, procs: list[psutil.Process]) -> SlotState | None:
        """A draining endpoint: stopped once drained (None), else reported as draining."""
        if not procs or drain.drained(self.redis, endpoint):
            log.info("engine %s drained: stopping it", endpoint.name)
            processes.stop(procs)
            _retire(endpoint)
            return None
        return SlotState(endpoint.name, endpoint.health, "draining", settling=True)

    @functools.cached_property
    def redis(self):
        import redis

        return redis.Redis.from_url(settings.REDIS_URL)

    def sweep(self, deployment_ids: Collection[int], *, drain_first: bool = True) -> list[str]:
        """Stop the engines of deployments that are gone, each once it runs nothing (or after the drain
        timeout): with their Endpoint rows gone, routers send them nothing new. Without `drain_first` (the
        platform itself stopping), at once."""
        gone = []
        self.orphans_draining = 0
        for slot, procs in processes.find_engines().items():
            if slot.deployment_id not in deployment_ids:
                port = next((p for p in map(processes.http_port, procs) if p), None)
                url = f"http://{ENGINE_HOST}:{port}" if port else None
                mark = f"{processes.owner_id()}:{slot.mark()}"
                if drain_first and not drain.orphan_drained(self.redis, mark, url):
                    log.info("orphan engine %s is draining: stopped once it is idle", slot.mark())
                    self.orphans_draining += 1
                    continue
                log.info("stopping orphan engine %s", slot.mark())
                processes.stop(procs)
                gone.append(slot.mark())
        return gone

    # --- one replica -------------------------------------------------------------------------------------

    def _reconcile_slot(
        self, deployment: ModelDeployment, pool: Pool, slot: Slot, procs: list[psutil.Process]
    ) -> SlotState:
        name = endpoint_name(deployment, pool, slot.index)
        endpoint = Endpoint.objects.filter(pool=pool, name=name).first()
        engine = self._one_engine(procs, endpoint)
        try:
            if pool.nodes_per_replica > 1:
                raise UnsupportedEngineOption(
                    f"pool {pool.name}: local engines run on one machine; nodes_per_replica must be 1"
                )
            ports = self._ports(pool, endpoint, fresh=False)
            command = render_engine_command(deployment=deployment, pool=pool, ports=ports)
        except UnsupportedEngineOption as exc:
            processes.stop([engine] if engine else [])
            if endpoint:
                endpoint.delete()
            return SlotState(name, FAILED, str(exc))

        if engine is not None and (endpoint is None or endpoint.config_hash != command.config_hash):
            log.info("restarting %s: its configuration changed", name)
            processes.stop([engine])
            return self._start(deployment, pool, slot, endpoint, command, reason="configuration changed")
        if engine is None:
            return self._crashed_or_new(deployment, pool, slot, endpoint, command)
        return self._probe(endpoint, engine)

    def _one_engine(self, procs: list[psutil.Process], endpoint: Endpoint | None) -> psutil.Process | None:
        """The slot's engine; duplicates and helpers left behind by a dead engine are stopped."""
        leaders = [proc for proc in procs if processes.is_leader(proc)]
        leaders.sort(key=lambda proc: proc.pid != getattr(endpoint, "pid", None))
        keep = leaders[0] if leaders else None
        extra = leaders[1:] if keep else procs
        if extra:
            log.warning("stopping %d stray engine processes", len(extra))
            processes.stop(extra)
        return keep

    def _ports(self, pool: Pool, endpoint: Endpoint | None, *, fresh: bool) -> EnginePorts:
        """The endpoint's ports where it has them (and, with `fresh`, they are still free); new ones else."""
        reserved = _reserved_ports(excluding=endpoint)
        old = endpoint or Endpoint()

        def port(address: str, needed: bool = True) -> int | None:
            if not needed:
                return None
            current = _port(address)
            if current is not None and not (fresh and not port_is_free(current)):
                return current
            chosen = free_port(reserved)
            reserved.add(chosen)
            return chosen

        return EnginePorts(
            http=port(old.url),
            kv_events=port(old.kv_events_endpoint, pool.enable_kv_events),
            side_channel=port(old.kv_side_channel, pool.kv_connector == KvConnector.NIXL),
        )

    def _crashed_or_new(
        self,
        deployment: ModelDeployment,
        pool: Pool,
        slot: Slot,
        endpoint: Endpoint | None,
        command: EngineCommand,
    ) -> SlotState:
        now = timezone.now()
        if endpoint is None:
            return self._start(deployment, pool, slot, None, command, reason="started")
        if endpoint.pid is not None:
            # First seen gone: record it, and when it may come back.
            stable = endpoint.started_at and now - endpoint.started_at > timedelta(
                seconds=settings.ENGINE_RESTART_BACKOFF_MAX_S
            )
            exponent = 0 if stable else endpoint.restart_count
            delay = min(
                settings.ENGINE_RESTART_BACKOFF_S * 2**exponent, settings.ENGINE_RESTART_BACKOFF_MAX_S
            )
            endpoint.pid = None
            endpoint.health = Health.UNHEALTHY
            endpoint.next_restart_at = now + timedelta(seconds=delay)
            endpoint.save(update_fields=["pid", "health", "next_restart_at"])
            lifetime_close(endpoint, now)
            log.warning("engine %s exited; restart in %s s", endpoint.name, delay)
        if endpoint.next_restart_at and now < endpoint.next_restart_at:
            wait = (endpoint.next_restart_at - now).total_seconds()
            note = f"exited; restart in {wait:.0f} s (log: {self._log(endpoint)})"
            return SlotState(endpoint.name, Health.UNHEALTHY, note, settling=True)
        return self._start(deployment, pool, slot, endpoint, command, reason="restarted after exit")

    def _start(
        self,
        deployment: ModelDeployment,
        pool: Pool,
        slot: Slot,
        endpoint: Endpoint | None,
        command: EngineCommand,
        *,
        reason: str,
    ) -> SlotState:
        name = endpoint_name(deployment, pool, slot.index)
        # A port may have been taken while the engine was down.
        ports = self._ports(pool, endpoint, fresh=True)
        command = render_engine_command(deployment=deployment, pool=pool, ports=ports)
        if deployment.engine_kind == EngineKind.VLLM and not Path(command.argv[0]).exists():
            return SlotState(
                name, FAILED, f"no engine environment at {command.argv[0]}: run scripts/engine-env.sh once"
            )
        pid = processes.spawn(argv=command.argv, env=command.env, name=name, slot=slot)
        crashed = reason == "restarted after exit"
        endpoint = endpoint or Endpoint(pool=pool, name=name)
        endpoint.url = f"http://{ENGINE_HOST}:{ports.http}"
        endpoint.role = pool.role
        endpoint.kv_events_endpoint = f"tcp://{ENGINE_HOST}:{ports.kv_events}" if ports.kv_events else ""
        endpoint.kv_side_channel = f"{ENGINE_HOST}:{ports.side_channel}" if ports.side_channel else ""
        endpoint.health = Health.STARTING
        endpoint.pid = pid
        endpoint.config_hash = command.config_hash
        endpoint.started_at = timezone.now()
        if crashed:
            endpoint.restart_count += 1
        lifetime_open(endpoint, deployment, pool)
        endpoint.save()
        log.info("engine %s %s: pid %s on %s", name, reason, pid, endpoint.url)
        return SlotState(name, Health.STARTING, reason, settling=True)

    @staticmethod
    def _hung(endpoint: Endpoint, now) -> bool:
        since = endpoint.last_seen_at or endpoint.started_at
        if endpoint.last_seen_at is None and endpoint.started_at is not None:
            # Never healthy: its start-up window is the grace.
            return now - endpoint.started_at > timedelta(seconds=settings.ENGINE_STARTUP_TIMEOUT_S)
        return since is not None and now - since > timedelta(seconds=settings.ENGINE_HUNG_RESTART_S)

    def _probe(self, endpoint: Endpoint, engine: psutil.Process) -> SlotState:
        now = timezone.now()
        if processes.healthy(endpoint.url):
            health, note = Health.HEALTHY, "healthy"
        elif endpoint.health in (Health.HEALTHY, Health.UNHEALTHY):
            health, note = Health.UNHEALTHY, f"/health does not answer (log: {self._log(endpoint)})"
        elif endpoint.started_at and now - endpoint.started_at < timedelta(
            seconds=settings.ENGINE_STARTUP_TIMEOUT_S
        ):
            health, note = Health.STARTING, "starting"
        else:
            health, note = Health.UNHEALTHY, f"not healthy since its start (log: {self._log(endpoint)})"
        changes = {"health": health}
        if health == Health.HEALTHY:
            changes["last_seen_at"] = now
            if endpoint.health != Health.HEALTHY:
                lifetime_ready(endpoint, now)
        elif health == Health.UNHEALTHY and self._hung(endpoint, now):
            log.warning(
                "engine %s is alive but has not been healthy for too long: stopping it", endpoint.name
            )
            processes.stop([engine])
            note = f"hung; stopped, restarts with backoff (log: {self._log(endpoint)})"
        if endpoint.pid != engine.pid:
            changes["pid"] = engine.pid
        if endpoint.health != health or len(changes) > 1:
            # update(), so that a mere last_seen_at does not make every router reload its endpoints...
            Endpoint.objects.filter(pk=endpoint.pk).update(**changes)
        if endpoint.health != health:
            # ...while a change of health does, at once.
            bump_config_version_on_commit()
        return SlotState(endpoint.name, health, note, settling=health == Health.STARTING)

    @staticmethod
    def _log(endpoint: Endpoint) -> Path:
        return processes.log_path(endpoint.name)

    # --- the deployment as a whole -----------------------------------------------------------------------

    def _summary(self, deployment: ModelDeployment, states: list[SlotState]) -> ReconcileResult:
        names = [state.name for state in states if state.health != FAILED]
        if not states:
            message = (
                "Stopped." if deployment.desired_status == DesiredStatus.STOPPED else "No replicas wanted."
            )
            return ReconcileResult(ObservedStatus.STOPPED, message, names)
        healthy = sum(state.health == Health.HEALTHY for state in states)
        settling = any(state.settling for state in states)
        problems = [f"{state.name}: {state.note}" for state in states if state.health != Health.HEALTHY]
        message = "; ".join([f"{healthy} of {len(states)} engines healthy", *problems]) + "."
        if any(state.health == FAILED for state in states):
            status = ObservedStatus.FAILED
        elif healthy == len(states):
            status = ObservedStatus.READY
        elif healthy:
            status = ObservedStatus.DEGRADED
        elif settling:
            status = ObservedStatus.PROGRESSING
        else:
            status = ObservedStatus.FAILED
        return ReconcileResult(status, message, names, settling=settling)
