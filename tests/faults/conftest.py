from swarm_fixtures import compiled_sources, make_swarm  # noqa: F401 (fixtures)
