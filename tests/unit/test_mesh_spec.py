"""The local mesh's spec: what a supervisor process is handed round-trips, light pool included."""

from __future__ import annotations

from pathlib import Path

from services.cli.mesh import MeshSpec


def test_spec_with_a_light_pool_round_trips_through_json():
    spec = MeshSpec(
        state_dir=Path("/state"),
        model_dir=Path("/models/smollm2"),
        model_name="smollm2",
        light_model_dir=Path("/models/tiny"),
        workers=3,
    )
    again = MeshSpec.from_json(spec.to_json())
    assert again == spec
    assert again.worker_count == 4  # three primary workers and the light pool's one


def test_spec_without_a_light_pool_counts_only_its_workers():
    spec = MeshSpec(state_dir=Path("/state"), model_dir=Path("/models/tiny"), workers=2)
    assert MeshSpec.from_json(spec.to_json()).light_model_dir is None
    assert spec.worker_count == 2
