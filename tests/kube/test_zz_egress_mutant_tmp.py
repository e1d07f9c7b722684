import os
import pytest
from serving.orchestrators import kube_render as render
from tests.kube.test_egress_policy import *  # noqa
from tests.kube.test_egress_policy import sent  # noqa

@pytest.fixture(autouse=True)
def mutant(monkeypatch):
    which = os.environ["MUTANT"]
    if which == "metadata":
        monkeypatch.setattr(render, "NEVER_REACHED", [])
    elif which == "nixl":
        monkeypatch.setattr(render, "_peers_talk", lambda pools: False)
    elif which == "sweep":
        monkeypatch.setattr(render, "MANAGED_KINDS", [k for k in render.MANAGED_KINDS if k != render.NETWORK_POLICY_API])
    elif which == "open":
        real = render.render_egress_policy
        def opened(d, o):
            p = real(d, o); p["spec"]["egress"].append({}); return p
        monkeypatch.setattr(render, "render_egress_policy", opened)
