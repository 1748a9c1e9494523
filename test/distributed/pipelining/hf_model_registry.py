"""Tiny Hugging Face causal LMs for the tests of ``torch_pipelining_ext.hf``.

Each factory returns a transformers config small enough for four gloo ranks
on two CPU cores (hidden size 32, 4 heads, a few experts), with dropout off so
that split and unsplit runs compute the same thing.  Mixed attention types
use a window of 4 < the tests' sequence length 8, so a wrong mask shows.
No download: every model is built from its config.

The reference computations of the MoE balancing tests (the router auxiliary
losses written out, the routing counts) read the unsplit model's routing with
hooks on transformers' own router class.
"""

from __future__ import annotations

import sys

import torch


# Every family the package claims (docs/hf.md): exact against the unsplit model
# on transformers 4.57.x and 5.x.
HF_FAMILIES = (
    "llama",
    "qwen2",
    "qwen2_sliding",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt2",
    "mistral",
    "phi3",
    "olmo2",
    "gpt_oss",
    "qwen2_moe",
    "olmoe",
    "glm4_moe",
    "gemma2",
    "gemma3_text",
    "qwen3_next",
)
MOE_FAMILIES = (
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
    "gpt_oss",
    "qwen2_moe",
    "olmoe",
    "glm4_moe",
    "qwen3_next",
)
WINDOW = 4


def tiny_hf_config(family: str, num_layers: int = 3, vocab_size: int = 64, **overrides):
    """A tiny transformers config of ``family``; ``overrides`` go to the config's constructor."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    alternating = [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(num_layers)
    ]
    if family == "llama":
        cls, kw = tf.LlamaConfig, {}
    elif family == "qwen2":
        cls, kw = tf.Qwen2Config, {}
    elif family == "qwen2_sliding":
        # layers from max_window_layers on use the sliding window
        cls, kw = (
            tf.Qwen2Config,
            dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        )
    elif family == "qwen3":
        cls, kw = tf.Qwen3Config, dict(head_dim=8)
    elif family == "qwen3_moe":
        cls, kw = (
            tf.Qwen3MoeConfig,
            dict(
                head_dim=8,
                moe_intermediate_size=16,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        )
    elif family == "mixtral":
        cls, kw = tf.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)
    elif family == "deepseek_v3":
        cls = tf.DeepseekV3Config
        kw = dict(
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    elif family == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=vocab_size,
            n_embd=32,
            n_layer=num_layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            loss_type="ForCausalLM",
            bos_token_id=1,
            eos_token_id=2,
            **overrides,
        )
        return cfg
    elif family == "mistral":
        cls, kw = tf.MistralConfig, dict(sliding_window=WINDOW)
    elif family == "phi3":
        cls, kw = (
            tf.Phi3Config,
            dict(sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        )
    elif family == "olmo2":
        cls, kw = tf.Olmo2Config, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    elif family == "gpt_oss":
        cls = tf.GptOssConfig
        kw = dict(
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=alternating,
            intermediate_size=16,
        )
    elif family == "qwen2_moe":
        cls = tf.Qwen2MoeConfig
        kw = dict(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        )
    elif family == "olmoe":
        cls, kw = (
            tf.OlmoeConfig,
            dict(
                num_experts=4,
                num_experts_per_tok=2,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
        )
    elif family == "glm4_moe":
        cls = tf.Glm4MoeConfig
        kw = dict(
            head_dim=8,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        )
    elif family == "gemma2":
        cls = tf.Gemma2Config
        kw = dict(
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=alternating,
            query_pre_attn_scalar=8,
        )
    elif family == "gemma3_text":
        cls = tf.Gemma3TextConfig
        kw = dict(
            head_dim=8,
            sliding_window=WINDOW,
            layer_types=alternating,
            query_pre_attn_scalar=8,
        )
    elif family == "qwen3_next":
        cls = tf.Qwen3NextConfig
        kw = dict(
            head_dim=8,
            layer_types=[
                "linear_attention" if i % 2 == 0 else "full_attention"
                for i in range(num_layers)
            ],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        )
    else:
        raise ValueError(f"unknown family {family!r}; one of {HF_FAMILIES}")
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop"):
        common.setdefault(key, 0.0)
    return cls(**{**common, **kw, **overrides})


def tiny_hf_model(family: str, seed: int = 0, **kwargs):
    """A tiny transformers causal LM of ``family`` with seeded random weights, in float32."""
    import transformers as tf

    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(tiny_hf_config(family, **kwargs)).float()


# ---------------------------------------------------------------------------
# References of the MoE balancing tests, from the unsplit model's routing
# ---------------------------------------------------------------------------


def _is_moe_layer(layer) -> bool:
    return any(
        name.rsplit(".", 1)[-1] == "experts" for name, _ in layer.named_modules()
    )


def router_records(model, ids, mask=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(router logits [T, E], routed top-k indices [T, k]) of every MoE layer
    of the unsplit ``model``'s forward, from hooks on transformers' router class."""
    recorder = model.get_submodule(model.base_model_prefix)._can_record_outputs
    router_cls = recorder["router_logits"].target_class
    records = []
    handles = [
        m.register_forward_hook(lambda mod, a, out: records.append((out[0], out[2])))
        for m in model.modules()
        if isinstance(m, router_cls)
    ]
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return records


def per_layer_loss_by_hand(model, ids, mask) -> torch.Tensor:
    """Sum over MoE layers of transformers' load_balancing_loss_func on that layer alone."""
    func = sys.modules[type(model).__module__].load_balancing_loss_func
    records = router_records(model, ids, mask)
    e, k = model.num_experts, model.num_experts_per_tok
    return sum(func((logits,), e, k, mask) for logits, _ in records)


def sequence_loss_by_hand(model, ids, mask, sigmoid: bool) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (without alpha), written out:
    per layer, the mean over sequences with a real token of
    sum_i f_i P_i, f_i = E/(K T) #{t: i routed}, P_i = mean_t s'_{t,i}; summed over layers."""
    records = router_records(model, ids, mask)
    b, s = ids.shape
    total = torch.zeros(())
    for logits, indices in records:
        e, k = logits.shape[-1], indices.shape[-1]
        terms = []
        for row in range(b):
            tokens = [t for t in range(s) if mask[row, t]]
            if not tokens:
                continue
            f = torch.zeros(e)
            p = torch.zeros(e)
            for t in tokens:
                u = logits[row * s + t].float()
                score = u.sigmoid() if sigmoid else u.softmax(-1)
                p = p + score / score.sum()
                for i in indices[row * s + t].tolist():
                    f[i] += 1
            f = f * e / (k * len(tokens))
            p = p / len(tokens)
            terms.append((f * p).sum())
        total = total + torch.stack(terms).mean()
    return total


def routing_counts(model, ids, mask) -> dict[int, torch.Tensor]:
    """Per MoE layer index: real-token slots per expert in the unsplit model's routing."""
    records = router_records(model, ids, mask)
    moe_layers = [
        i for i, layer in enumerate(model.model.layers) if _is_moe_layer(layer)
    ]
    e = records[0][0].shape[-1]
    out = {}
    for layer, (_, indices) in zip(moe_layers, records):
        weights = mask.reshape(-1, 1).expand_as(indices).reshape(-1)
        out[layer] = torch.bincount(indices.reshape(-1), weights, minlength=e).long()
    return out


def padded_batch(
    seed: int, vocab_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of 8 sequences of 8 tokens, three
    of them right-padded (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (8, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    mask[6, 3:] = 0
    mask[7, 7:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def balanced_loss_by_hand(model, batch, mode: str, coef: float) -> torch.Tensor:
    """The unsplit ``model``'s loss on ``batch`` as the stages compute it with a
    router auxiliary loss of form ``mode``: the global batch's token-mean LM
    loss plus ``coef`` times the mean over the rows of each row's auxiliary
    term (every microbatch of the pipeline one row)."""
    ids, mask, labels = batch
    lm = model(
        input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False
    ).loss
    rows = [(ids[i : i + 1], mask[i : i + 1]) for i in range(ids.shape[0])]
    if mode == "pooled":
        terms = [
            model(input_ids=i, attention_mask=m, output_router_logits=True).aux_loss
            for i, m in rows
        ]
    elif mode == "per_layer":
        terms = [per_layer_loss_by_hand(model, i, m) for i, m in rows]
    else:
        sigmoid = model.config.model_type == "deepseek_v3"
        terms = [sequence_loss_by_hand(model, i, m, sigmoid) for i, m in rows]
    return lm + coef * torch.stack(terms).mean()
