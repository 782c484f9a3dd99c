"""The ANCHORS.md model shapes (and the Gemma 3 / Phi-3 ones of issue 18) as transformers config kwargs."""
SHAPES = {
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
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
}
