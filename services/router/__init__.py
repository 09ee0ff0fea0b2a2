"""The router: the public Inference API, balancing, and relaying worker streams."""
