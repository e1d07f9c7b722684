"""The Kubernetes scale benchmark's request accounting and its table rows (bench/kube_scale.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.kube_scale import Pass, is_list, median_pass, pass_row

pytestmark = pytest.mark.unit  # pure functions: no database, Redis or process (make test-unit)


def test_a_list_is_a_get_of_a_namespaced_collection_not_of_one_object():
    assert is_list("GET", "/api/v1/namespaces/inference/pods")
    assert is_list("GET", "/apis/apps/v1/namespaces/inference/deployments?labelSelector=a%3Db")
    assert not is_list("GET", "/api/v1/namespaces/inference/pods/engine-0")
    assert not is_list("PATCH", "/apis/apps/v1/namespaces/inference/deployments/engine")
    assert not is_list("DELETE", "/api/v1/namespaces/inference/services")


def test_writes_are_patches_posts_puts_and_deletes_and_passes_add_up():
    first = Pass(Counter({"GET": 10, "PATCH": 2}), lists=10, bytes_read=2048, queries=24, cpu_s=0.05)
    second = Pass(Counter({"GET": 10, "DELETE": 1, "POST": 1}), lists=10, bytes_read=1024, cpu_s=0.25)
    assert (first.calls, first.writes, second.writes) == (12, 2, 2)
    total = Pass()
    total.add(first)
    total.add(second)
    assert (total.calls, total.writes, total.lists, total.bytes_read) == (24, 4, 20, 3072)
    assert pass_row("steady", 68, first) == (
        "| steady | 68 | 1 | 12 (GET 10, PATCH 2) | 2 | 10 | 2 | 24 | 0.050 | 0.00 |"
    )
    third = Pass(cpu_s=0.1)
    assert median_pass([second, first, third]) is third
