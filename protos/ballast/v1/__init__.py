"""Generated protobuf stubs; see scripts/gen_protos.py."""
