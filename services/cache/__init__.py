"""The KV-cache store service over Redis."""
