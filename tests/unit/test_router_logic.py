"""Pure router logic: auth, request validation, worker choice."""

import random

import pytest

from ballast.v1 import common_pb2, inference_pb2
from services.common.config import AuthConfig
from services.router.settings import RouterConfig
from services.common.errors import InvalidArgument, Unauthenticated
from services.common.membership import WorkerRecord
from services.common.auth import Authenticator
from services.router.balancer import pick_worker
from services.router.requests import request_from_pb


def make_request(**fields) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(model="tiny", **fields)
    if not request.WhichOneof("input"):
        request.conversation.messages.add(role="user", content="hello")
    return request


class TestAuth:
    def test_key_maps_to_tenant(self):
        auth = Authenticator(AuthConfig(api_keys={"k1": "acme"}))
        assert auth.tenant_for([("x-api-key", "k1")]) == "acme"
        assert auth.tenant_for([("authorization", "Bearer k1")]) == "acme"

    @pytest.mark.parametrize("metadata", [[], [("x-api-key", "nope")], [("authorization", "k1")]])
    def test_refused(self, metadata):
        with pytest.raises(Unauthenticated):
            Authenticator(AuthConfig(api_keys={"k1": "acme"})).tenant_for(metadata)

    def test_disabled_uses_default_tenant(self):
        assert Authenticator(AuthConfig(enabled=False, default_tenant="dev")).tenant_for([]) == "dev"


class TestValidation:
    config = RouterConfig(default_max_tokens=32, max_tokens_limit=100, max_request_bytes=4096, max_prompt_chars=1000)

    def test_valid_request_gets_defaults_and_an_id(self):
        request = request_from_pb(make_request(), "acme", self.config)
        assert request.request_id
        assert request.tenant == "acme"
        assert request.sampling.max_tokens == self.config.default_max_tokens
        assert request.tier == "AUTO"
        assert request.allow_degraded is True

    @pytest.mark.parametrize(
        "fields, message",
        [
            ({"conversation": inference_pb2.Conversation()}, "messages must not be empty"),
            ({"prompt": ""}, "prompt must not be empty"),
            ({"sampling": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens must be > 0"),
            ({"sampling": common_pb2.SamplingParams(max_tokens=-5)}, "max_tokens must be > 0"),
            ({"sampling": common_pb2.SamplingParams(max_tokens=101)}, "max_tokens must be <= 100"),
            ({"sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature"),
            ({"sampling": common_pb2.SamplingParams(top_p=0)}, "top_p"),
            ({"tier": 7}, "unknown tier 7"),
            ({"prompt": "x" * 1001}, "limit is 1000"),
            ({"prompt": "x" * 5000}, "bytes"),
            ({"request_id": "a\nb"}, "request_id"),
        ],
    )
    def test_bad_input(self, fields, message):
        with pytest.raises(InvalidArgument, match=message):
            request_from_pb(make_request(**fields), "acme", self.config)

    def test_bad_role(self):
        request = inference_pb2.GenerateRequest(model="tiny")
        request.conversation.messages.add(role="wizard", content="hi")
        with pytest.raises(InvalidArgument, match="role"):
            request_from_pb(request, "acme", self.config)

    def test_no_input(self):
        with pytest.raises(InvalidArgument, match="set either conversation or prompt"):
            request_from_pb(inference_pb2.GenerateRequest(model="tiny"), "acme", self.config)

    def test_missing_model(self):
        request = make_request()
        request.model = ""
        with pytest.raises(InvalidArgument, match="model"):
            request_from_pb(request, "acme", self.config)


def worker(id, in_flight=0, capacity=4, model="tiny", healthy=True, draining=False):
    return WorkerRecord(id=id, address=f"127.0.0.1:{id}", model=model, model_version="v",
                        capacity=capacity, in_flight=in_flight, healthy=healthy, draining=draining)


class TestBalancer:
    def test_fewest_in_flight_wins(self):
        chosen = pick_worker([worker("1", 3), worker("2", 1), worker("3", 2)], "tiny", {})
        assert chosen.id == "2"

    def test_local_count_overrides_stale_published_count(self):
        chosen = pick_worker([worker("1", 0), worker("2", 1)], "tiny", {"1": 3})
        assert chosen.id == "2"

    def test_skips_draining_unhealthy_other_model_and_excluded(self):
        workers = [worker("1", draining=True), worker("2", healthy=False), worker("3", model="big"), worker("4", 3), worker("5")]
        assert pick_worker(workers, "tiny", {}, exclude=frozenset({"5"})).id == "4"
        assert pick_worker(workers[:3], "tiny", {}) is None

    def test_ties_spread(self):
        rng = random.Random(1)
        picks = {pick_worker([worker("1"), worker("2")], "tiny", {}, rng=rng).id for _ in range(20)}
        assert picks == {"1", "2"}


class TestIdempotentSampling:
    config = RouterConfig()

    def test_unseeded_sampling_gets_a_seed_stable_for_the_request_id(self):
        request = make_request(request_id="order-42", sampling=common_pb2.SamplingParams(temperature=0.8))
        first = request_from_pb(request, "acme", self.config)
        again = request_from_pb(request, "acme", self.config)
        assert first.sampling.seed is not None and first.sampling.seed == again.sampling.seed

    def test_derived_seed_differs_by_tenant_and_request(self):
        a = request_from_pb(make_request(request_id="r1", sampling=common_pb2.SamplingParams(temperature=1)), "acme", self.config)
        b = request_from_pb(make_request(request_id="r1", sampling=common_pb2.SamplingParams(temperature=1)), "other", self.config)
        c = request_from_pb(make_request(request_id="r2", sampling=common_pb2.SamplingParams(temperature=1)), "acme", self.config)
        assert len({a.sampling.seed, b.sampling.seed, c.sampling.seed}) == 3

    def test_client_seed_and_greedy_are_left_alone(self):
        seeded = request_from_pb(make_request(sampling=common_pb2.SamplingParams(temperature=1, seed=5)), "acme", self.config)
        greedy = request_from_pb(make_request(sampling=common_pb2.SamplingParams(temperature=0)), "acme", self.config)
        assert seeded.sampling.seed == 5
        assert greedy.sampling.seed is None
