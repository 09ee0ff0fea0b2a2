"""Code shared by every Ballast service: config, errors, telemetry, membership."""
