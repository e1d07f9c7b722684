"""The engines as Prometheus scrape targets, in the HTTP service discovery format (`http_sd_configs`).

Local engines listen on ports chosen at start, and Kubernetes pods come and go: the endpoints the orchestrator
recorded are the list to scrape. Each target carries the deployment, pool, role and endpoint labels that the
dashboards group by, as the PodMonitor in deploy/monitoring gives engine pods (the model is vLLM's own
`model_name` label).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from serving.models import Endpoint


def engine_targets() -> list[dict]:
    targets = []
    for endpoint in Endpoint.objects.select_related("pool__deployment").order_by("pk"):
        url = urlsplit(endpoint.url)
        if not url.hostname or url.port is None:
            continue
        pool = endpoint.pool
        targets.append(
            {
                "targets": [url.netloc],
                "labels": {
                    "__scheme__": url.scheme,
                    "deployment": pool.deployment.name,
                    "pool": pool.name,
                    "role": pool.role,
                    "endpoint": endpoint.name,
                },
            }
        )
    return targets
