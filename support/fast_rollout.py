"""The fast Hugging Face rollout (`--rollout hf-fast`): a decode loop over the model's own forward.

`HFRollout` calls `generate`; on a CPU and a small model most of its time is not the model's
arithmetic but what surrounds it (issue 31, measured in bench/rollout_bench.py):
- the default cache grows by `torch.cat`, rewriting every layer's K/V at every step;
- with a padding mask transformers' SDPA path does not pass `enable_gqa`, so `repeat_kv` copies
  the K/V of a grouped-query model once more, in every layer, at every step (prompts of unequal
  lengths; the built-in task's are all of one length, its mask is dropped and SDPA gets `enable_gqa`);
- finished rows keep running until the longest one stops.
`FastHFRollout` keeps the model and its modules (`Decoder`: every step is `model.forward`, so its
logits are the model's) and replaces those three through transformers' extension points:
- `PreallocatedCache`, a `Cache` of `PreallocatedLayer`s: K/V written in place into a buffer
  sized once for the rollout, handed back as views; rows that stop are compacted out of it;
- `gqa_sdpa_attention`, registered with `AttentionInterface` as "vcppo_gqa_sdpa": SDPA with the
  key/value heads shared by their query group, never copied;
- the padding masks are built once per rollout and passed to the model as 4D masks, which every
  model's mask builder (`create_causal_mask`) takes as they are, so no step rebuilds them.
Sampling is `generate`'s: temperature, then top-p (as `TopPLogitsWarper`), then a multinomial
draw; temperature 0 is greedy. It draws from its own generator seeded with the seed, so the same
seed gives the same batch and the global RNG is left alone; under torchrun each rank draws from
seed + rank, as `HFRollout` does. There FSDP's all-gathers pair up across ranks, so every rank steps
until the last row of every rank has stopped: a rank whose rows have all stopped keeps one of them
decoding, unrecorded (what `generate`'s `synced_gpus` does). Log-probs, finish reasons and the
`RolloutBatch` layout are `HFRollout`'s (rollout.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from fsdp_utils import any_rank
from rollout import HFRollout, RolloutBatch, check_sampling, probabilities_checked, rank_seed

ATTENTION = "vcppo_gqa_sdpa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA over [B, heads, S, D] with the model's additive mask; a key/value head serves its group of
    query heads in place (`enable_gqa`) instead of being repeated. Returns [B, S, heads, D], None."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, gqa_sdpa_attention)


class PreallocatedLayer(CacheLayerMixin):
    """One layer's K/V in buffers [B, kv_heads, max_len, D] allocated at the first update: each update
    writes its positions in place and returns views of the rows in use up to the current length."""

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len, self.length, self.rows = max_len, 0, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, heads, _, dim = key_states.shape
        self.keys = key_states.new_empty(B, heads, self.max_len, dim)
        self.values = value_states.new_empty(B, value_states.shape[1], self.max_len, value_states.shape[-1])
        self.rows, self.is_initialized = B, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self.max_len:
            raise ValueError(f"PreallocatedLayer: {end} positions do not fit max_len {self.max_len}")
        self.keys[: self.rows, :, self.length : end] = key_states
        self.values[: self.rows, :, self.length : end] = value_states
        self.length = end
        return self.keys[: self.rows, :, :end], self.values[: self.rows, :, :end]

    def keep(self, index: torch.Tensor) -> None:
        """Keep rows `index` (in order) as the first rows; the buffers are reused, and only the rows
        that change place move (the K/V written so far)."""
        moved = (index != torch.arange(len(index), device=index.device)).nonzero().squeeze(1)
        if len(moved):
            self.keys[moved, :, : self.length] = self.keys[index[moved], :, : self.length]
            self.values[moved, :, : self.length] = self.values[index[moved], :, : self.length]
        self.rows = len(index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len


class PreallocatedCache(Cache):
    """A model's K/V cache of `PreallocatedLayer`s, every layer max_len positions long."""

    def __init__(self, num_layers: int, max_len: int):
        super().__init__(layers=[PreallocatedLayer(max_len) for _ in range(num_layers)])

    def keep(self, index: torch.Tensor) -> None:
        """Drop every row not in `index` (rows that stopped) and renumber the others 0..len-1."""
        for layer in self.layers:
            layer.keep(index)


@contextmanager
def attention_implementation(model, name: str):
    """Run `model` with the attention function registered as `name`, then restore its own."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], their log-probs at the temperature [B]) from next-token logits [B, V], as `generate`
    samples: logits / temperature, top-p truncation, a multinomial draw; greedy at temperature 0.
    The log-probs are of the untruncated distribution (README: the quantity PPO recomputes)."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logprobs = F.log_softmax(scaled, -1)
    if top_p < 1.0:  # TopPLogitsWarper: drop the least likely tokens whose total mass is <= 1 - top_p
        ascending, order = torch.sort(scaled, descending=False)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        scaled = scaled.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    with probabilities_checked():
        tokens = torch.multinomial(scaled.softmax(-1), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class Decoder:
    """A batch of prompts decoded one position at a time by the model's own forward: the prompts'
    forward at construction (`logits`), then `step(tokens)` for each next token of every row still
    going, over a `PreallocatedCache` and the registered grouped-query attention. Masks and positions
    are built once here: padded keys get -inf, and a row's positions count its real tokens, as in
    `generate` and `RolloutBatch.model_inputs`. `keep(index)` drops the rows not in `index`."""

    def __init__(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int):
        self.model = model
        B, P = prompt_ids.shape
        dtype, device = next(model.parameters()).dtype, prompt_ids.device
        # Generated positions stay 0 in the key mask: a decoding step attends to all before it.
        self.key_bias = torch.zeros(B, 1, 1, P + max_new_tokens, dtype=dtype, device=device)
        self.key_bias[:, 0, 0, :P].masked_fill_(prompt_mask == 0, float("-inf"))
        causal = torch.full((P, P), float("-inf"), dtype=dtype, device=device).triu(1)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = PreallocatedCache(model.config.num_hidden_layers, P + max_new_tokens)
        prompt_bias = self.key_bias[..., :P] + causal
        # A left pad's query row would mask every key, which some GPU SDPA kernels turn into NaN (0 on
        # the CPU) that the next layers' values carry to every token: it sees itself, never read.
        prompt_bias.diagonal(dim1=-2, dim2=-1).zero_()
        self.logits = self._forward(prompt_ids, prompt_bias, positions)  # [B, V]
        self.positions = positions[:, -1:] + 1

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits [rows, V] after appending `tokens` [rows], one per row still going."""
        length = self.cache.get_seq_length() + 1
        self.logits = self._forward(tokens[:, None], self.key_bias[..., :length], self.positions)
        self.positions = self.positions + 1
        return self.logits

    def keep(self, index: torch.Tensor) -> None:
        """Keep rows `index` only (in that order): finished rows cost nothing from here on."""
        self.cache.keep(index)
        self.key_bias, self.positions, self.logits = self.key_bias[index], self.positions[index], self.logits[index]

    def _forward(self, ids, mask, positions) -> torch.Tensor:
        # A 4D mask, which `create_causal_mask` hands back as it is. Not the {layer type: mask}
        # mapping `generate` passes: only some models take one (Qwen2); others (Llama, Mistral) give
        # it to `create_causal_mask`, which knows no mask for our attention and drops it, causal too.
        with attention_implementation(self.model, ATTENTION):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]


MARK = -1.0  # attention_gets_the_mask's mask: exact in bf16, and neither 0 nor -inf


@torch.no_grad()
def attention_gets_the_mask(model) -> bool:
    """Whether every attention layer of `model` is handed a 4D mask as it is given, as transformers'
    mask builder (`create_causal_mask`) does. A model whose forward builds a mask of its own, or
    attends by a function of its own (remote code), would sample from other logits than its own, in
    silence. One forward of one token, its attention watched (on every rank, as FSDP needs).
    The mask holds a mark no mask builder makes (one key: softmax ignores it), checked by value, not
    identity: FSDP2 hands the model a copy, cast to bf16 (mixed precision) or moved to the GPU (offload)."""
    param = next(model.parameters())
    mask, seen = torch.full((1, 1, 1, 1), MARK, dtype=param.dtype, device=param.device), []

    def watched(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append(torch.is_tensor(attention_mask) and attention_mask.shape == mask.shape
                    and bool((attention_mask == MARK).all()))
        return gqa_sdpa_attention(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register(ATTENTION + "_watched", watched)
    try:
        with attention_implementation(model, ATTENTION + "_watched"):
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=param.device), attention_mask=mask,
                  use_cache=False)
    except torch.OutOfMemoryError:  # a RuntimeError, but no verdict on the model: said as it is
        raise
    except (AttributeError, TypeError, ValueError, RuntimeError):  # a forward that takes no 4D mask
        return False
    return len(seen) == model.config.num_hidden_layers and all(seen)


class FastHFRollout(HFRollout):
    """Sampling with the trained model itself, like `HFRollout`, through a `Decoder` (module
    docstring); rows that stop are dropped from the batch at once."""

    def __init__(self, model, tokenizer):
        # The cache and the masks are full attention's. A model without layer_types has only those,
        # unless its config sets a sliding window for every layer (Mistral-7B-v0.1, Phi-3-mini).
        config = model.config
        default = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
        kinds = set(getattr(config, "layer_types", None) or default)
        if kinds != {"full_attention"}:
            raise ValueError(f"--rollout hf-fast decodes full-attention layers only, and this model has "
                             f"{', '.join(sorted(kinds - {'full_attention'}))} layers: use --rollout hf")
        if not attention_gets_the_mask(model):
            raise ValueError(f"--rollout hf-fast hands its masks to the model's attention, and "
                             f"{type(model).__name__.removeprefix('FSDP')} builds its own: use --rollout hf")
        super().__init__(model, tokenizer)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt; temperature 0 means greedy. The batch is on the model's device."""
        model = self.model
        check_sampling(temperature, top_p)
        ids, mask = self.padded_prompts(prompt_ids)
        device = ids.device
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        # A seed makes the rollout a function of (seed, weights, prompts): resumed runs replay exactly.
        # Without one, torch's RNG picks it (so torch.manual_seed still makes runs repeatable).
        generator = torch.Generator(device)
        generator.manual_seed(rank_seed(seed))
        B = len(ids)
        response = torch.full((B, max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(B, max_new_tokens, device=device)
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
        rows = torch.arange(B, device=device)  # the batch row of each row still going
        was_training = model.training
        model.eval()
        decoder = Decoder(model, ids, mask, max_new_tokens)
        stop_ids = torch.tensor(self.stop_ids, device=device)
        logits, done = decoder.logits, False  # done: every row of this rank has stopped
        for t in range(max_new_tokens):
            if not done:
                tokens, token_logprobs = sample_tokens(logits, temperature, top_p, generator)
                response[rows, t], logprobs[rows, t] = tokens, token_logprobs
                stopped = torch.isin(tokens, stop_ids)
                if stopped.any() and t + 1 < max_new_tokens:  # at the last position there is nothing to drop
                    lengths[rows[stopped]] = t + 1
                    going = (~stopped).nonzero().squeeze(1)
                    done = len(going) == 0
                    if done:  # one row decodes on, unrecorded, while another rank's rows still go
                        going = going.new_zeros(1)
                    else:  # the rows left fill the places of those that stopped from the end: the fewest move
                        order, n = torch.arange(len(stopped), device=device), len(going)
                        order[stopped[:n].nonzero().squeeze(1)] = going[going >= n]
                        going = order[:n]
                    rows, tokens = rows[going], tokens[going]
                    decoder.keep(going)
            if t + 1 == max_new_tokens or not any_rank(not done):  # one process: its own flag
                break
            logits = decoder.step(tokens)
        model.train(was_training)
        width = int(lengths.max())  # as `generate`: as wide as the longest response
        response, logprobs = response[:, :width], logprobs[:, :width]
        stopped = torch.isin(response.gather(1, (lengths - 1)[:, None]).squeeze(1), stop_ids)
        response_mask = (torch.arange(width, device=device)[None] < lengths[:, None]).float()
        return RolloutBatch(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=response,
            response_mask=response_mask,
            logprobs=logprobs,
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
        )
