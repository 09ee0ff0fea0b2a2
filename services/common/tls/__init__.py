"""Mutual TLS between Ballast services: the `tls` config section, certificate checks,
peer roles and the gRPC credentials built from them.

Modules: `settings` (the section), `material` (reading and checking the PEM files),
`roles` (who may call what), `interceptor` (refusing the others), `credentials` (server
and channel credentials that follow the files on disk).
"""
