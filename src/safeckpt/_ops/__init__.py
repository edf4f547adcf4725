"""Tools over a root outside a training job: inspect, prune/pin/verify, export and import of weights."""
