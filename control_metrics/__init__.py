"""The control plane's own metrics for Prometheus: what Postgres knows and no process counts (deployments'
observed status, endpoints' health and restarts, usage per tenant and team), and the engines' scrape targets.

Served by the web process (urls.py) behind `Authorization: Bearer <PLATFORM_METRICS_TOKEN>`; the router's and
the engines' own metrics are scraped from them directly. deploy/monitoring/ has the scrape configuration, the
alerting rules and the Grafana dashboards built on these names.
"""
