def test_it_lists_teams_for_the_operator(world, client_for):
    response = client_for(world.operator).get("/api/teams/")
    assert response.status_code == 200
    assert response.json()["count"] == 3
