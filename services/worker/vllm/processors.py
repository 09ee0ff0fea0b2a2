"""Ballast's logits processors inside vLLM: seeded sampling keyed by position, and the JSON
grammar of a guided stream resumed from another replica.

vLLM seeds one random generator per request and advances it with every draw, and its
structured-output grammar starts at the first token vLLM itself generates. A stream resumed
on another replica (prompt + the ids already sent, as the new prompt) would therefore draw
different tokens, and a guided one would restart its JSON document mid-way. These processors
make the vLLM engine behave as the torch engine does:

  * `PositionSampler`: the token at generated position p is chosen by
    `services.worker.sampling.select_token` (temperature, top-p) with a generator seeded by
    (seed, p) alone, the very rule the torch engine uses; the row is then left with that
    token as its only finite logit, and vLLM (asked for greedy decoding) takes it.
  * `ResumedGuide`: masks a resumed guided stream's logits with an llguidance matcher
    (`services.worker.guided`) fast-forwarded over the ids already generated, and advanced
    by every token vLLM appends. Fresh guided streams use vLLM's own structured outputs
    (its llguidance backend, compact JSON), the same grammar.

Per-request arguments travel in `SamplingParams.extra_args` (`request_args`); requests
without them are left alone. vLLM loads these classes by name in its engine process
(`request_args.PROCESSOR_NAMES`), so, unlike the rest of this package, this module imports
vLLM at module level: only vLLM's engine process and the vLLM tests import it.

Order inside vLLM's sampler (vLLM 0.32, V1 model runner): the structured-output bitmask,
then these processors in list order (guide before sampler), then penalties and temperature;
greedy rows do not skip processors that declare themselves not argmax-invariant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from services.worker.guided import GuideCompiler, GuideMismatch, JsonGuide
from services.worker.sampling import position_generator, select_token
from services.worker.vllm.request_args import GUIDE_KEY, SAMPLER_KEY, request_args as _args


@dataclass
class _Seeded:
    seed: int
    offset: int
    temperature: float
    top_p: float
    output_ids: list[int]  # vLLM's live list of this request's generated ids


class PositionSampler(LogitsProcessor):
    """Seeded sampling by (seed, generated position), identical to the torch engine's."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, _Seeded] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        args = _args(sampling_params, SAMPLER_KEY)
        if args is None:
            return
        try:
            seed, offset = int(args["seed"]), int(args["offset"])
            temperature, top_p = float(args["temperature"]), float(args["top_p"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{SAMPLER_KEY} needs integer seed and offset, float temperature and top_p") from exc
        if seed < 0 or offset < 0 or not (temperature > 0 and math.isfinite(temperature)) or not 0 < top_p <= 1:
            raise ValueError(f"{SAMPLER_KEY}: seed and offset >= 0, temperature > 0, top_p in (0, 1]")

    def is_argmax_invariant(self) -> bool:
        # It replaces the choice itself, so it must also run for rows vLLM samples greedily.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)

    @staticmethod
    def _new_row(params: Any, _prompt_ids: list[int] | None, output_ids: list[int]) -> _Seeded | None:
        args = _args(params, SAMPLER_KEY)
        if args is None:
            return None
        return _Seeded(
            int(args["seed"]), int(args["offset"]), float(args["temperature"]), float(args["top_p"]), output_ids
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, state in self._rows.items():
            position = state.offset + len(state.output_ids)
            token = select_token(logits[row], state.temperature, state.top_p, position_generator(state.seed, position))
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
        return logits


@dataclass
class _Guided:
    guide: JsonGuide
    output_ids: list[int]  # vLLM's live list of the ids generated on this replica
    seen: int = 0  # of output_ids, how many the guide has consumed
    broken: bool = field(default=False)


class ResumedGuide(LogitsProcessor):
    """The JSON grammar of a guided stream resumed after ids generated elsewhere."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._model_dir = Path(vllm_config.model_config.model)
        self._compiler: GuideCompiler | None = None
        self._rows: dict[int, _Guided] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        args = _args(sampling_params, GUIDE_KEY)
        if args is None:
            return
        if not isinstance(args.get("schema"), str) or not isinstance(args.get("generated"), list):
            raise ValueError(f"{GUIDE_KEY} needs a schema string and the generated ids")

    def is_argmax_invariant(self) -> bool:
        return False  # a mask changes the argmax

    def _compile(self) -> GuideCompiler:
        if self._compiler is None:
            self._compiler = GuideCompiler.from_model_dir(self._model_dir)
        return self._compiler

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)
        for state in self._rows.values():
            self._catch_up(state)

    def _new_row(self, params: Any, _prompt_ids: list[int] | None, output_ids: list[int]) -> _Guided | None:
        args = _args(params, GUIDE_KEY)
        if args is None:
            return None
        # The worker checked the schema and the generated ids against this grammar before
        # sending the request (the same compiler), so neither fails here.
        return _Guided(self._compile().guide(args["schema"], args["generated"]), output_ids)

    @staticmethod
    def _catch_up(state: _Guided) -> None:
        """Advances the guide over the ids vLLM appended since the last step."""
        while not state.broken and state.seen < len(state.output_ids):
            try:
                state.guide.advance(state.output_ids[state.seen])
            except GuideMismatch:
                # Only an EOS after the document or a token past it: nothing left to guide.
                state.broken = True
            state.seen += 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, state in self._rows.items():
            if state.broken:
                continue
            allowed = state.guide.mask()
            n = min(allowed.numel(), logits.shape[1])
            disallowed = torch.ones(logits.shape[1], dtype=torch.bool)
            disallowed[:n] = ~allowed[:n]
            logits[row].masked_fill_(disallowed.to(logits.device), float("-inf"))
        return logits
