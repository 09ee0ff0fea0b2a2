"""Model rollouts: weighted canary and blue-green by model version, traffic mirroring, and an
SLO gate that promotes or rolls back the candidate, all driven by one etcd document per model."""
