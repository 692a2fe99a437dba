"""The runtime of running swarms on one machine: launcher, demo, probe, accounting, WAN test bed, CPU quotas, fault injection."""
