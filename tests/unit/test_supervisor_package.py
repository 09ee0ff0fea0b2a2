"""Where the supervisor sits in the package graph, how it words an exit, and the mesh spec it
is handed (a JSON file the background process reads back)."""

from __future__ import annotations

import json
from pathlib import Path

from services.cli.mesh import MeshSpec
from services.supervisor import ExitReason
from tests.unit.test_package_graph import package_graph


def test_the_supervisor_depends_on_common_only_and_only_the_cli_imports_it():
    graph = package_graph()
    assert graph["supervisor"] <= {"common"}
    assert {package for package, imports in graph.items() if "supervisor" in imports} == {"cli"}


def test_exit_reasons_name_the_code_the_signal_and_who_killed():
    assert ExitReason.from_returncode(3).describe() == "exited with status 3"
    killed = ExitReason.from_returncode(-9)
    assert killed.signal == "SIGKILL" and killed.code is None and not killed.oom_killed
    limit = ExitReason.from_returncode(-9, "memory limit", "memory limit: 5000 MB over 4096 MB")
    assert limit.oom_killed
    assert limit.describe() == "killed by SIGKILL (memory limit: 5000 MB over 4096 MB)"
    assert ExitReason.from_returncode(-9, "oom killer").to_dict()["oom_killed"]


def test_a_mesh_spec_survives_its_json_round_trip(tmp_path):
    spec = MeshSpec(
        state_dir=tmp_path / "state",
        model_dir=tmp_path / "model",
        workers=3,
        engine="sim",
        overrides={"worker": {"respawn": True}},
        redis_persist=True,
        fixed_ports=True,
    )
    again = MeshSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec
    assert isinstance(again.state_dir, Path)
