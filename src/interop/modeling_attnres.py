# modeling_attnres.py: a Full or Block Attention Residuals (AttnRes) language model for Hugging
# Face transformers, written by `attnres export-hf` beside the model's config.json and weights.
# Load it with
#     AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
#
# The model is Llama's (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU) with every
# residual connection replaced by a depth mix (the attnres SPEC, sections 2 and 3). Sublayer l
# (attention of layer l // 2 when l is even, its MLP when odd) reads a softmax mix of its sources:
# the embedding, the sums of the completed blocks of S sublayers, and the partial sum of its own
# block so far. The score of source v is dot(RMSNorm(v) * norm.w, proj.w), computed in float32;
# the mix adds the raw sources. The output mix reads the embedding and every block. Full AttnRes is
# S = 1; Kimi K3's attn_res_block_size counts layers, S = 2 x it.
#
# Tensor names follow Kimi K3: model.layers.{i}.self_attention_res_norm / _proj, mlp_res_norm /
# _proj, and model.output_attn_res_norm / _proj. Batched inputs with padding are not supported.
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig as _ConfigBase  # transformers 5
except ImportError:  # transformers 4
    from transformers import PretrainedConfig as _ConfigBase


class AttnResConfig(_ConfigBase):
    model_type = "attnres"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=256, hidden_size=128, intermediate_size=352,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=None,
                 max_position_embeddings=256, rms_norm_eps=1e-10, rope_theta=10000.0,
                 tie_word_embeddings=True, attnres_residual="full", attnres_block_size=1,
                 attnres_key_norm_eps=None, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        if attnres_residual not in ("full", "block"):
            raise ValueError(f"attnres_residual must be 'full' or 'block', not {attnres_residual!r}")
        self.attnres_residual = attnres_residual
        self.attnres_block_size = 1 if attnres_residual == "full" else int(attnres_block_size)
        if self.attnres_block_size < 1:
            raise ValueError("attnres_block_size (sublayers per block) must be at least 1")
        self.attnres_key_norm_eps = rms_norm_eps if attnres_key_norm_eps is None else attnres_key_norm_eps
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.h = c.num_attention_heads
        self.kv = c.num_key_value_heads
        self.hd = c.hidden_size // c.num_attention_heads
        d = c.hidden_size
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        rep = self.h // self.kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DepthMix(nn.Module):
    """A softmax over sources scored by dot(RMSNorm(v) * norm.w, proj.w), in float32."""

    def __init__(self, norm, proj, eps):
        super().__init__()
        self.norm, self.proj, self.eps = norm, proj, eps

    def __call__(self, sources):
        v = torch.stack([s.float() for s in sources])  # (n, B, T, d)
        q = (self.norm.weight.float() * self.proj.weight.float()[0])
        k = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)
        alpha = torch.softmax((k * q).sum(-1), dim=0)  # (n, B, T)
        return (alpha.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


class DecoderLayer(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        d, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(c, layer_idx)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(c)
        self.self_attention_res_norm = RMSNorm(d, c.attnres_key_norm_eps)
        self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
        self.mlp_res_norm = RMSNorm(d, c.attnres_key_norm_eps)
        self.mlp_res_proj = nn.Linear(d, 1, bias=False)


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, 0.02)


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(c.hidden_size, c.attnres_key_norm_eps)
        self.output_attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
        self.post_init()

    def rope(self, positions, dtype):
        hd = self.config.hidden_size // self.config.num_attention_heads
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32,
                                                             device=positions.device) / hd))
        f = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]

    def forward(self, input_ids, cache=None):
        T = input_ids.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        positions = torch.arange(past, past + T, device=input_ids.device)
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        keys = torch.arange(past + T, device=input_ids.device)
        mask = keys[None, :] <= positions[:, None]  # causal, over the cached keys too
        eps = self.config.attnres_key_norm_eps
        S = self.config.attnres_block_size
        blocks, partial = [h], None  # completed sources; the open block's partial sum
        for l in range(2 * len(self.layers)):
            layer = self.layers[l // 2]
            if l % S == 0 and partial is not None:  # a block closes before sublayer l
                blocks.append(partial)
                partial = None
            sources = blocks + ([partial] if partial is not None else [])
            if l % 2 == 0:
                x = DepthMix(layer.self_attention_res_norm, layer.self_attention_res_proj,
                             eps)(sources)
                y = layer.self_attn(layer.input_layernorm(x), cos, sin, mask, cache)
            else:
                x = DepthMix(layer.mlp_res_norm, layer.mlp_res_proj, eps)(sources)
                y = layer.mlp(layer.post_attention_layernorm(x))
            partial = y if partial is None else partial + y
        blocks.append(partial)
        out = DepthMix(self.output_attn_res_norm, self.output_attn_res_proj, eps)(blocks)
        return self.norm(out)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = AttnResModel(config)
        # A tied head reads the embedding itself (no lm_head tensor in the file).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, logits_to_keep=0,
                labels=None, **kwargs):
        if inputs_embeds is not None:
            raise NotImplementedError("AttnResForCausalLM takes input_ids, not inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("padded batches are not supported: give unpadded input_ids")
        if past_key_values is None:  # (transformers 5.2x's generate passes it as `cache`)
            past_key_values = kwargs.get("cache")
        if use_cache is None:
            use_cache = getattr(self.config, "use_cache", True)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        h = self.model(input_ids, past_key_values if use_cache else None)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = (h @ w.t()).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=past_key_values if use_cache else None)
