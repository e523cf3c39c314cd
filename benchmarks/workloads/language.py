"""Real programs: Hugging Face GPT-2 (forward; as a lambda and as the module) and a Llama
decode step with a StaticCache updated in place. Random weights, no downloads."""

from __future__ import annotations

import itertools

import torch

from ..core import Instance, need, seeded

# 10. HF GPT-2 forward, batch 2, seq 32 ------------------------------------------

GPT2_LAYERS, GPT2_EMBD, GPT2_HEADS, GPT2_B, GPT2_T = 4, 256, 4, 2, 32


def _gpt2_model(dev):
    tr = need("transformers")
    seeded()
    cfg = tr.GPT2Config(n_layer=GPT2_LAYERS, n_embd=GPT2_EMBD, n_head=GPT2_HEADS, n_positions=128, use_cache=False)
    return tr.GPT2LMHeadModel(cfg).eval().to(dev)  # vocabulary: GPT-2's 50257


def gpt2_factory(dev):
    model = _gpt2_model(dev)
    return Instance(lambda ids: model(ids).logits, keep=model)


def gpt2_module_factory(dev):
    model = _gpt2_model(dev)
    return Instance(model, mgc_module=model)  # gt.graphify(model): a ModelOutput comes back


def gpt2_args(dev):
    return (torch.randint(0, 50257, (GPT2_B, GPT2_T), device=dev),)


# 11. HF Llama: one decode step with a StaticCache ----------------------------

LLAMA_PROMPT, LLAMA_MAX_LEN, LLAMA_STEPS = 16, 64, 12
LLAMA_CFG = dict(vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=False)


def llama_factory(dev):
    """A fresh model and StaticCache, prefilled eagerly with the same prompt.

    The decode step is HF's recipe for CUDA graphs: model(input_ids=tok,
    past_key_values=cache, use_cache=True) with in-place cache updates. In
    transformers 5.x StaticCache has no cache_position: each layer writes at
    its own device-side counter (cumulative_length) and advances it. The step
    sets the counters to `pos` first, so a call is "decode tok at position
    pos" (4.x's cache_position semantics) and repeating a call rewrites the
    same slot instead of running past max_cache_len in the timing loop.
    """
    tr = need("transformers")
    import inspect

    seeded()
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**LLAMA_CFG)).eval().to(dev)
    cache = tr.StaticCache(config=model.config, max_cache_len=LLAMA_MAX_LEN)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, LLAMA_CFG["vocab_size"], (1, LLAMA_PROMPT), generator=g).to(dev)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
    if "cache_position" in inspect.signature(model.forward).parameters:  # transformers 4.x
        def step(tok, pos):
            return model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
    else:
        counters = [layer.cumulative_length for layer in cache.layers]

        def step(tok, pos):
            p = pos.reshape(())
            for c in counters:
                c.copy_(p)
            return model(input_ids=tok, past_key_values=cache, position_ids=pos.view(1, 1), use_cache=True).logits

    return Instance(step, keep=(model, cache))


def llama_args_factory():
    k = itertools.count()  # call i: token i of a fixed random sequence, at position prompt + i

    def make(dev):
        i = next(k)
        g = torch.Generator().manual_seed(100 + i)
        tok = torch.randint(0, LLAMA_CFG["vocab_size"], (1, 1), generator=g).to(dev)
        return (tok, torch.tensor([LLAMA_PROMPT + i % (LLAMA_MAX_LEN - LLAMA_PROMPT)], device=dev))

    return make
