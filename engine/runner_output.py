"""What the model runner returns for one step (engine/model_runner.py): `PendingStep`, the
step whose device work is queued, and `ModelRunnerOutput`, its result once the sampled
tokens are on the host."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.device_io import DeviceTimer
from engine.prompt_logprobs import PendingPromptLogprobs
from engine.protocol import ErrorInfo, TokenLogprob
from engine.sampler import PendingSample


@dataclass(frozen=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    errors: dict[str, ErrorInfo] = field(default_factory=dict)
    encoder_seconds: float = 0.0
    num_encoder_items: int = 0
    num_encoder_batches: int = 0
    # request id -> (prompt index of the first scored token, the scores)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass(frozen=True)
class PendingStep:
    """A step whose device work is queued. `result()` waits for its sampled tokens."""

    sample: PendingSample | None
    sampled_request_ids: list[str]  # row order of `sample`
    errors: dict[str, ErrorInfo]
    encoder_timer: DeviceTimer | None
    num_encoder_items: int
    num_encoder_batches: int
    prompt_logprobs: list[PendingPromptLogprobs] = field(default_factory=list)

    def result(self) -> ModelRunnerOutput:
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprob] = {}
        if self.sample is not None:
            output = self.sample.result()  # the step's one host sync
            for request_id, token_id, token_logprob in zip(
                self.sampled_request_ids, output.token_ids, output.logprobs, strict=True
            ):
                sampled[request_id] = token_id
                if token_logprob is not None:
                    logprobs[request_id] = token_logprob
        encoder_seconds = self.encoder_timer.seconds() if self.encoder_timer else 0.0
        return ModelRunnerOutput(
            sampled,
            logprobs,
            self.errors,
            encoder_seconds,
            self.num_encoder_items,
            self.num_encoder_batches,
            {p.request_id: (p.first_index, p.entries()) for p in self.prompt_logprobs},
        )
