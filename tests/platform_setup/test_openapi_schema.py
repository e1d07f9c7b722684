from openapi_spec_validator import validate


def test_it_serves_a_valid_openapi_3_schema(world, client_for):
    response = client_for(world.member_a1).get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = response.json()
    validate(schema)
    assert schema["openapi"].startswith("3.")
    for route in (
        "/api/tenants/",
        "/api/teams/",
        "/api/memberships/",
        "/api/keys/",
        "/api/keys/{id}/revoke/",
        "/api/quotas/",
        "/api/price-sheets/",
        "/api/model-aliases/",
        "/api/deployments/",
        "/api/routing-policies/",
        "/api/usage/",
        "/api/audit-log/",
    ):
        assert route in schema["paths"], route
    # The secret appears only in the create response.
    created = schema["paths"]["/api/keys/"]["post"]["responses"]["201"]["content"]["application/json"][
        "schema"
    ]
    assert created["$ref"].endswith("/IssuedApiKey")
    assert "key" not in schema["components"]["schemas"]["ApiKey"]["properties"]


def test_it_serves_browsable_docs_from_its_own_static_files(world, client_for):
    response = client_for(world.member_a1).get("/api/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "swagger" in page.lower() and "cdn" not in page.lower()
