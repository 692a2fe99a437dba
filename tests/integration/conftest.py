from swarm_fixtures import make_module_swarm, make_swarm  # noqa: F401 (fixtures)
