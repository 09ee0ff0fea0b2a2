"""The `ballast` command line: local mesh, status, chat, model building, benchmarks."""
