"""Live processes: the local baseline trainer, stage servers, swarm trainers, balancer, metrics sinks."""
