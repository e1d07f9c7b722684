"""Orchestrators make what runs match a ModelDeployment. Each kind registers here."""

from __future__ import annotations

from .base import Orchestrator, ReconcileResult
from .kubernetes import KubernetesOrchestrator
from .local import LocalOrchestrator

ORCHESTRATORS: dict[str, type[Orchestrator]] = {
    LocalOrchestrator.kind: LocalOrchestrator,
    KubernetesOrchestrator.kind: KubernetesOrchestrator,
}


def orchestrator_for(kind: str) -> Orchestrator | None:
    """The orchestrator of that kind, or None when this build has none for it."""
    cls = ORCHESTRATORS.get(kind)
    return cls() if cls else None


__all__ = [
    "ORCHESTRATORS",
    "KubernetesOrchestrator",
    "LocalOrchestrator",
    "Orchestrator",
    "ReconcileResult",
    "orchestrator_for",
]
