from swarm_fixtures import make_swarm  # noqa: F401 (fixture)
