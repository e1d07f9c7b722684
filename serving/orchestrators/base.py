"""What every orchestrator offers: reconcile one deployment, and sweep away what belongs to none."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field

from ..models import ModelDeployment, ObservedStatus


@dataclass(frozen=True)
class ReconcileResult:
    """What is really running for one deployment after a reconcile."""

    status: ObservedStatus
    message: str
    endpoints: list[str] = field(default_factory=list)
    # True while something is still on its way (engines starting): look again soon.
    settling: bool = False


class Orchestrator(ABC):
    kind: str

    @abstractmethod
    def reconcile(self, deployment: ModelDeployment) -> ReconcileResult:
        """Make what runs match the deployment; idempotent, safe to call at any time."""

    @abstractmethod
    def sweep(self, deployment_ids: Collection[int]) -> list[str]:
        """Stop everything this orchestrator runs for deployments not in `deployment_ids`; return what went."""
