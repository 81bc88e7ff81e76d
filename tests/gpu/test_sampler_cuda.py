"""Reading a step's sampled tokens waits for that step only (CUDA only).

With overlap scheduling the next step is queued before this one's tokens are read; reading
them must not wait for it (a plain `.tolist()` of the device tensor would: its copy runs
behind everything queued on the stream)."""

from __future__ import annotations

import pytest
import torch

from engine.protocol import SamplingParams
from engine.sampler import Sampler, SamplingRow

SLEEP_CYCLES = 2_000_000_000  # about a second of device time queued after the sample


@pytest.mark.parametrize("logprobs", [None, 2])
def test_result_does_not_wait_for_later_device_work(logprobs):
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]], device="cuda")
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    rows = [SamplingRow(params, [0], []), SamplingRow(params, [0], [])]
    pending = Sampler().sample(logits, rows)
    torch.cuda._sleep(SLEEP_CYCLES)  # stands in for the next step, launched ahead
    output = pending.result()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert output.token_ids == [1, 0]
    assert still_running, "result() waited for device work queued after the sample"
    assert pending.token_ids.tolist() == [1, 0]  # the device copy the next step reads
