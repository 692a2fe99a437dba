"""Discrete-event simulator of a swarm on a virtual clock (docs/DESIGN.md section 6).

It answers "what would this fleet do?" for fleets no test machine has: thousands of heterogeneous,
preemptible peers on several continents. It drives the same pure planner code as the runtime
(`planner.routing.StageRouter`, `planner.rebalance`) and the model size math of `config.sizes`.

Modules: `engine` (event queue), `entities` (devices, peers, locations, fleets), `fleet` (building
fleets: synthetic, scenarios, files, measured compute times), `costs` (per-peer per-stage rates),
`optimal` (best static allocation), `churn` (churn models and trace files), `network` (link model),
`base`/`swarm`/`gpipe`/`replicas` (the modes), `metrics`, `runner` (one call runs a simulation),
`plotting` (PNG figures, matplotlib imported lazily).
"""
