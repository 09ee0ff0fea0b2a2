"""The processes of one router (`router.processes`): each child's place and its share of the
router's config (quotas divided so that together they admit what one would, an outbox file of
its own, its own metrics port), and the ports a group needs."""

import pytest
from pydantic import ValidationError

from services.config import BallastConfig
from services.router.process_group import Slot, config_for_slot, current_slot, outbox_path_for
from services.router.quotas import QuotaConfig, TenantLimits
from services.router.settings import RouterConfig


def test_a_slot_reads_from_the_environment_and_refuses_nonsense():
    assert current_slot({}) is None
    assert current_slot({"BALLAST_ROUTER_PROCESS": "1/4"}) == Slot(1, 4)
    for bad in ("4/4", "-1/2", "x/2"):
        with pytest.raises(ValueError):
            Slot.parse(bad)


def test_quotas_are_shared_rounded_up_and_unlimited_stays_unlimited():
    quotas = QuotaConfig(
        default=TenantLimits(requests_per_minute=100, tokens_per_minute=1001, max_concurrent=1),
        tenants={"big": TenantLimits(tokens_per_minute=90)},
    )
    shared = quotas.shared_by(3)
    assert shared.default == TenantLimits(requests_per_minute=34, tokens_per_minute=334, max_concurrent=1)
    assert shared.limits("big") == TenantLimits(tokens_per_minute=30)
    assert shared.limits("big").requests_per_minute == 0  # 0 is "no limit", never a share of one


def test_a_child_gets_its_share_its_outbox_and_its_metrics_port():
    config = BallastConfig.model_validate(
        {
            "router": {
                "processes": 2,
                "port": 7000,
                "http_port": 7001,
                "quotas": {"default": {"requests_per_minute": 10}},
            },
            "telemetry": {"metrics_port": 9100},
            "degrade": {"outbox_path": "state/outbox.sqlite"},
        }
    )
    first, second = config_for_slot(config, Slot(0, 2)), config_for_slot(config, Slot(1, 2))
    assert first.router.quotas.default.requests_per_minute == 5
    assert (first.telemetry.metrics_port, second.telemetry.metrics_port) == (9100, 9101)
    assert first.degrade.outbox_path == "state/outbox.sqlite"
    assert second.degrade.outbox_path == "state/outbox.1.sqlite"
    assert (second.router.port, second.router.http_port) == (7000, 7001)
    assert (
        config_for_slot(
            config.model_copy(update={"telemetry": config.telemetry.model_copy(update={"metrics_port": 0})}), Slot(1, 2)
        ).telemetry.metrics_port
        == 0
    )
    assert outbox_path_for("", 3) == ""


@pytest.mark.parametrize("ports", [{"port": 0}, {"port": 7000, "http_port": 0}])
def test_several_processes_need_fixed_ports(ports):
    with pytest.raises(ValidationError, match="processes > 1"):
        RouterConfig(processes=2, **ports)
    RouterConfig(processes=1, **ports)
