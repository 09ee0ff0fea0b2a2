"""Suites that need a CUDA GPU (and vLLM for the vLLM engine); they skip, with the reason, elsewhere."""
