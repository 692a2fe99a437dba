from swarm_fixtures import compiled_sources, make_module_swarm, make_swarm  # noqa: F401 (fixtures)
