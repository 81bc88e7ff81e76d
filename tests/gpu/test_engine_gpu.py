"""The whole engine on a GPU: FlashInfer, CUDA graphs, FP8 KV, the vision encoder's varlen
attention and the no-sync rule, on the generated checkpoints (CUDA only).

References: the torch backend (the oracle of every other backend) in the same dtype, and the
CPU float32 engine, which tests/parity/test_generate.py holds token-equal to transformers.
Runs whose arithmetic differs are compared with tests/parity/greedy_compare.py: chosen-token
logprobs within a tolerance while tokens agree, a first split only at a reference near-tie.
"""

from __future__ import annotations

import importlib.util

import msgspec
import pytest
import torch

from engine import LLM, SamplingParams
from engine.tiny_model import make_tiny_model
from tests.parity.greedy_compare import assert_tracks
from tests.parity.test_generate import make_prompts, picture

pytestmark = pytest.mark.gpu
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed"
)

NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=20)
FLOAT32_TOL = 1e-3  # GPU float32 (no TF32) against CPU float32
BF16_TOL = 0.15  # two bf16 kernels' rounding on logits of a random model
FP8_TOL = 0.75  # as tests/parity/test_kv_cache_fp8.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Head dim 128, as Qwen2-VL: FlashInfer JIT-compiles a kernel module per head dim, so
    the tests share the benchmarks' modules (tests/parity/test_generate.py holds this
    checkpoint token-equal to transformers on CPU)."""
    return make_tiny_model(tmp_path_factory.mktemp("gpu_hd128"), seed=2, size="tiny-hd128")


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


def generate(model_dir, prompts, **options) -> list:
    llm = LLM(str(model_dir), num_kv_blocks=512, **options)
    return llm.generate(prompts, GREEDY)


def assert_all_track(candidate, reference, tol: float, min_agreed: float = 0.5) -> None:
    """Every prompt tracks (tests/parity/greedy_compare.py), and at least `min_agreed` of
    all tokens agree before the first splits, so the check is never vacuous."""
    agreed = sum(
        assert_tracks(ours, theirs, tol, f"prompt {index}")
        for index, (ours, theirs) in enumerate(zip(candidate, reference, strict=True))
    )
    assert agreed >= min_agreed * NUM_NEW * len(reference)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize(
    "size,seed",
    # Qwen3-VL: q/k norms, deepstack; its MoE: the experts in float32 on the GPU
    [("tiny-hd128", 2), ("tiny2", 1), ("tiny-qwen3-vl", 5), ("tiny-qwen3-vl-moe", 7)],
    ids=["hd128", "tiny2", "qwen3-vl", "qwen3-vl-moe"],
)
def test_float32_torch_backend_matches_cpu(tmp_path, prompts, enforce_eager, size, seed):
    model_dir = make_tiny_model(tmp_path, seed=seed, size=size)
    cpu = generate(model_dir, prompts, device="cpu", dtype="float32")
    gpu = generate(model_dir, prompts, device="cuda", dtype="float32", enforce_eager=enforce_eager)
    assert_all_track(gpu, cpu, FLOAT32_TOL)


def test_mixture_of_experts_decodes_in_graphs(tmp_path, prompts, monkeypatch):
    """bf16 experts run grouped, with no host sync, so decode steps are captured and
    replayed; the graphs' output tracks the eager run's."""
    model_dir = make_tiny_model(tmp_path, seed=7, size="tiny-qwen3-vl-moe")
    options = dict(device="cuda", dtype="bfloat16", attention_backend="torch")
    eager = generate(model_dir, prompts, enforce_eager=True, **options)
    llm = LLM(str(model_dir), num_kv_blocks=512, **options)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None
    replayed = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs: replayed.append(1) or real_run(inputs))
    assert_all_track(llm.generate(prompts, GREEDY), eager, BF16_TOL)
    assert len(replayed) >= NUM_NEW - 2


@needs_flashinfer
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("budget", [2048, 48], ids=["whole", "chunked"])
def test_flashinfer_tracks_torch_backend_in_bf16(model_dir, prompts, enforce_eager, budget):
    options = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=budget)
    reference = generate(model_dir, prompts, attention_backend="torch", enforce_eager=True,
                         **options)  # fmt: skip
    candidate = generate(
        model_dir, prompts, attention_backend="flashinfer", enforce_eager=enforce_eager, **options
    )
    assert_all_track(candidate, reference, BF16_TOL)


@needs_flashinfer
def test_triton_graph_decode_tracks_torch_backend_in_bf16(model_dir, prompts, monkeypatch):
    """The FlashInfer backend's graph-captured decode steps on the Triton split-KV kernel
    (bench/gpu_decode.py's graphs-triton-decode mode) track the torch backend as FlashInfer's
    own kernels do."""
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend

    options = dict(device="cuda", dtype="bfloat16")
    reference = generate(model_dir, prompts, attention_backend="torch", enforce_eager=True,
                         **options)  # fmt: skip
    monkeypatch.setattr(FlashInferAttentionBackend, "triton_graph_decode", True)
    candidate = generate(model_dir, prompts, attention_backend="flashinfer", **options)
    assert_all_track(candidate, reference, BF16_TOL)


@needs_flashinfer
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_flashinfer_fp8_cache(model_dir, prompts, enforce_eager):
    """FlashInfer over an FP8 cache tracks the torch backend over the same FP8 cache (the
    oracle of FP8 semantics, tests/parity/test_kv_cache_fp8.py) as closely as two bf16
    kernels do, and the bf16 cache within FP8_TOL: chosen-token logprobs while the tokens
    agree, a first split only where the bf16 run's top two are that close."""
    options = dict(device="cuda", dtype="bfloat16", kv_cache_dtype="fp8")
    torch_fp8 = generate(model_dir, prompts, attention_backend="torch", enforce_eager=True,
                         **options)  # fmt: skip
    flashinfer_fp8 = generate(model_dir, prompts, attention_backend="flashinfer",
                              enforce_eager=enforce_eager, **options)  # fmt: skip
    # Logits of this model are bf16-rounded (steps of 1/32 near the top), so exact ties are
    # common and runs part early: on an H100, 43 to 88 of 192 tokens agreed (by kernel
    # version), every split at a reference gap <= 3/32, logprobs within 0.09 before it. The
    # per-split gap check is what holds here, not an agreement count.
    assert_all_track(flashinfer_fp8, torch_fp8, BF16_TOL, min_agreed=0.0)
    bf16 = generate(model_dir, prompts, device="cuda", dtype="bfloat16",
                    attention_backend="torch", enforce_eager=True)  # fmt: skip
    for index, (ours, theirs) in enumerate(zip(flashinfer_fp8, bf16, strict=True)):
        assert_tracks(ours, theirs, FP8_TOL, f"prompt {index}")


@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_decode_steps_replay_graphs(model_dir, prompts, monkeypatch, backend):
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
              num_kv_blocks=512, cuda_graph_max_batch_size=8)  # fmt: skip
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8]
    # FlashInfer's graphs serve every history the context allows (engine/cuda_graphs.py).
    bound = llm.engine.runner.max_model_len if backend == "flashinfer" else 8192
    assert graphs.max_seq_len == -(-min(bound, llm.engine.runner.max_model_len) // 16) * 16
    replayed = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs: replayed.append(1) or real_run(inputs))
    results = llm.generate(prompts, GREEDY)
    assert all(r.error is None and len(r.token_ids) == NUM_NEW for r in results)
    assert len(replayed) >= NUM_NEW - 2  # every decode step after the prefills


@pytest.mark.parametrize("dtype,tol", [("float32", FLOAT32_TOL), ("bfloat16", BF16_TOL)])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_small_batch_linears_track_cublas(model_dir, prompts, monkeypatch, dtype, tol,
                                          enforce_eager):  # fmt: skip
    """`--small-batch-linear-rows 8`: the decode steps of these 8 prompts run the decoder's
    projections through the Triton matrix-vector kernel (eager, or captured in the graphs
    up to 8 rows), and track the cuBLAS run."""
    import kernels.triton.small_batch_linear as kernel
    from engine.models.small_batch_linear import SmallBatchLinear

    options = dict(device="cuda", dtype=dtype, enforce_eager=enforce_eager)
    reference = generate(model_dir, prompts, **options)
    llm = LLM(str(model_dir), num_kv_blocks=512, small_batch_linear_rows=8, **options)
    model = llm.engine.runner.model
    swapped = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    assert len(swapped) == 4 * model.config.num_hidden_layers
    launches = []
    real_kernel = kernel.small_batch_linear
    monkeypatch.setattr(kernel, "small_batch_linear",
                        lambda *args: launches.append(1) or real_kernel(*args))  # fmt: skip
    assert_all_track(llm.generate(prompts, GREEDY), reference, tol)
    if enforce_eager:  # a replayed graph calls no Python
        assert len(launches) >= len(swapped) * (NUM_NEW - 2)


def fail_on_a_sync_at_launch(llm, monkeypatch) -> list[bool]:
    """Makes any host sync inside `ModelRunner.launch` an error; returns the list that
    records, per launch, whether it took a step in flight (overlap scheduling)."""
    runner = llm.engine.runner
    real_launch = runner.launch
    launched_ahead: list[bool] = []

    def launch_without_sync(scheduler_output, previous=None):
        launched_ahead.append(previous is not None)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_launch(scheduler_output, previous)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(runner, "launch", launch_without_sync)
    return launched_ahead


@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=needs_flashinfer)])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_launch_never_waits_for_the_device(model_dir, prompts, monkeypatch, backend,
                                           enforce_eager):  # fmt: skip
    """Everything a step queues — encoder, inputs, forward, sampling with penalties that
    count a token in flight — goes without a host sync; the sampled tokens are read back
    only in `PendingStep.result()`."""
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", attention_backend=backend,
              num_kv_blocks=512, enforce_eager=enforce_eager)  # fmt: skip
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # lazy initialisation first
    launched_ahead = fail_on_a_sync_at_launch(llm, monkeypatch)
    sampling = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, logprobs=3,
                              ignore_eos=True, repetition_penalty=1.05,
                              presence_penalty=0.5)  # fmt: skip
    seeded = msgspec.structs.replace(sampling, seed=11)  # its own stream, on the device
    results = llm.generate(prompts, [seeded, *[sampling] * (len(prompts) - 1)])
    assert [r.error for r in results] == [None] * len(prompts)
    assert all(len(r.token_ids) == 8 for r in results)
    assert sum(launched_ahead) >= 5  # steps taking in-flight tokens queued no sync either


def test_the_held_token_table_penalises_on_the_device_as_the_host_ids_do(model_dir, prompts,
                                                                        monkeypatch):  # fmt: skip
    """engine/held_tokens.py on CUDA, overlapped, with tokens in flight: the tokens of the
    run that builds each step's ids on the host (the table turned off). A reward for
    repeating (0.5) and a strong frequency penalty make a token missing from the table, or
    counted twice, change the answer."""
    from engine.sampler import Sampler

    penalised = [SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True,
                                repetition_penalty=0.5 if i % 2 else 1.3,
                                frequency_penalty=2.0 if i % 3 == 0 else 0.0,
                                presence_penalty=0.6 if i % 3 == 1 else 0.0)
                 for i in range(len(prompts))]  # fmt: skip
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512)
    assert llm.engine.overlaps_steps
    with_table = llm.generate(prompts, penalised)
    monkeypatch.setattr(Sampler, "_held_rows", lambda *args: None)
    from_host = llm.generate(prompts, penalised)
    assert [r.token_ids for r in with_table] == [r.token_ids for r in from_host]


@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_overlap_scheduling_equals_serial_steps(model_dir, prompts, backend):
    """Steps launched before the previous step's tokens are read (the default on CUDA) give
    the serial loop's tokens, including a request stopped by a token mid-way."""
    options = dict(device="cuda", dtype="bfloat16", attention_backend=backend)
    serial = generate(model_dir, prompts, overlap_scheduling=False, **options)
    stop = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, logprobs=20,
                          stop_token_ids=(serial[1].token_ids[5],))  # fmt: skip
    params = [GREEDY, stop, *[GREEDY] * (len(prompts) - 2)]
    llm = LLM(str(model_dir), num_kv_blocks=512, overlap_scheduling=False, **options)
    serial = llm.generate(prompts, params)
    llm = LLM(str(model_dir), num_kv_blocks=512, **options)
    assert llm.engine.overlaps_steps
    overlapped = llm.generate(prompts, params)
    assert len(overlapped[1].token_ids) <= 6 and overlapped[1].finish_reason == "stop"
    assert [r.finish_reason for r in overlapped] == [r.finish_reason for r in serial]
    agreed = sum(
        assert_tracks(ours, theirs, BF16_TOL, f"prompt {index}")
        for index, (ours, theirs) in enumerate(zip(overlapped, serial, strict=True))
    )
    assert agreed >= 0.9 * sum(len(r.token_ids) for r in serial)


def encode_varlen_and_grouped(model_dir, sizes, monkeypatch) -> tuple:
    """One bf16 CUDA call of the tower over pictures of `sizes` (frames of several lengths)
    through varlen attention, then the same call through grouped SDPA."""
    from engine.models import qwen2_vl_vision
    from engine.multimodal.image_processor import ImageProcessorConfig, process_image

    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=64)
    config = ImageProcessorConfig.from_model_dir(model_dir)
    images = [process_image(picture(w, h, i), config) for i, (w, h) in enumerate(sizes)]
    pixels = torch.cat([image.pixel_values for image in images]).cuda()
    grid = torch.tensor([list(image.grid_thw) for image in images])
    model = llm.engine.runner.model
    with torch.inference_mode():
        varlen = model.encode_images(pixels, grid)
        plan = qwen2_vl_vision.plan_vision_attention(
            qwen2_vl_vision.frame_lengths([tuple(g) for g in grid.tolist()]),
            torch.device("cuda"),
            torch.bfloat16,
        )
        assert plan.cu_seqlens is not None, "varlen attention is not available here"
        monkeypatch.setattr(qwen2_vl_vision, "_can_use_varlen", lambda device, dtype: False)
        grouped = model.encode_images(pixels, grid)
    return varlen, grouped


def test_vision_varlen_matches_grouped_sdpa(model_dir, monkeypatch):
    sizes = [(112, 84), (140, 196), (200, 90)]
    varlen, grouped = encode_varlen_and_grouped(model_dir, sizes, monkeypatch)
    torch.testing.assert_close(varlen.float(), grouped.float(), atol=5e-2, rtol=5e-2)


def test_qwen2_5_windows_attend_through_varlen_as_through_grouped_sdpa(tmp_path, monkeypatch):
    # Qwen2.5-VL's windows have several lengths (edge windows are smaller), so its window
    # blocks go through varlen attention on CUDA in bf16; grouped SDPA is the reference.
    path = make_tiny_model(tmp_path, seed=4, size="tiny-qwen2.5-vl")
    sizes = [(252, 168), (140, 196), (56, 56)]
    varlen, grouped = encode_varlen_and_grouped(path, sizes, monkeypatch)
    torch.testing.assert_close(varlen.float(), grouped.float(), atol=5e-2, rtol=5e-2)


def test_pixel_levels_normalise_on_the_device_as_on_the_host(model_dir):
    # The engine looks uint8 levels up on its device (engine/media_encoding.pixel_input);
    # the values must be bit for bit the host's, which transformers' processor matches.
    from engine.multimodal.image_processor import (
        ImageProcessorConfig,
        normalize_pixels,
        process_image,
    )

    image = process_image(picture(140, 196, 5), ImageProcessorConfig.from_model_dir(model_dir))
    on_device = normalize_pixels(image.pixel_levels.cuda(), image.normalization)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), image.pixel_values)


def test_prompt_logprobs_on_the_device_match_the_cpu_and_queue_no_sync(model_dir, prompts,
                                                                       monkeypatch):  # fmt: skip
    """Prompt scoring (engine/prompt_logprobs.py) in float32 on CUDA gives the CPU float32
    engine's scores (tests/parity/test_prompt_logprobs.py holds those to transformers), and
    launching a step that scores queues no host sync."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    cpu = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=512)
    reference = cpu.generate(prompts, params)
    # A small token budget: chunks end inside prompts and images, scored chunk by chunk.
    llm = LLM(
        str(model_dir), device="cuda", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=64
    )
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # lazy initialisation first
    fail_on_a_sync_at_launch(llm, monkeypatch)
    results = llm.generate(prompts, params)
    for ours, theirs in zip(results, reference, strict=True):
        assert ours.error is None
        assert (
            len(ours.prompt_logprobs)
            == len(theirs.prompt_logprobs)
            == len(ours.prompt_token_ids) - 1
        )
        for mine, cpus in zip(ours.prompt_logprobs, theirs.prompt_logprobs, strict=True):
            assert mine.token_id == cpus.token_id
            assert abs(mine.logprob - cpus.logprob) < FLOAT32_TOL


def test_an_in_process_llm_on_a_gpu_keeps_the_callers_threads(model_dir):
    """The server's engine process runs one intra-op thread with a GPU
    (engine.process.set_intra_op_threads); an in-process LLM changes nothing of its
    caller's torch unless asked (num_threads)."""
    threads = torch.get_num_threads()
    try:
        LLM(str(model_dir), num_kv_blocks=64, device="cuda")
        assert torch.get_num_threads() == threads
        LLM(str(model_dir), num_kv_blocks=64, device="cuda", num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
