"""Text-only models against transformers on generated checkpoints, token for token: the
Qwen2 decoder alone (`tiny-qwen2`, Qwen2ForCausalLM as Qwen2 / Qwen2.5 language models: no
vision weights, no preprocessor_config.json, plain RoPE), Llama (`tiny-llama`,
LlamaForCausalLM: no q/k/v biases, llama3 rotary scaling, a tokenizer that puts a BOS before
raw text), Qwen3 (`tiny-qwen3`, Qwen3ForCausalLM: q/k head norms, no biases, a head dim
of its own) and Qwen3-MoE (`tiny-qwen3-moe`: 8 experts, 2 per token, one dense layer). Raw and chat prompts in one batch, prefill in chunks; media parts are refused,
not crashed on."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from bench.local_inputs import picture  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.errors import ModelLoadError  # noqa: E402
from engine.model_config import ModelConfig  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402

NUM_NEW = 16
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog, and then",
    {"messages": [{"role": "user", "content": "Tell me about rivers."}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}]},
]  # fmt: skip


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), size=request.param, seed=4)


@pytest.fixture(scope="module")
def hf(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # a fixed length, like ignore_eos
    return model.eval()


def hf_tokens(hf, prompt_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():  # the mask given: without it a BOS that is also the pad id is masked
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW,
                          min_new_tokens=NUM_NEW, do_sample=False)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_the_config_has_no_vision_and_plain_rope(model_dir):
    config = ModelConfig.from_model_dir(model_dir)
    assert config.vision is None
    assert config.mrope_section == (config.head_dim // 2, 0, 0)
    assert not (model_dir / "preprocessor_config.json").exists()
    is_llama = config.architecture == "LlamaForCausalLM"
    is_qwen3 = config.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    assert config.attention_bias is not (is_llama or is_qwen3)
    assert (config.llama3_rope_scaling is not None) is is_llama
    assert config.qk_norm is is_qwen3
    assert is_llama or config.head_dim == (48 if is_qwen3 else 32)
    if config.architecture == "Qwen3MoeForCausalLM":  # layer 1 keeps its dense MLP
        assert config.moe.sparse_layers == (0, 2, 3) and config.moe.normalize
        with pytest.raises(ModelLoadError, match="mixture-of-experts"):
            config.shard(2)


def test_unsupported_variants_are_refused(model_dir):
    raw = ModelConfig.from_model_dir(model_dir).extra
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_dict({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    llama = {**raw, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ModelLoadError, match="attention_bias"):
        ModelConfig.from_dict({**llama, "attention_bias": True})


@pytest.mark.parametrize("budget", [2048, 8])  # 8: every prompt arrives in several chunks
def test_prompts_match_transformers(model_dir, hf, budget):
    llm = LLM(str(model_dir), num_kv_blocks=256, max_num_batched_tokens=budget)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    results = llm.generate(PROMPTS, GREEDY)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.error is None, result.error
        if isinstance(prompt, str):  # with the BOS a Llama tokenizer adds
            assert result.prompt_token_ids == tokenizer(prompt)["input_ids"]
        else:
            expected = tokenizer.apply_chat_template(
                prompt["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            assert result.prompt_token_ids == list(expected)
        assert result.token_ids == hf_tokens(hf, result.prompt_token_ids)


def test_an_image_is_refused_and_the_batch_goes_on(model_dir):
    llm = LLM(str(model_dir), num_kv_blocks=256)
    content = [{"type": "image", "image": picture(56, 56, 1)}, {"type": "text", "text": "?"}]
    bad, good = llm.generate([{"messages": [{"role": "user", "content": content}]},
                              "Once upon a time"], GREEDY)  # fmt: skip
    assert bad.error is not None and "no images" in bad.error.message
    assert good.error is None and len(good.token_ids) == NUM_NEW
