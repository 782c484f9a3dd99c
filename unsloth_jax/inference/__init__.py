"""The generation engine: one on-device decode loop over a paged KV cache for `generate`, `fast_generate`, the
CLI and the RL trainers (docs/GENERATION.md).

    from unsloth_jax.inference import Engine, SamplingParams
    outs = Engine(model, tokenizer).generate(["Hi"], SamplingParams(n=2, temperature=0.7, max_tokens=32))

Modules: `sampling` (SamplingParams, the on-device sampler), `pages` (page pools and their allocator),
`weights` (the rollout's weights: shared, copied or merged), `runner` (the compiled prefill and decode loop),
`engine` (continuous batching, vLLM's RequestOutput), `image_inputs` (prompts with images: ImageInputs, their
checks and prefill batches), `eos` (end-of-sequence ids).
"""
from unsloth_jax.inference.engine import CompletionOutput, Engine, Logprob, RequestOutput
from unsloth_jax.inference.image_inputs import ImageInputs
from unsloth_jax.inference.sampling import SamplingParams

__all__ = ["Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "ImageInputs"]
