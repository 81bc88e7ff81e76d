"""Comparing two greedy runs whose arithmetic differs (FP8 cache, bf16 kernels, CUDA graphs).

The tiny random checkpoints have flat next-token distributions (top token ~5%), so two runs
that differ in rounding may part where the reference is near a tie. The candidate is held
to: chosen-token logprobs within `tol` of the reference while the tokens agree, and a first
disagreement only where the reference's own logprobs of the two tokens are within `2 * tol`
(the reference must have asked for top logprobs, e.g. `logprobs=20`).
"""

from __future__ import annotations


def assert_tracks(candidate, reference, tol: float, label: str = "") -> int:
    """Checks one prompt's `GenerationResult`s; returns how many leading tokens agree."""
    assert candidate.error is None and reference.error is None, label
    pairs = list(zip(candidate.logprobs, reference.logprobs, strict=True))
    agreed = next((n for n, (a, b) in enumerate(pairs) if a.token_id != b.token_id), len(pairs))
    diffs = [abs(a.logprob - b.logprob) for a, b in pairs[:agreed]]
    print(f"{label}: {agreed}/{len(pairs)} tokens agree, max |diff| {max(diffs, default=0):.4f}")
    assert max(diffs, default=0.0) <= tol, label
    if agreed < len(pairs):
        ours_at, theirs_at = pairs[agreed]
        gap = theirs_at.logprob - dict(theirs_at.top).get(ours_at.token_id, float("-inf"))
        print(f"{label}: reference gap at the split {gap:.4f}")
        assert gap <= 2 * tol, f"{label}: parted at a clear reference choice"
    return agreed
