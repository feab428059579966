"""Tiny mixture-of-experts models of transformers 5 (random init from configs, no download): Mixtral, Qwen3-MoE,
DeepSeek-V3 (with a shared expert), gpt-oss (expert biases, transposed storage, interleaved gate). 4 experts, top-2,
hidden 64, expert intermediate 48 (so 2I != H: every shape tells which projection it is)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
CONFIGS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                       head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=48, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                         q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def config(name: str, **overrides):
    config_class, _, kwargs = CONFIGS[name]
    return getattr(transformers, config_class)(**{**_COMMON, **kwargs, **overrides})


def moe_model(name: str = "mixtral", seed: int = 0, **overrides):
    """A freshly initialised tiny model (the same weights for the same seed)."""
    torch.manual_seed(seed)
    return getattr(transformers, CONFIGS[name][1])(config(name, **overrides))


def token_batches(count: int, batch_size: int = 4, seq: int = 16, seed: int = 0):
    """Language-model batches (input_ids and labels) of random tokens."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches
