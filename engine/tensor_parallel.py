"""Tensor parallelism: how the decoder is split across ranks, and what the ranks say.

With `tensor_parallel_size` N, every decoder layer is split N ways (Megatron-style):

    q, k, v, gate, up   column-parallel: rank r holds output rows r/N of each projection,
                        i.e. heads r*H/N .. and KV heads r*KVH/N .. (whole GQA groups)
    o_proj, down_proj   row-parallel: rank r holds input columns r/N; the N partial
                        outputs are summed by one all-reduce after each

so a layer costs two all-reduces of [T, hidden]. Rank 0 is the engine process: it
schedules, runs the vision tower, embeds the tokens, computes the logits and samples, as
with one rank. Ranks 1..N-1 (engine/shard_worker.py) hold only their share of the decoder
layers and their share of the KV cache (the same block ids, their KV heads).

Each forward, rank 0 sends a `ShardForward` header (host lists) to every worker over ZMQ,
then broadcasts the step's tensors (input embeddings, positions, attention metadata) over
the process group; the workers run their layers in step with rank 0's. A worker waits for
headers on ZMQ rather than inside a collective, so an idle server never trips the group's
timeout. On CPU the group is gloo (as DESIGN.md plans, so it is testable here); CUDA is
refused at start-up until NCCL and a multi-GPU machine to test it on exist.

Nothing here pickles: headers are msgspec Structs, tensors go as tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist
import zmq

from engine.attention.base import AttentionMetadata
from engine.errors import EngineBroken

# What ranks other than 0 neither load nor run (loader names, hub layout).
DRIVER_ONLY_PREFIXES = ("visual.", "lm_head.", "model.embed_tokens.")
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")

# Building the group waits for every rank to join; after that, one collective waits for
# the slowest rank's share of a step.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=120)
JOIN_POLL_S = 0.05  # how often the ranks check each other while they start
# gloo's own rendezvous, once every rank has said it is joining (_wait_for_peers): a
# moment, unless a peer died in between, which this bounds (a worker whose engine died
# then waited out RENDEZVOUS_TIMEOUT, outliving the server by two minutes; fuzz40).
GLOO_RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=20)
STEP_TIMEOUT = datetime.timedelta(minutes=10)
# After a collective fails: how long a peer's exit may lag the broken connection, so that
# the error names the rank that died.
PEER_EXIT_WAIT_S = 1.0


def split_dim(name: str) -> int | None:
    """The dim of checkpoint tensor `name` (hub layout) that is split across ranks: 0 for
    column-parallel weights and biases, 1 for row-parallel weights, None when every rank
    holds it whole."""
    if not name.startswith("model.layers."):
        return None
    module = name.rsplit(".", 2)[-2]  # "model.layers.3.self_attn.q_proj.weight" -> q_proj
    if module in _COLUMN_PARALLEL:
        return 0
    if module in _ROW_PARALLEL:
        return 1
    return None


class ShardSetup(msgspec.Struct, tag=True):
    num_kv_blocks: int  # the scheduler's blocks; the cache holds one more (scratch)


class ShardForward(msgspec.Struct, tag=True):
    num_tokens: int
    num_seqs: int
    max_blocks: int  # width of the block table
    query_lens: list[int]
    seq_lens: list[int]
    is_decode_only: bool


class ShardStop(msgspec.Struct, tag=True):
    pass


ShardMessage = ShardSetup | ShardForward | ShardStop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ShardMessage)


@dataclass(frozen=True)
class ForwardInputs:
    """What a worker's decoder layers take for one forward, as rank 0 sent it."""

    embeds: torch.Tensor  # [T, hidden]
    positions: torch.Tensor  # [3, T] int64
    metadata: AttentionMetadata


class ShardGroup:
    """One rank's end of the tensor-parallel group: the collectives, and the header channel
    (rank 0 pushes to every worker; a worker pulls from rank 0).

    `store_path` is a FileStore path every rank passes (rank 0 makes it in a private
    directory); `header_addresses[r - 1]` is worker r's ZMQ address."""

    def __init__(
        self,
        rank: int,
        size: int,
        store_path: str,
        header_addresses: list[str],
        device: torch.device,
        *,
        peers_alive: Callable[[], None] | None = None,
    ) -> None:
        """`peers_alive`: raises once a peer has died (rank 0: a worker; a worker: rank
        0), checked while the ranks wait for each other to join, and after a collective
        fails, to name the peer that died."""
        self.shard = (rank, size)
        self.device = device
        self._peers_alive = peers_alive or (lambda: None)
        # Rank 0: why the workers are no longer in step with it (a forward it left midway).
        self.out_of_step: str | None = None
        self._context = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 1000)  # never block exit on a dead peer
        if rank == 0:
            self._headers = []
            for address in header_addresses:
                socket = self._context.socket(zmq.PUSH)
                socket.connect(address)
                self._headers.append(socket)
        else:
            socket = self._context.socket(zmq.PULL)
            socket.bind(header_addresses[rank - 1])
            self._headers = [socket]
        try:
            store = dist.FileStore(store_path, size)
            store.set(_joining_key(rank), "1")
            peers = range(1, size) if rank == 0 else [0]
            _wait_for_peers(store, peers, self._peers_alive)
            self._group = dist.ProcessGroupGloo(store, rank, size, _loopback_options())
            self._group.set_timeout(STEP_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; every rank gets the same result."""
        self._collective(lambda: self._group.allreduce(x))
        return x

    def barrier(self) -> None:
        self._collective(self._group.barrier)

    def _collective(self, start: Callable[[], dist.Work]) -> None:
        """Runs one collective; a peer that died or timed out breaks the whole group. The
        error names the peer that exited where one did: gloo's own ("Connection reset by
        peer") comes first, and named this rank alone (fuzz47)."""
        try:
            start().wait()
        except RuntimeError as exc:
            deadline = time.monotonic() + PEER_EXIT_WAIT_S  # its exit may lag the reset
            while True:
                try:
                    self._peers_alive()
                except EngineBroken as dead:
                    raise EngineBroken(f"{dead}; the collective failed: {exc}") from exc
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            raise EngineBroken(f"tensor-parallel rank {self.shard[0]}: {exc}") from exc

    # rank 0

    def send(self, message: ShardMessage) -> None:
        data = _encoder.encode(message)
        for socket in self._headers:
            socket.send(data)

    def send_forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Rank 0, before its own layers: every worker runs the same forward."""
        if self.out_of_step is not None:
            raise EngineBroken(self.out_of_step)
        block_tables = metadata.block_tables  # [S, W] int32
        self.send(
            ShardForward(
                num_tokens=embeds.shape[0],
                num_seqs=metadata.num_seqs,
                max_blocks=block_tables.shape[1],
                query_lens=metadata.query_lens,
                seq_lens=metadata.seq_lens,
                is_decode_only=metadata.is_decode_only,
            )
        )
        longs = torch.cat([positions.reshape(-1), metadata.slot_mapping])  # [4T] int64
        ints = torch.cat(
            [metadata.query_start_loc, metadata.seq_lens_tensor, block_tables.reshape(-1)]
        )  # [S + 1 + S + S * W] int32
        for tensor in (embeds.contiguous(), longs, ints):
            self._collective(lambda tensor=tensor: self._group.broadcast(tensor, 0))

    @contextlib.contextmanager
    def whole_forward(self) -> Iterator[None]:
        """Rank 0, around `send_forward` and its layers: a forward it leaves midway
        leaves the workers inside that forward's collectives, where the next forward's
        would pair with theirs (a hang, or gloo's "collective mismatch"). The group is
        then broken for good: an error is EngineBroken at once, and an interrupt (Ctrl-C)
        leaves the next forward to raise it."""
        try:
            yield
        except BaseException as exc:
            if self.out_of_step is not None:  # refused at once: nothing was sent
                raise
            self.out_of_step = (
                "the tensor-parallel ranks are out of step: a forward stopped midway on "
                f"rank 0 ({type(exc).__name__}); a new engine (or LLM) is needed"
            )
            if isinstance(exc, Exception) and not isinstance(exc, EngineBroken):
                raise EngineBroken(self.out_of_step) from exc
            raise

    # workers

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._headers[0].poll(timeout_ms))

    def receive(self) -> ShardMessage:
        return _decoder.decode(self._headers[0].recv())

    def receive_forward(
        self, header: ShardForward, hidden_size: int, dtype: torch.dtype
    ) -> ForwardInputs:
        """The tensors `send_forward` broadcast after `header`."""
        t, s, w = header.num_tokens, header.num_seqs, header.max_blocks
        embeds = torch.empty((t, hidden_size), dtype=dtype, device=self.device)
        longs = torch.empty(4 * t, dtype=torch.long, device=self.device)
        ints = torch.empty(2 * s + 1 + s * w, dtype=torch.int32, device=self.device)
        for tensor in (embeds, longs, ints):
            self._collective(lambda tensor=tensor: self._group.broadcast(tensor, 0))
        query_start_loc, seq_lens, block_tables = ints.split([s + 1, s, s * w])
        metadata = AttentionMetadata(
            num_seqs=s,
            query_lens=header.query_lens,
            seq_lens=header.seq_lens,
            query_start_loc=query_start_loc,
            seq_lens_tensor=seq_lens,
            block_tables=block_tables.view(s, w),
            slot_mapping=longs[3 * t :],
            is_decode_only=header.is_decode_only,
        )
        return ForwardInputs(embeds, longs[: 3 * t].view(3, t), metadata)

    def close(self) -> None:
        for socket in self._headers:
            socket.close()
        self._context.term()


def _joining_key(rank: int) -> str:
    return f"rank-{rank}-joining"


def _wait_for_peers(
    store: dist.Store, peers: Iterable[int], peers_alive: Callable[[], None]
) -> None:
    """Waits until every peer is about to join the group, checking that each still
    lives. gloo's rendezvous alone waited RENDEZVOUS_TIMEOUT (120 s) for a worker that had
    died on start-up (killed, or failed to import), then said "Wait timeout"; and a worker
    whose engine had died waited as long."""
    keys = [_joining_key(rank) for rank in peers]
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while not store.check(keys):
        peers_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the tensor-parallel ranks did not all start within "
                f"{RENDEZVOUS_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(JOIN_POLL_S)


def _loopback_options() -> dist.ProcessGroupGloo._Options:
    """gloo's options: every rank is a process of this machine, so the group's sockets
    listen on 127.0.0.1. By default gloo listens where the host's name resolves, a LAN
    address on many hosts, where anyone could connect to the unauthenticated group."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = GLOO_RENDEZVOUS_TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return options
