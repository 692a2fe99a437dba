"""The runtime of stage servers: the process, its stage worker, steps across replicas, sync, checkpoints, stage choice and rebalancing."""
