"""The runtime of whole-model DiLoCo replicas (`swarmtrain replica`)."""
