"""The ANCHORS.md model shapes (and the Gemma 3 / Phi-3 ones of issue 18) as transformers config kwargs."""
SHAPES = {
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # larger shapes for the full fine-tuning fit (bench/full_ft_fit.py); config values of Qwen2.5-3B/7B/14B
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-14b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
                        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "gemma2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=8192, rms_norm_eps=1e-6),
    # Gemma-3-1B: 26 layers = 4 scan groups of 6 (5 sliding, 1 global) + a tail of 2; two RoPE bases
    "gemma3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                      sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                      query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=32768, rms_norm_eps=1e-6),
    # Phi-3-mini-4k: fused qkv_proj / gate_up_proj in the checkpoint, sliding window 2047 on every layer
    "phi3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, sliding_window=2047,
                      rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=32000, pad_token_id=32000),
    # bench/smoke.py: the GGUF/merged export row (Qwen2-0.5B's body as a Llama, with the bundled tiny-llama
    # tokenizer's 2048-token vocabulary, since random-init checkpoints have no tokenizer), and the --tiny rows
    "llama-0.5b-tok2k": dict(model_type="llama", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, vocab_size=2048, rope_theta=1000000.0,
                             max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                             bos_token_id=1, eos_token_id=2, pad_token_id=3),
    "qwen2-tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                       max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "llama3-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rope_theta=500000.0,
                        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5),
}



def _qwen2_5_vl(ids: tuple[int, int, int, int], text: dict, mrope_section: list[int], rope_theta: float,
                vision: dict) -> dict:
    """A Qwen2.5-VL config: ids (vision_start, image, vision_end, video), the text and vision sizes; what every
    Qwen2.5-VL shares (untied head, SiLU, RMSNorm eps 1e-6, temporal patch 2, merge 2) filled in."""
    start, image, end, video = ids
    return dict(model_type="qwen2_5_vl", vision_start_token_id=start, image_token_id=image, vision_end_token_id=end,
                video_token_id=video, tie_word_embeddings=False,
                text_config=dict(text, tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
                                 rope_parameters=dict(rope_type="default", rope_theta=rope_theta,
                                                      mrope_section=mrope_section)),
                vision_config=dict(vision, in_channels=3, temporal_patch_size=2, spatial_merge_size=2,
                                   tokens_per_second=2, hidden_act="silu"))


def _gemma3(ids: tuple[int, int, int], mm_tokens_per_image: int, text: dict, pattern: int, full_rope: dict,
            vision: dict) -> dict:
    """A Gemma 3 vision-language config: ids (boi, image, eoi), the text sizes with every pattern-th layer global
    and full_rope on those layers, the SigLIP sizes; what Gemma 3 shares (tied head, GELU-tanh, local RoPE 1e4,
    token ids 0-2) filled in."""
    boi, image, eoi = ids
    layers = text["num_hidden_layers"]
    return dict(model_type="gemma3", boi_token_index=boi, image_token_index=image, eoi_token_index=eoi,
                mm_tokens_per_image=mm_tokens_per_image, tie_word_embeddings=True,
                text_config=dict(text, sliding_window_pattern=pattern, hidden_activation="gelu_pytorch_tanh",
                                 rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                                 layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                              for i in range(layers)],
                                 rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                                      full_attention=full_rope)),
                vision_config=dict(vision, model_type="siglip_vision_model", num_channels=3,
                                   hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False))


# Vision-language shapes of bench/vision_bench.py: VL_SHAPES[family][shape] = {"config": transformers config kwargs
# (model_type, text_config, vision_config, token ids), "image_side": the side in pixels of each benchmark image}.
# 7b: Qwen2.5-VL-7B-Instruct; 4b: gemma-3-4b-it (docs/VISION.md, "Benchmark", says where each number was checked).
# tiny: two layers of width 32-64 and 32-pixel images, for the CPU smoke run and tests/test_vision_bench.py.
VL_SHAPES = {
    "qwen2_5_vl": {
        "7b": {"image_side": 448,  # grid 1 x 32 x 32 = 1024 patches -> 256 image tokens
               "config": _qwen2_5_vl(
                   (151652, 151655, 151653, 151656),
                   dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                        bos_token_id=151643, eos_token_id=151645),
                   [16, 24, 24], 1000000.0,
                   dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]))},
        "tiny": {"image_side": 32,  # patch 4: grid 1 x 8 x 8 = 64 patches -> 16 image tokens, 4 windows
                 "config": _qwen2_5_vl(
                     (510, 508, 511, 509),
                     dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=1,
                          eos_token_id=2),
                     [2, 3, 3], 10000.0,
                     dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=4, window_size=16, fullatt_block_indexes=[1]))},
    },
    "gemma3": {
        "4b": {"image_side": 896,  # SigLIP 896 / 14 = 64 x 64 patches, pooled to 256 image tokens
               "config": _gemma3(
                   (255999, 262144, 256000), 256,
                   dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                        query_pre_attn_scalar=256, max_position_embeddings=131072),
                   6, dict(rope_type="linear", factor=8.0, rope_theta=1000000.0),
                   dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                        image_size=896, patch_size=14))},
        "tiny": {"image_side": 32,  # patch 8: 4 x 4 patches pooled to 4 image tokens
                 "config": _gemma3(
                     (508, 509, 510), 4,
                     dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=16,
                          query_pre_attn_scalar=16, max_position_embeddings=512),
                     2, dict(rope_type="default", rope_theta=1000000.0),
                     dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          image_size=32, patch_size=8))},
    },
}
