"""Flax NNX models: one decoder for every supported family (see decoder.py for the module tree)."""
from unsloth_jax.models.attention import Attention, Batch, KVCache
from unsloth_jax.models.decoder import (ATTN_PROJS, MLP_PROJS, PROJ_PARENT, CausalLM, DecoderLayer, DecoderModel,
                                        make_batch)
from unsloth_jax.models.layer_stack import REMAT_MODES, LayerStackPolicy, remat
from unsloth_jax.models.layers import Embedding, FP8Param, Linear, NF4Param, RMSNorm, value_of
from unsloth_jax.models.mlp import MLP
from unsloth_jax.models.moe import Experts, GroupedLinear, Router, RouterStats, SparseMLP, load_balancing_loss

__all__ = ["ATTN_PROJS", "MLP_PROJS", "PROJ_PARENT", "REMAT_MODES", "LayerStackPolicy", "Attention", "Batch", "KVCache",
           "CausalLM",
           "DecoderLayer", "DecoderModel", "Embedding", "FP8Param", "Linear", "MLP", "NF4Param", "RMSNorm", "make_batch", "remat",
           "value_of", "Experts", "GroupedLinear", "Router", "RouterStats", "SparseMLP", "load_balancing_loss"]
