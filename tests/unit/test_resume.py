"""Resume plans: continue after the tokens already sent, owing only what is left."""

import pytest

from services.common.generation import FinishReason, Sampling
from services.router.resilience.resume import plan_resume

SAMPLING = Sampling(max_tokens=10, temperature=0.7, top_p=0.9, seed=42, stop=("\n\n",))


def test_continues_after_sent_tokens():
    plan = plan_resume([1, 2, 3], SAMPLING, [7, 8, 9, 10])
    assert plan.prompt_ids == (1, 2, 3)
    assert plan.generated_ids == (7, 8, 9, 10)
    assert plan.sampling.max_tokens == 6
    # Everything else about sampling is kept, the seed above all, so the stream is seamless.
    assert (plan.sampling.temperature, plan.sampling.top_p, plan.sampling.seed, plan.sampling.stop) == (
        0.7,
        0.9,
        42,
        ("\n\n",),
    )
    assert not plan.nothing_left and plan.finish_reason is None
    assert (plan.prompt_tokens, plan.completion_tokens, plan.next_index) == (3, 4, 4)


def test_nothing_sent_yet_is_a_plain_retry():
    plan = plan_resume([1], SAMPLING, [])
    assert plan.generated_ids == () and plan.sampling == SAMPLING


@pytest.mark.parametrize("sent", [10, 12])
def test_nothing_left_finishes_with_length(sent):
    plan = plan_resume([1], SAMPLING, list(range(sent)))
    assert plan.nothing_left
    assert plan.remaining == 0
    assert plan.finish_reason is FinishReason.LENGTH
    assert plan.completion_tokens == sent


def test_inputs_are_copied():
    prompt, sent = [1, 2], [5]
    plan = plan_resume(prompt, SAMPLING, sent)
    prompt.append(3)
    sent.append(6)
    assert plan.prompt_ids == (1, 2) and plan.generated_ids == (5,)


@pytest.mark.parametrize("prompt, sampling", [([], SAMPLING), ([1], Sampling(max_tokens=0))])
def test_rejects_impossible_requests(prompt, sampling):
    with pytest.raises(ValueError):
        plan_resume(prompt, sampling, [])
