"""The FETCHING state: requests whose media are pre-encoded features wait here.

`EngineCore.add_request` builds and validates a request as usual, then hands it here if
any media item carries a `FeatureSource`. The request is not in the scheduler (it is
counted as `num_fetching`) until the FeatureFetcher has downloaded and validated all its
features. `admit_finished()` (called at the top of every step, non-blocking) then gives
each media item its rows (the request's own copy, as an image item carries its pixels),
re-keys it to the blake3 hash of the file's bytes and its grid, and adds the request to
the scheduler, which accounts the rows in the encoder cache when a chunk reaches the item
(the runner puts them in as it would encode an image). Holding room from admission made
waiting requests hold room, which the scheduler's rule forbids: beside images, requests
waited on each other forever.

    add_request ──▶ FETCHING ──(fetch ok)──▶ scheduler.waiting ──▶ running ...
                       │ └──(fetch failed)──▶ finished with a 4xx ErrorInfo
                       └──(abort)──▶ fetches cancelled, finished ABORT
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from engine.config import EngineConfig
from engine.encoder_cache import salted
from engine.errors import error_info
from engine.feature_fetcher import FeatureFetcher
from engine.feature_jobs import FeatureJob, FetchConfig, FetchResult
from engine.feature_validation import FeatureSpec
from engine.protocol import FinishReason, MediaInput, RequestOutput
from engine.request import Request

logger = logging.getLogger(__name__)


class FeatureAdmission:
    """Requests in FETCHING, keyed by request id; owns the (lazily started) fetcher."""

    def __init__(self, config: EngineConfig, runner: Any, scheduler: Any) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self._fetcher: FeatureFetcher | None = None
        # request id -> (request, per job the media items it fills, the jobs)
        self._fetching: dict[str, tuple[Request, list[list[FeatureUse]], list[FeatureJob]]] = {}

    @property
    def num_fetching(self) -> int:
        return len(self._fetching)

    def has(self, request_id: str) -> bool:
        return request_id in self._fetching

    @property
    def fetcher(self) -> FeatureFetcher:
        if self._fetcher is None:
            self._fetcher = FeatureFetcher(FetchConfig.of(self.config))
        return self._fetcher

    def submit(self, request: Request, media: Sequence[MediaInput]) -> bool:
        """Starts fetching `request`'s features; False if it has none (schedule it now).
        One job per file: the temporal patches of a Qwen3-VL video, each its own item,
        share their file's one download."""
        hidden_size = self.runner.model_config.encoder_width  # deepstack levels too
        uses: dict[FeatureJob, list[FeatureUse]] = {}
        for index, item in enumerate(media):
            if item.feature is not None:
                job = FeatureJob(item.feature.url, _file_spec(item, hidden_size))
                grid = tuple(item.grid_thw)
                uses.setdefault(job, []).append(FeatureUse(index, grid, item.feature.rows))
        if not uses:
            return False
        jobs = list(uses)
        self._fetching[request.request_id] = (request, list(uses.values()), jobs)
        self.fetcher.submit(request.request_id, jobs)
        return True

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            entry = self._fetching.pop(request_id, None)
            if entry is not None:
                self.fetcher.cancel(request_id)
                outputs.append(entry[0].unscheduled_output(FinishReason.ABORT))
        return outputs

    def admit_finished(self) -> list[RequestOutput]:
        """Moves requests whose fetch finished into the scheduler; returns failures."""
        if self._fetcher is None:
            return []
        outputs = []
        for result in self._fetcher.poll():
            entry = self._fetching.pop(result.request_id, None)
            if entry is None:
                continue  # aborted meanwhile
            request, uses, jobs = entry
            if result.error is not None:
                failure = error_info(result.error)
                if result.failed_job is not None:  # named as the engine names media items
                    media_index = uses[result.failed_job][0].index
                    failure = msgspec.structs.replace(failure, param=f"media[{media_index}]")
                outputs.append(request.unscheduled_output(FinishReason.ERROR, failure))
                continue
            if not self._is_complete(result, uses, request.cache_salt):
                # A reused entry was evicted while we checked its version: download again.
                self._fetching[request.request_id] = entry
                self._fetcher.submit(request.request_id, jobs, force=True)
                continue
            try:
                self._admit(request, uses, result)
            except Exception as exc:  # noqa: BLE001 - one request never stops the engine
                logger.exception("could not admit fetched request %s", request.request_id)
                outputs.append(request.unscheduled_output(FinishReason.ERROR, error_info(exc)))
        return outputs

    def _is_complete(
        self, result: FetchResult, uses: list[list[FeatureUse]], salt: str | None
    ) -> bool:
        """Every item has its rows: downloaded, or (a file known unchanged) still cached
        under the request's salt."""
        cache, manager = self.runner.encoder_cache, self.scheduler.encoder_cache
        return all(
            f.embeds is not None
            or all(
                (key := use.key(f.content_hash, salt)) in cache and manager.has(key)
                for use in job_uses
            )
            for f, job_uses in zip(result.features, uses, strict=True)
        )

    def _admit(self, request: Request, uses: list[list[FeatureUse]], result: FetchResult) -> None:
        cache = self.runner.encoder_cache
        for feature, job_uses in zip(result.features, uses, strict=True):
            for use in job_uses:
                item = request.media[use.index]
                item.content_hash = use.key(feature.content_hash, request.cache_salt)
                # The request keeps its own copy of the rows (like an image keeps its
                # pixels): the runner puts them into the encoder cache when a chunk needs
                # them and they are not there (evicted, or never put).
                if feature.embeds is not None:
                    item.embeds = use.rows_of(feature.embeds)
                else:  # reused entry, checked still cached: copy its rows to the host
                    item.embeds = cache.get(item.content_hash).to("cpu")
        self.scheduler.add_request(request)

    def stats_fields(self) -> dict[str, Any]:
        """EngineStats fields for the fetch figures since the last step."""
        if self._fetcher is None:
            return {}
        stats = self._fetcher.pop_stats()
        return {
            "feature_fetch_seconds": stats.seconds,
            "feature_fetch_bytes_total": stats.num_bytes,
            "feature_fetch_failures": stats.failures,
            "feature_fetch_in_flight": stats.num_in_flight,
            "feature_fetch_bytes_reserved": stats.num_bytes_reserved,
        }

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()


@dataclass(frozen=True)
class FeatureUse:
    """One media item a fetched file fills: all its rows, or `rows` [start, stop) of them."""

    index: int  # into the request's media
    grid_thw: tuple[int, ...]  # the item's, as its part gives it
    rows: tuple[int, int] | None = None

    def key(self, file_hash: str, salt: str | None) -> str:
        """The item's encoder-cache and prefix-cache key: the file's hash, the item's grid
        (a file without a grid_thw tensor may be sent under several grids; the rows'
        positions follow the grid, so their KV must not be shared), which rows, and the
        request's `cache_salt` (engine.encoder_cache.salted)."""
        t, h, w = self.grid_thw
        key = f"{file_hash}@{t}x{h}x{w}"
        key = key if self.rows is None else f"{key}/rows{self.rows[0]}-{self.rows[1]}"
        return salted(key, salt)

    def rows_of(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds if self.rows is None else embeds[self.rows[0] : self.rows[1]]


def _file_spec(item: MediaInput, hidden_size: int) -> FeatureSpec:
    """What the item's file must hold: the item's own grid, or for a part of a file the
    file's (its temporal patches take equally many rows)."""
    source = item.feature
    if source is None or source.rows is None or source.file_grid_thw is None:
        return FeatureSpec(hidden_size, item.num_tokens, tuple(item.grid_thw))
    return FeatureSpec(hidden_size, item.num_tokens * source.file_grid_thw[0],
                       tuple(source.file_grid_thw))  # fmt: skip
