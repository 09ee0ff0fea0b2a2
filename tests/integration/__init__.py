"""Integration tests: real etcd, Redis and Kafka-protocol servers on loopback."""
