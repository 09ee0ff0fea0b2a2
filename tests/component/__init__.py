"""Component tests: real servers on port 0 in this process, real etcd."""
