"""swarmtrain: train large models on preemptible, heterogeneous, geo-distributed compute."""

__version__ = "0.1.0"
