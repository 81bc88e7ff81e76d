"""FeatureFetcher: downloads pre-encoded features in a background asyncio loop.

The engine's busy loop never waits on the network. It hands a request's feature URLs to
`submit()`, keeps stepping other requests, and picks finished requests up with the
non-blocking `poll()`:

    busy loop ──submit(request_id, jobs)──▶ [fetcher thread: asyncio loop]
                                              fetch all jobs of a request concurrently
                                              (at most `parallel` at once), validate,
                                              keep results in request order
    busy loop ◀──poll() -> [FetchResult]──── first failure cancels the rest

URLs: `s3://bucket/key` (aioboto3; endpoint from config or the standard AWS env,
credentials from the standard chain; the operator picks the endpoint, so no SSRF guard),
`http(s)://` (aiohttp through the SSRF guard of engine/url_safety.py, every redirect hop
re-checked, connections kept alive; `allow_private_urls` lets tests and private
deployments reach loopback or private hosts), `data:` (base64, size-capped).
Transient failures (timeouts, 5xx, throttling, connection errors) are retried with a
bounded exponential backoff; the whole fetch of one URL has a total deadline and a byte cap.
The deadline starts once the download holds one of `max_connections` slots (per storage
kind), so a wait for a slot is not the store's slowness. Before reading a body, a download
reserves its declared length in `max_bytes_in_flight` (engine/byte_budget.py), given back
once the file is checked; that wait pauses the deadline too. Concurrent jobs of one URL
and spec share one download. How a store's answers are read (errors, versions):
engine/feature_store.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

import aiohttp
import blake3

from engine.byte_budget import ByteBudget
from engine.feature_jobs import FeatureJob, FetchConfig, FetchedFeature, FetchResult, FetchStats
from engine.feature_store import (
    Transient,
    check_http_status,
    decode_data_url,
    failure,
    http_version,
    raise_s3,
    s3_version,
    split_s3,
    too_large,
)
from engine.feature_validation import FeatureError, FeatureSpec, validate_features
from engine.url_safety import (
    BodyTooLargeError,
    RedirectError,
    UnsafeUrlError,
    UrlPolicy,
    guarded_session,
    open_checked,
    read_capped,
)

logger = logging.getLogger(__name__)


@dataclass
class _Held:
    """What one download task holds: its deadline, paused while it waits for room in the
    byte budget, and the bytes it reserved there."""

    deadline: asyncio.Timeout | None = None
    num_bytes: int = 0


_HELD: contextvars.ContextVar[_Held] = contextvars.ContextVar("feature_download")


@dataclass
class _Shared:
    """One download that concurrent jobs of the same URL and spec wait on together."""

    task: asyncio.Task
    waiters: int = 0


class FeatureFetcher:
    """Background downloads of feature files; thread-safe `submit` / `poll` / `cancel`."""

    def __init__(self, config: FetchConfig) -> None:
        self.config = config
        self._done: queue.SimpleQueue[FetchResult] = queue.SimpleQueue()
        self._tasks: dict[str, asyncio.Task] = {}  # touched on the loop thread only
        # url -> (etag / last-modified, blake3 of the bytes, the spec they passed)
        self._versions: OrderedDict[str, tuple[str, str, FeatureSpec]] = OrderedDict()
        self._stats = FetchStats()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._http: aiohttp.ClientSession | None = None
        self._policy = UrlPolicy(
            allow_private=config.allow_private_urls, allowed_prefixes=config.allowed_url_prefixes
        )
        self._s3 = None
        self._s3_context = None
        # Downloads of all requests together, per storage kind, taken before a URL's
        # deadline starts: waiting for a connection is not the store being slow.
        self._slots = {kind: asyncio.Semaphore(max(1, config.max_connections))
                       for kind in ("s3", "http")}  # fmt: skip
        self._shared: dict[tuple[str, FeatureSpec, bool], _Shared] = {}  # loop thread only
        self._budget = ByteBudget(config.max_bytes_in_flight)  # loop thread only
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="feature-fetcher", daemon=True
        )
        self._thread.start()

    @property
    def native_thread_id(self) -> int | None:
        """The OS id of the download thread, for CPU accounting (bench/feature_fetch.py)."""
        return self._thread.native_id

    # ---- busy-loop side -----------------------------------------------------------------

    def submit(self, request_id: str, jobs: list[FeatureJob], *, force: bool = False) -> None:
        self._loop.call_soon_threadsafe(self._start, request_id, list(jobs), force)

    def poll(self) -> list[FetchResult]:
        results = []
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                return results

    def cancel(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, request_id)

    def pop_stats(self) -> FetchStats:
        with self._lock:
            gauges = {"num_in_flight": self._stats.num_in_flight,
                      "num_bytes_reserved": self._stats.num_bytes_reserved}  # fmt: skip
            stats, self._stats = self._stats, FetchStats(**gauges)
        return stats

    def close(self) -> None:
        if self._loop.is_closed():
            return
        future = asyncio.run_coroutine_threadsafe(self._aclose(), self._loop)
        try:
            future.result(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ---- loop side ----------------------------------------------------------------------

    def _start(self, request_id: str, jobs: list[FeatureJob], force: bool) -> None:
        task = self._loop.create_task(self._fetch_request(request_id, jobs, force))
        self._tasks[request_id] = task
        task.add_done_callback(functools.partial(self._drop, request_id))

    def _drop(self, request_id: str, task: asyncio.Task) -> None:
        if self._tasks.get(request_id) is task:  # not the request's fetch submitted again
            del self._tasks[request_id]

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _aclose(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._http is not None:
            await self._http.close()
        if self._s3_context is not None:
            await self._s3_context.__aexit__(None, None, None)

    async def _fetch_request(self, request_id: str, jobs: list[FeatureJob], force: bool):
        # No more at once than there are connections: a request's later parts waited for the
        # connections its own earlier parts held, and that wait ran out.
        limit = asyncio.Semaphore(max(1, min(self.config.parallel, self.config.max_connections)))
        tasks = [asyncio.create_task(self._fetch_one(job, limit, force)) for job in jobs]
        for task in tasks:
            task.add_done_callback(_retrieve)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            self._cancel_all(tasks)
            raise
        failed = next((t for t in tasks if t.done() and (t.cancelled() or t.exception())), None)
        if failed is None:
            self._done.put(FetchResult(request_id, [t.result() for t in tasks]))
            return
        self._cancel_all(tasks)
        internal = FeatureError("feature fetch failed: internal error", reason="internal")
        if failed.cancelled():  # a job is cancelled with its request: still answer this one
            logger.error("a feature download was cancelled under a request waiting for it")
            error = internal
        elif not isinstance(error := failed.exception(), FeatureError):
            logger.exception("feature fetch failed", exc_info=error)
            error = internal
        self._done.put(FetchResult(request_id, error=error, failed_job=tasks.index(failed)))

    def _cancel_all(self, tasks: list[asyncio.Task]) -> None:
        num_cancelled = 0
        for task in tasks:
            if not task.done():
                task.cancel()
                num_cancelled += 1
        if num_cancelled:
            self._count_failure("cancelled", num_cancelled)

    async def _fetch_one(self, job: FeatureJob, limit: asyncio.Semaphore, force: bool):
        """The job's feature; concurrent jobs of one URL and spec share one download."""
        async with limit:
            key = (job.url, job.spec, force)
            shared = self._shared.get(key)
            if shared is None or shared.task.done():
                shared = _Shared(asyncio.create_task(self._fetch_bounded(job, force)))
                self._shared[key] = shared
                shared.task.add_done_callback(_retrieve)
                shared.task.add_done_callback(functools.partial(self._forget, key, shared))
            shared.waiters += 1
            try:
                return await asyncio.shield(shared.task)
            finally:
                shared.waiters -= 1
                if not shared.waiters:  # every job that wanted it was cancelled
                    # Forgotten first: a job arriving now starts its own download rather
                    # than join one being cancelled (a retry never got its result).
                    self._forget(key, shared, None)
                    shared.task.cancel()

    @contextlib.asynccontextmanager
    async def _holding(self, slot: asyncio.Semaphore | None, url: str):
        if slot is None:  # data: URLs take no connection
            yield
            return
        try:
            async with asyncio.timeout(self.config.timeout_s):
                await slot.acquire()
        except TimeoutError:
            self._count_failure("saturated")
            cause = (f"no connection to the store came free within {self.config.timeout_s:g} s "
                     "(--feature-fetch-max-connections); retry later")  # fmt: skip
            raise failure(url, cause, "saturated") from None
        try:
            yield
        finally:
            slot.release()

    def _forget(self, key: tuple[str, FeatureSpec, bool], shared: _Shared, _) -> None:
        if self._shared.get(key) is shared:
            del self._shared[key]

    async def _fetch_bounded(self, job: FeatureJob, force: bool) -> FetchedFeature:
        """One download under a connection slot and, once it holds one, the deadline. The
        waits for a slot and for room in the byte budget each have a deadline of the same
        length: requests behind a slow store's downloads fail at 3x the timeout at most."""
        scheme = job.url.partition(":")[0]
        slot = self._slots.get("http" if scheme in ("http", "https") else scheme)
        async with self._holding(slot, job.url):
            started = time.perf_counter()
            self._add_in_flight(1)
            _HELD.set(held := _Held())  # this task's own context
            try:
                async with asyncio.timeout(self.config.timeout_s) as held.deadline:
                    feature = await self._download_and_check(job, force)
            except TimeoutError:
                self._count_failure("timeout")
                raise failure(job.url, "timed out", "timeout") from None
            except FeatureError as exc:
                self._count_failure(exc.reason)
                raise failure(job.url, exc.message, exc.reason) from None
            finally:
                self._add_in_flight(-1)
                self._give_back(held)  # its bytes are checked, or dropped
            with self._lock:
                self._stats.seconds.append(time.perf_counter() - started)
            return feature

    async def _download_and_check(self, job: FeatureJob, force: bool) -> FetchedFeature:
        known = self._versions.get(job.url)
        if known is not None:
            self._versions.move_to_end(job.url)
        # Reused only for the span it was checked against: the same URL with another
        # grid_thw is downloaded and checked again (cached rows of another length would
        # fail the model step for every request in it).
        if known is not None and known[2] == job.spec and not force:
            try:
                version = await self._with_retries(self._version_of, job.url)
            except FeatureError:
                # A server may refuse HEAD and serve GET (a presigned S3 GET URL is signed
                # for GET alone): the download below says what the file is.
                version = None
            if version is not None and version == known[0]:
                return FetchedFeature(job.url, known[1], None)
        data, version = await self._with_retries(self._download, job.url)
        with self._lock:
            self._stats.num_bytes += len(data)
        embeds = await asyncio.to_thread(validate_features, data, job.spec)
        content_hash = blake3.blake3(data).hexdigest()
        if version is not None:
            self._versions[job.url] = (version, content_hash, job.spec)
            self._versions.move_to_end(job.url)
            while len(self._versions) > self.config.max_known_versions:
                self._versions.popitem(last=False)
        return FetchedFeature(job.url, content_hash, embeds)

    async def _with_retries(self, operation, url: str):
        delay = self.config.backoff_s
        for attempt in range(self.config.max_retries + 1):
            try:
                return await operation(url)
            except Transient as exc:
                if attempt == self.config.max_retries:
                    raise FeatureError(exc.detail, reason=exc.reason) from None
                logger.info("retrying feature fetch (%s), attempt %d", exc.detail, attempt + 1)
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    # ---- transports ---------------------------------------------------------------------

    async def _download(self, url: str) -> tuple[bytes, str | None]:
        if url.startswith("data:"):
            return decode_data_url(url, self.config.max_bytes), None
        if url.startswith(("http://", "https://")):
            return await self._http_get(url)
        if url.startswith("s3://"):
            return await self._s3_get(url)
        raise FeatureError("unsupported URL scheme", reason="bad_format")

    async def _version_of(self, url: str) -> str | None:
        if url.startswith(("http://", "https://")):
            async with self._open("HEAD", url) as response:
                check_http_status(response.status)
                return http_version(response.headers)
        if url.startswith("s3://"):
            bucket, key = split_s3(url)
            s3 = await self._s3_client()
            try:
                head = await s3.head_object(Bucket=bucket, Key=key)
            except Exception as exc:  # noqa: BLE001 - botocore raises many types
                raise_s3(exc)
            return s3_version(head)
        return None

    @contextlib.asynccontextmanager
    async def _open(self, method: str, url: str) -> AsyncIterator[aiohttp.ClientResponse]:
        """`open_checked` with the fetcher's errors: unsafe URLs and redirect loops fail at
        once; network errors are transient (retried)."""
        if self._http is None:
            # No limit a host: features usually come from one storage host. The deadline
            # is the fetcher's (paused while a download waits for room in the byte
            # budget), and a body comes as stored, so that its length is what it reserves:
            # a gzip body reserved its compressed size (fuzz73).
            self._http = guarded_session(self._policy, timeout_s=self.config.timeout_s,
                                         max_connections=self.config.max_connections,
                                         max_connections_per_host=0, total_timeout=False,
                                         identity_encoding=True)  # fmt: skip
        try:
            async with open_checked(
                self._http, self._policy, method, url, max_redirects=self.config.max_redirects
            ) as response:
                yield response
        except UnsafeUrlError as exc:
            raise FeatureError(str(exc), reason="unsafe_url") from None
        except RedirectError as exc:
            raise FeatureError(str(exc), reason="http_error") from None
        except aiohttp.ServerTimeoutError:  # the store went silent: 504, not a network fault
            raise Transient("timeout", f"no answer within {self.config.timeout_s:g} s") from None
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise Transient("network", f"connection failed ({type(exc).__name__})") from None

    async def _http_get(self, url: str) -> tuple[bytes, str | None]:
        async with self._open("GET", url) as response:
            check_http_status(response.status)
            body = response.content.iter_any()
            encoded = response.headers.get("Content-Encoding", "identity").lower() != "identity"
            data = await self._read_capped(body, None if encoded else response.content_length)
            return data, http_version(response.headers)

    async def _read_capped(
        self, chunks: AsyncIterable[bytes], declared_length: int | None
    ) -> bytes:
        """The body, its declared length (else the file cap) reserved in the byte budget
        first, and kept until the URL is done: its retries wait for no room again (each
        waited anew, and a URL failed after several times its deadline; fuzz73)."""
        max_bytes = self.config.max_bytes
        if declared_length is not None and declared_length > max_bytes:
            raise too_large(max_bytes)
        await self._reserve(max_bytes if declared_length is None else declared_length)
        try:
            return await read_capped(chunks, max_bytes, declared_length=declared_length)
        except BodyTooLargeError:
            raise too_large(max_bytes) from None

    async def _reserve(self, num_bytes: int) -> None:
        """Waits for room for `num_bytes` in the byte budget (less what this download holds
        already), with the download's deadline paused (others' bytes are not this store's
        slowness) and a deadline of its own."""
        held = _HELD.get()
        num_bytes = min(num_bytes, self._budget.capacity) - held.num_bytes
        if num_bytes <= 0:
            return
        deadline, loop = held.deadline, asyncio.get_running_loop()
        resume_at, waiting_since = (deadline.when() if deadline else None), loop.time()
        if deadline is not None:
            deadline.reschedule(None)
        try:
            async with asyncio.timeout(self.config.timeout_s):
                held.num_bytes += await self._budget.acquire(num_bytes)
            self._note_reserved()
        except TimeoutError:
            raise FeatureError(
                f"no room for its bytes came free within {self.config.timeout_s:g} s "
                "(--feature-fetch-max-bytes-in-flight); retry later",
                reason="saturated",
            ) from None
        finally:
            if deadline is not None and resume_at is not None:
                deadline.reschedule(resume_at + loop.time() - waiting_since)

    def _give_back(self, held: _Held) -> None:
        if held.num_bytes:
            self._budget.release(held.num_bytes)
            held.num_bytes = 0
            self._note_reserved()

    def _note_reserved(self) -> None:
        with self._lock:
            self._stats.num_bytes_reserved = self._budget.used

    async def _s3_client(self):
        if self._s3 is None:
            import aioboto3
            from botocore.config import Config

            session = aioboto3.Session()
            self._s3_context = session.client(
                "s3",
                endpoint_url=self.config.s3_endpoint_url,
                config=Config(
                    # One attempt a call: the fetcher retries (`max_retries`) itself.
                    # botocore's `max_attempts` counts retries, so 1 was a second GET.
                    retries={"total_max_attempts": 1},
                    # botocore's default pool of 10 is shared by every request: two
                    # requests' parallel downloads of slow objects held it whole.
                    max_pool_connections=self.config.max_connections,
                    connect_timeout=self.config.timeout_s,
                    read_timeout=self.config.timeout_s,
                ),
            )
            self._s3 = await self._s3_context.__aenter__()
        return self._s3

    async def _s3_get(self, url: str) -> tuple[bytes, str | None]:
        bucket, key = split_s3(url)
        s3 = await self._s3_client()
        try:
            response = await s3.get_object(Bucket=bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - botocore raises many types
            raise_s3(exc)
        stream = response["Body"]
        try:
            data = await self._read_capped(
                stream.iter_chunks(1 << 20), response.get("ContentLength")
            )
        except FeatureError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise Transient("network", f"download interrupted ({type(exc).__name__})") from None
        finally:
            stream.close()
        return data, s3_version(response)

    # ---- bookkeeping --------------------------------------------------------------------

    def _add_in_flight(self, delta: int) -> None:
        with self._lock:
            self._stats.num_in_flight += delta

    def _count_failure(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._stats.failures[reason] = self._stats.failures.get(reason, 0) + count


def _retrieve(task: asyncio.Task) -> None:
    """Marks a failed task's error as read: the caller reads the first failure only, and
    asyncio logged "Task exception was never retrieved" for each of the others."""
    if not task.cancelled():
        task.exception()
