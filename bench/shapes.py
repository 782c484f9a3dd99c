"""The ANCHORS.md model shapes as transformers config kwargs."""
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
}
