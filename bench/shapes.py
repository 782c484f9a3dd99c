"""The ANCHORS.md model shapes (and the Gemma 3 / Phi-3 ones of issue 18, issue 46's Qwen3.5 / SmolLM3 / GLM-4.5 /
Gemma 4) as transformers config kwargs."""
# What Gemma 4 E2B and its tiny twin share: one kv head, the KV-shared layers' double-wide MLP, tied, softcap 30,
# and the period of 4 sliding layers then 1 full
_GEMMA4 = dict(model_type="gemma4_text", num_key_value_heads=1, use_double_wide_mlp=True, final_logit_softcapping=30.0,
               tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")
_GEMMA4_PERIOD = ["sliding_attention"] * 4 + ["full_attention"]

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
    # ---- issue 46's families (bench/smoke.py rows, bench/qwen35_ab.py), each with its --tiny twin ----
    # Qwen3.5-9B's text decoder: the largest released dense size (4B, 9B, 27B among them) whose bf16 LoRA step at
    # 4 x 2048 leaves both sides of bench/qwen35_ab.py room on an 80 GB card (transformers materialises the
    # 248320-wide logits); 27B's bf16 weights alone take 54 GB. Sizes from the Qwen3.5-9B model card: 32 layers as 8 x (3 gated
    # DeltaNet + 1 gated attention), hidden 4096, FFN 12288, vocabulary 248320, attention 16 q / 4 kv heads of 256
    # with 64 rotary dims (partial 0.25), DeltaNet 16 qk / 32 v heads of 128; rope_theta 1e7 from the released
    # GGUF's metadata (freq_base); untied head as transformers' Qwen3_5TextConfig defaults (which are these sizes).
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                       full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
                       max_position_embeddings=262144, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen3.5-tiny": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                         full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
                         max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6),
    # SmolLM3-3B: config.json of HuggingFaceTB/SmolLM3-3B (36 layers, every 4th NoPE, tied, 64k positions; also
    # transformers' SmolLM3Config defaults). Its rope_theta was not found in the stored pages: 2e6, the value of
    # optimum-intel's tiny-random-smollm3 config, stands in (it does not change the step's cost).
    "smollm3-3b": dict(model_type="smollm3", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=4, vocab_size=128256, no_rope_layer_interval=4,
                       rope_parameters=dict(rope_type="default", rope_theta=2000000.0),
                       max_position_embeddings=65536, tie_word_embeddings=True, rms_norm_eps=1e-6,
                       bos_token_id=128000, eos_token_id=128012, pad_token_id=128004),
    "smollm3-tiny": dict(model_type="smollm3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512, no_rope_layer_interval=4,
                         rope_parameters=dict(rope_type="default", rope_theta=2000000.0),
                         max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Gemma 4 E2B's text decoder (google/gemma-4-E2B's text_config, as in public parser tests of that config.json:
    # 35 layers, 4 sliding : 1 full, head_dim 256 / global_head_dim 512 on the full layers, 1 kv head, the last 20
    # layers KV-shared with a double-wide MLP, per-layer inputs of 256, vocabulary 262144, tied, final softcap 30).
    # As a gemma4_text (Gemma4ForCausalLM) checkpoint: the released repository is the multimodal gemma4 type.
    "gemma4-e2b": dict(_GEMMA4, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
                       head_dim=256, global_head_dim=512, vocab_size=262144, vocab_size_per_layer_input=262144,
                       hidden_size_per_layer_input=256, num_kv_shared_layers=20, sliding_window=512,
                       layer_types=_GEMMA4_PERIOD * 7, max_position_embeddings=131072),
    "gemma4-tiny": dict(_GEMMA4, hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4,
                        head_dim=16, global_head_dim=32, vocab_size=512, vocab_size_per_layer_input=512,
                        hidden_size_per_layer_input=8, num_kv_shared_layers=5, sliding_window=16,
                        layer_types=_GEMMA4_PERIOD * 2, max_position_embeddings=4096),
    # GLM-4.5-Air cut to 3 of its 46 layers (the first dense, two MoE), about 13 GB of bf16 weights: its
    # config.json values (as in PrimeIntellect/INTELLECT-3-Base, a GLM-4.5-Air continuation with the same
    # architecture): hidden 4096, dense FFN 10944, 128 routed experts of 1408 + 1 shared, top 8 of 1 group
    # (routed_scaling_factor 1.0, normalized), 96 q / 8 kv heads of 128, half-rotary RoPE 1e6, attention bias, no
    # q/k norm, vocabulary 151552, untied; its MTP layer (num_nextn_predict_layers 1) left out of the cut.
    "glm4.5-air-3l": dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, num_hidden_layers=3,
                          num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=151552,
                          moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
                          num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
                          routed_scaling_factor=1.0, first_k_dense_replace=1, partial_rotary_factor=0.5,
                          attention_bias=True, use_qk_norm=False, rope_theta=1000000.0,
                          max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "glm4.5-tiny": dict(model_type="glm4_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                        first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True,
                        use_qk_norm=False, rope_theta=1000000.0, max_position_embeddings=4096,
                        tie_word_embeddings=False, rms_norm_eps=1e-5),
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


def _qwen3_vl(ids: tuple[int, int, int, int], text: dict, mrope_section: list[int], rope_theta: float,
              vision: dict) -> dict:
    """A Qwen3-VL config: ids (vision_start, image, vision_end, video), the text and vision sizes; what every
    Qwen3-VL shares (untied head, SiLU text MLP, GELU-tanh tower, RMSNorm eps 1e-6, interleaved M-RoPE, temporal
    patch 2, merge 2) filled in."""
    start, image, end, video = ids
    return dict(model_type="qwen3_vl", vision_start_token_id=start, image_token_id=image, vision_end_token_id=end,
                video_token_id=video, tie_word_embeddings=False,
                text_config=dict(text, tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
                                 rope_parameters=dict(rope_type="default", rope_theta=rope_theta,
                                                      mrope_section=mrope_section, mrope_interleaved=True)),
                vision_config=dict(vision, in_channels=3, temporal_patch_size=2, spatial_merge_size=2,
                                   hidden_act="gelu_pytorch_tanh"))


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
# 7b: Qwen2.5-VL-7B-Instruct; 4b: gemma-3-4b-it (docs/VISION.md, "Benchmark", says where each number was checked);
# 8b: Qwen3-VL-8B-Instruct (its comment below).
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
    # 8b: Qwen3-VL-8B-Instruct, from the released GGUF's metadata (ollama qwen3-vl:8b-instruct-bf16: 36 layers of
    # 4096, FFN 12288, 32 q / 8 kv heads of 128, rope 5e6; tower 27 blocks of 1152, 16 heads, patch 16, DeepStack
    # from blocks 8, 16, 24) and a Qwen3-VL-8B-derived config.json (Steinate/Cortex: vocabulary 151936, tower FFN
    # 4304, 2304 position embeddings, M-RoPE sections [24, 20, 20] interleaved, the vision token ids).
    "qwen3_vl": {
        "8b": {"image_side": 512,  # patch 16: grid 1 x 32 x 32 = 1024 patches -> 256 image tokens
               "config": _qwen3_vl(
                   (151652, 151655, 151653, 151656),
                   dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                        bos_token_id=151643, eos_token_id=151645),
                   [24, 20, 20], 5000000.0,
                   dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                        patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]))},
        "tiny": {"image_side": 32,  # patch 4: grid 1 x 8 x 8 = 64 patches -> 16 image tokens
                 "config": _qwen3_vl(
                     (510, 508, 511, 509),
                     dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=2),
                     [4, 2, 2], 10000.0,
                     dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          patch_size=4, num_position_embeddings=16, deepstack_visual_indexes=[0]))},
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
