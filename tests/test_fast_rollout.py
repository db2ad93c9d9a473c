"""fast_rollout.py: its decode steps are the model's forward, its samples follow `generate`'s
distribution, and its batches keep HFRollout's layout, log-probs and seeded replay."""

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from support import task
from dist_workers.common import tiny_actor
from support.fast_rollout import Decoder, FastHFRollout
from ppo import response_logprobs
from rollout import HFRollout, left_pad

PROMPTS = ["+21=\n", "+73+58+21+49+11=\n", "+10+10=\n"]  # different lengths: left padding matters


@pytest.fixture(scope="module")
def policy():
    tokenizer = task.build_tokenizer()
    return task.make_tiny_model(tokenizer, num_layers=2, intermediate_size=256, seed=0).eval(), tokenizer


def test_decode_steps_give_the_logits_of_model_forward_also_after_rows_are_dropped(policy):
    model, tokenizer = policy
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in PROMPTS], tokenizer.pad_token_id)
    forced = torch.randint(3, len(tokenizer), (len(PROMPTS), 6), generator=torch.Generator().manual_seed(0))
    full_mask = torch.cat([mask, torch.ones_like(forced)], 1)
    with torch.no_grad():
        reference = model(input_ids=torch.cat([ids, forced], 1), attention_mask=full_mask,
                          position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, ids.shape[1] - 1 : -1]
        decoder = Decoder(model, ids, mask, max_new_tokens=6)
        steps, rows = [decoder.logits], torch.arange(len(PROMPTS))
        for t in range(5):
            if t == 2:  # row 1 stops: the others go on without it
                rows = torch.tensor([0, 2])
                decoder.keep(torch.tensor([0, 2]))
                assert torch.equal(decoder.logits, steps[-1][[0, 2]])  # the last logits of the rows kept
            steps.append(torch.zeros_like(steps[0]).index_copy(0, rows, decoder.step(forced[rows, t])))
    logits = torch.stack(steps, 1)
    assert torch.allclose(logits[[0, 2]], reference[[0, 2]], atol=1e-4)
    assert torch.allclose(logits[1, :3], reference[1, :3], atol=1e-4)
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back


def test_greedy_responses_are_generates_and_sampled_logprobs_are_the_models(policy):
    model, tokenizer = policy
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    fast, reference = FastHFRollout(model, tokenizer).generate(prompts, 30, temperature=0), \
        HFRollout(model, tokenizer).generate(prompts, 30, temperature=0)
    assert torch.equal(fast.response_ids, reference.response_ids)
    assert torch.allclose(fast.logprobs, reference.logprobs, atol=1e-5)
    batch = FastHFRollout(model, tokenizer).generate(prompts, 40, temperature=0.7, top_p=0.9, seed=3)
    assert set(batch.finish_reasons) == {"stop", "length"}  # rows were dropped mid-way
    eos = tokenizer.eos_token_id
    for row, length, reason in zip(batch.response_ids, batch.lengths, batch.finish_reasons):
        assert (row[: length - 1] != eos).all() and (row[length:] == tokenizer.pad_token_id).all()
        assert reason == ("stop" if row[length - 1] == eos else "length")
    assert batch.response_ids.shape[1] == int(batch.lengths.max())
    with torch.no_grad():
        logits = batch.response_slice(model(**batch.model_inputs()).logits)
    recomputed = response_logprobs(logits, batch.response_ids, temperature=0.7) * batch.response_mask
    assert torch.allclose(recomputed, batch.logprobs, atol=1e-5)


def test_same_seed_gives_the_same_batch_and_leaves_the_global_rng_alone(policy):
    model, tokenizer = policy
    engine, prompts = FastHFRollout(model, tokenizer), [tokenizer(t)["input_ids"] for t in PROMPTS] * 4
    state = torch.get_rng_state()
    a, b, c = (engine.generate(prompts, 24, top_p=0.9, seed=s) for s in (7, 7, 8))
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert a.finish_reasons == b.finish_reasons and not torch.equal(a.response_ids[:, :5], c.response_ids[:, :5])


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square homogeneity test of two samples' category counts; categories expected
    fewer than 5 times in either sample are pooled. The p-value of the statistic."""
    n_a, n_b = sum(a.values()), sum(b.values())
    pooled, small = [], [0, 0]
    for key in set(a) | set(b):
        expected = (a[key] + b[key]) * min(n_a, n_b) / (n_a + n_b)
        if expected < 5:
            small = [small[0] + a[key], small[1] + b[key]]
        else:
            pooled.append((a[key], b[key]))
    pooled += [tuple(small)] if sum(small) else []
    stat = sum((x * math.sqrt(n_b / n_a) - y * math.sqrt(n_a / n_b)) ** 2 / (x + y) for x, y in pooled)
    return torch.special.gammaincc(torch.tensor((len(pooled) - 1) / 2), torch.tensor(stat / 2)).item()


def test_samples_follow_the_distribution_of_generates():
    """2,000 responses from each engine (independent seeds) on a tiny model made confident enough
    that top-p drops real mass and EOS ends ~10% of the responses within 8 tokens. Their first
    tokens, fourth tokens (pad once stopped) and lengths must pass a chi-square homogeneity test at
    p > 0.001 each: a correct sampler fails one of the three at most 0.3% of the time, while a
    sampler off by a tenth of the probability mass gives p < 1e-6 at this size (chi-square ~ 50+)."""
    tokenizer, model = tiny_actor()
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # sharper next-token distributions than at initialisation
    prompts = [tokenizer("+17+4=\n")["input_ids"], tokenizer("+3=\n")["input_ids"]] * 1000
    samples = [engine(model, tokenizer).generate(prompts, 8, temperature=0.8, top_p=0.9, seed=seed)
               for engine, seed in ((HFRollout, 0), (FastHFRollout, 1))]
    for column in (lambda b: b.response_ids[:, 0], lambda b: b.response_ids[:, 3], lambda b: b.lengths):
        fast, reference = (Counter(column(b).tolist()) for b in samples)
        assert chi_square_p(fast, reference) > 1e-3


def test_no_query_of_a_left_padded_prompt_masks_every_key(policy, monkeypatch):
    """A left pad's row of the prompt's mask was all -inf: SDPA gives 0 there on the CPU, but GPU
    kernels have given NaN for such rows (pytorch/pytorch#110213), which the next layer's values then
    carry to the real tokens. Checked on the mask, as the CPU cannot show the NaN."""
    model, tokenizer = policy
    masks, forward = [], Decoder._forward
    monkeypatch.setattr(Decoder, "_forward", lambda self, ids, mask, pos: masks.append(mask) or forward(self, ids, mask, pos))
    ids, mask = left_pad([tokenizer(t)["input_ids"] for t in PROMPTS], tokenizer.pad_token_id)
    with torch.no_grad():
        Decoder(model, ids, mask, max_new_tokens=2)
    assert (mask == 0).any() and torch.isfinite(masks[0]).any(-1).all()


@pytest.mark.parametrize("architecture", ["Llama", "GPT2"])
def test_other_model_families_decode_with_their_causal_and_padding_masks_as_generate(policy, architecture):
    """Llama (unlike Qwen2) builds its masks from whatever it is passed: given the {layer type: mask}
    mapping, it found no mask function for the registered attention and attended to every position,
    future and padding ones included (greedy tokens differed even for one unpadded prompt); GPT-2
    (learned positions) failed at the first step. Llama's 4 query heads share 2 key/value heads: with one
    (the tiny Qwen2's) SDPA broadcasts it to every head, so attention without `enable_gqa` went unseen."""
    import transformers

    _, tokenizer = policy
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            **ids)) if architecture == "Llama" else
            transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, **ids))).eval()
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    fast, reference = FastHFRollout(model, tokenizer).generate(prompts, 12, temperature=0), \
        HFRollout(model, tokenizer).generate(prompts, 12, temperature=0)
    assert torch.equal(fast.response_ids, reference.response_ids)
    assert torch.allclose(fast.logprobs, reference.logprobs, atol=1e-5)


def test_a_model_that_builds_its_own_masks_is_refused_at_start_with_the_flag_to_use(policy):
    """A forward (remote code, say) that makes its own mask instead of the one hf-fast gives it would
    sample from other logits than the model's, in silence: one watched forward at start refuses it."""
    import train
    from support.config import Config, ConfigError

    model, tokenizer = policy

    class OwnMasks(type(model)):
        def forward(self, *args, attention_mask=None, **kwargs):
            return super().forward(*args, attention_mask=None, **kwargs)

    own = OwnMasks(model.config).eval()
    with pytest.raises(ConfigError, match="OwnMasks builds its own: use --rollout hf"):
        train.build_engine(Config(), own, "unused", tokenizer)
    assert isinstance(train.build_engine(Config(rollout="hf"), own, "unused", tokenizer), HFRollout)


def test_running_out_of_memory_in_the_start_up_probe_is_said_as_such(policy):
    """An out-of-memory error is a RuntimeError, which the probe reads as a forward that takes no 4D
    mask: it told the user to change the sampler, for a fault of memory."""
    model, tokenizer = policy

    class NoMemory(type(model)):
        def forward(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        FastHFRollout(NoMemory(model.config).eval(), tokenizer)


def test_a_forward_that_fails_on_a_4d_mask_is_refused_with_the_flag_to_use_not_a_traceback(policy):
    """A forward (remote code, say) that reshapes the mask it is given as a 2D padding mask fails
    with a RuntimeError on the probe's 4D one: a model hf-fast cannot decode, said as such."""
    model, tokenizer = policy

    class TwoDimensionalMask(type(model)):
        def forward(self, *args, attention_mask=None, **kwargs):
            attention_mask = attention_mask.view(attention_mask.shape[0], -1, 2)  # a 2D mask's reshape
            return super().forward(*args, attention_mask=attention_mask, **kwargs)

    with pytest.raises(ValueError, match="TwoDimensionalMask builds its own: use --rollout hf"):
        FastHFRollout(TwoDimensionalMask(model.config).eval(), tokenizer)


FSDP2_MIXED_PRECISION = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from support import task
from support.fast_rollout import FastHFRollout
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
tokenizer = task.build_tokenizer()
model = task.make_tiny_model(tokenizer, num_layers=2, intermediate_size=256, seed=0).eval()
options = dict(mesh=init_device_mesh("cpu", (1,)), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
for layer in model.model.layers:
    fully_shard(layer, **options)
fully_shard(model, **options)
batch = FastHFRollout(model, tokenizer).generate([tokenizer("+21=\\n")["input_ids"]], 4, temperature=0)
print("decoded", batch.response_ids.shape[1])
"""


@pytest.mark.slow
def test_fsdp2_mixed_precision_is_decoded_not_refused(tmp_path):
    """FSDP2 with mixed precision (the GPU presets' setting) casts the forward's floating inputs to bf16:
    the attention is handed a copy of the start-up probe's mask, not the mask itself, which an identity
    check took for a model that builds its own masks, refusing hf-fast under every such torchrun."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(task.__file__).parents[1]), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", FSDP2_MIXED_PRECISION, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "decoded" in done.stdout, done.stderr[-2000:]


def test_a_model_with_sliding_window_layers_is_refused_at_start_with_the_flag_to_use():
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    import train
    from support.config import Config, ConfigError

    tokenizer, model = tiny_actor()
    config = Qwen2Config(**{**model.config.to_dict(), "use_sliding_window": True, "sliding_window": 8,
                            "layer_types": ["full_attention", "sliding_attention"]})
    with pytest.raises(ConfigError, match="sliding_attention layers: use --rollout hf"):
        train.build_engine(Config(), Qwen2ForCausalLM(config), "unused", tokenizer)
    # Mistral's config has no layer_types: its sliding_window (Mistral-7B-v0.1's 4096) is every layer's
    mistral = MistralConfig(**{k: v for k, v in config.to_dict().items() if k not in ("layer_types", "model_type")})
    with pytest.raises(ConfigError, match="sliding_attention layers: use --rollout hf"):
        train.build_engine(Config(), MistralForCausalLM(mistral), "unused", tokenizer)
    # A config without the field nor a window (Llama's) has full attention only: decoded
    llama = LlamaConfig(**{k: v for k, v in config.to_dict().items()
                           if k not in ("layer_types", "model_type", "sliding_window", "use_sliding_window")})
    assert not hasattr(llama, "layer_types")
    assert isinstance(train.build_engine(Config(), LlamaForCausalLM(llama), "unused", tokenizer), FastHFRollout)


@pytest.mark.parametrize("engine", [HFRollout, FastHFRollout])
def test_a_checkpoints_own_sampling_defaults_are_not_applied(policy, engine):
    # A generation_config.json like Qwen2.5-Instruct's sets a repetition penalty and top-k; generate applies
    # such defaults to whatever it is not told, and its samples would no longer follow the log-probs.
    model, tokenizer = policy
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    plain = engine(model, tokenizer).generate(prompts, 30, temperature=0)
    saved = model.generation_config
    model.generation_config = type(saved)(**{**saved.to_dict(), "repetition_penalty": 100.0, "no_repeat_ngram_size": 1})
    try:
        defaults = model.generation_config
        assert any(len(set(row.tolist())) < len(row) for row in plain.response_ids)  # the penalty would matter
        greedy = engine(model, tokenizer).generate(prompts, 30, temperature=0)
        assert model.generation_config is defaults and defaults.repetition_penalty == 100.0  # left as it was
    finally:
        model.generation_config = saved
    assert torch.equal(greedy.response_ids, plain.response_ids)


@pytest.mark.parametrize("engine", [HFRollout, FastHFRollout])
def test_without_a_seed_calls_differ_and_torch_manual_seed_repeats_them(policy, engine):
    model, tokenizer = policy
    sampler, prompts = engine(model, tokenizer), [tokenizer(t)["input_ids"] for t in PROMPTS] * 4
    torch.manual_seed(0)
    first, second = sampler.generate(prompts, 16), sampler.generate(prompts, 16)
    torch.manual_seed(0)
    again = sampler.generate(prompts, 16)
    assert torch.equal(again.response_ids, first.response_ids)
    assert first.response_ids.shape != second.response_ids.shape or not torch.equal(first.response_ids, second.response_ids)


@pytest.mark.parametrize("engine", [HFRollout, FastHFRollout])
@pytest.mark.parametrize("temperature, top_p", [(-0.5, 1.0), (float("nan"), 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_sampling_settings_out_of_range_are_refused(policy, engine, temperature, top_p):
    model, tokenizer = policy
    with pytest.raises(ValueError, match="temperature must be >= 0 and top_p in"):
        engine(model, tokenizer).generate([tokenizer("+21=\n")["input_ids"]], 4, temperature=temperature, top_p=top_p)


@pytest.mark.parametrize("engine", [HFRollout, FastHFRollout])
def test_every_end_token_the_checkpoint_lists_stops_a_response(engine):
    """Chat models list several end tokens in generation_config.json (Qwen2.5-Instruct: <|im_end|> and
    <|endoftext|>); only the tokenizer's EOS stopped a response, so rows ran on past the others and
    were scored as cut. tiny_actor stops greedily with "<eos>" after a "7"; here the tokenizer's EOS
    is "<unk>" and "<eos>" is only listed by the checkpoint."""
    tokenizer, model = tiny_actor()
    prompts = [tokenizer(t)["input_ids"] for t in ["+17+7", "+40+47", "+1+2=\n"]]
    eos = tokenizer.eos_token_id
    listed = engine(model, tokenizer).generate(prompts, 24, temperature=0)
    tokenizer.eos_token = "<unk>"
    model.generation_config.eos_token_id = [tokenizer.unk_token_id, eos]
    assert engine(model, tokenizer).stop_ids == [tokenizer.unk_token_id, eos]
    batch = engine(model, tokenizer).generate(prompts, 24, temperature=0)
    assert torch.equal(batch.response_ids, listed.response_ids) and batch.finish_reasons == listed.finish_reasons
    assert batch.finish_reasons == ["stop", "stop", "length"]
    model.generation_config.eos_token_id = tokenizer.unk_token_id  # listed no more: the rows run to the end
    assert engine(model, tokenizer).generate(prompts, 24, temperature=0).finish_reasons == ["length"] * 3


@pytest.mark.parametrize("engine", [HFRollout, FastHFRollout])
def test_a_response_whose_end_token_is_its_last_allowed_token_has_stopped(engine):
    """A response that draws its end token exactly at position max_new_tokens ended by EOS: finish
    "stop", not "length" (which would score it as cut, with the truncation reward). tiny_actor
    stops greedily after a "7"; each stopping row is rerun with max_new_tokens = its own length."""
    tokenizer, model = tiny_actor()
    prompts = [tokenizer(t)["input_ids"] for t in ["+17+7", "+40+47", "+1+2=\n"]]
    free = engine(model, tokenizer).generate(prompts, 24, temperature=0)
    assert free.finish_reasons == ["stop", "stop", "length"]
    for row in (0, 1):
        length = int(free.lengths[row])
        tight = engine(model, tokenizer).generate([prompts[row], prompts[2]], length, temperature=0)
        assert tight.finish_reasons == ["stop", "length"] and tight.lengths.tolist() == [length, length]
        assert torch.equal(tight.response_ids[0], free.response_ids[row, :length])
        assert tight.response_ids[0, -1].item() == tokenizer.eos_token_id


def test_top_p_keeps_the_nucleus_of_transformers_top_p_warper_and_always_the_most_likely_token():
    """sample_tokens' top-p is TopPLogitsWarper's: the least likely tokens whose mass is <= 1 - top_p are
    never drawn, and the most likely token always stays (a top_p far below its probability keeps it
    alone instead of masking every token). Thousands of draws of one distribution."""
    from transformers import TopPLogitsWarper

    from support.fast_rollout import sample_tokens

    logits = torch.tensor([0.30, 0.33, 0.37]).log().repeat(4000, 1)
    generator = torch.Generator().manual_seed(0)
    for top_p in (0.5, 0.8, 1e-9):  # 1 - 1e-9 is 1.0 in float32: every token's mass is <= it
        kept = torch.isfinite(TopPLogitsWarper(top_p)(None, logits[:1].clone())[0]).nonzero().squeeze(1).tolist()
        tokens, logprobs = sample_tokens(logits, 1.0, top_p, generator)
        assert sorted(set(tokens.tolist())) == kept, top_p
        assert torch.allclose(logprobs, logits[0].log_softmax(-1)[tokens])  # of the untruncated distribution
    assert kept == [2]


def test_a_token_whose_mass_is_exactly_the_top_p_remainder_is_dropped_as_transformers_does():
    """TopPLogitsWarper drops the least likely tokens whose total mass is <= 1 - top_p, the boundary
    included. Four equally likely tokens (exactly 0.25 each in float32) and top_p 0.5: the two least
    likely sum to exactly 0.5, so two tokens are kept, not three (a strict < keeps three)."""
    from transformers import TopPLogitsWarper

    from support.fast_rollout import sample_tokens

    logits = torch.zeros(4000, 4)
    kept = torch.isfinite(TopPLogitsWarper(0.5)(None, logits[:1].clone())[0]).sum().item()
    tokens, _ = sample_tokens(logits, 1.0, 0.5, torch.Generator().manual_seed(0))
    assert kept == 2 and len(set(tokens.tolist())) == kept


@pytest.mark.parametrize("engine", [HFRollout, FastHFRollout])
def test_a_model_in_training_mode_samples_without_dropout_and_is_left_in_training_mode(engine):
    """Rollouts sample from the model in eval mode (dropout off: the log-probs are the deterministic
    policy's, which PPO recomputes) and hand it back as they found it, in training mode for the update.
    Attention dropout of 0.5 makes any forward in training mode visibly different."""
    tokenizer, model = tiny_actor()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    prompts = [tokenizer(t)["input_ids"] for t in PROMPTS]
    expected = engine(model.eval(), tokenizer).generate(prompts, 12, temperature=0)
    model.train()
    torch.manual_seed(0)  # the dropout draws, were they made
    batch = engine(model, tokenizer).generate(prompts, 12, temperature=0)
    assert model.training
    assert torch.equal(batch.response_ids, expected.response_ids)
    assert torch.allclose(batch.logprobs, expected.logprobs, atol=1e-5)


def test_decoding_stops_when_every_row_has_stopped_unless_another_rank_still_decodes(monkeypatch):
    """Alone, the loop runs no forward after its last row stops (width - 1 steps after the prompt's).
    When another rank's rows still go (any_rank says so), FSDP's all-gathers must pair up: this rank
    steps on to max_new_tokens with one row, unrecorded, and its batch is the one it decodes alone.
    tiny_actor stops greedily after a "7"; both prompts stop well within 24 tokens."""
    from support import fast_rollout

    tokenizer, model = tiny_actor()
    prompts = [tokenizer(t)["input_ids"] for t in ["+17+7", "+40+47"]]
    rows, step = [], fast_rollout.Decoder.step
    monkeypatch.setattr(fast_rollout.Decoder, "step", lambda self, tokens: rows.append(len(tokens)) or step(self, tokens))
    alone = FastHFRollout(model, tokenizer).generate(prompts, 24, temperature=0)
    assert alone.finish_reasons == ["stop", "stop"] and alone.response_ids.shape[1] < 24
    assert len(rows) == alone.response_ids.shape[1] - 1
    rows.clear()
    monkeypatch.setattr(fast_rollout, "any_rank", lambda flag: True)
    synced = FastHFRollout(model, tokenizer).generate(prompts, 24, temperature=0)
    assert len(rows) == 23 and min(rows) == 1
    for name in ("response_ids", "response_mask", "logprobs"):
        assert torch.equal(getattr(synced, name), getattr(alone, name))
    assert synced.finish_reasons == alone.finish_reasons


@pytest.mark.parametrize("layer_1", ["makes its own mask", "attends by its own function"])
def test_a_model_one_layer_of_which_ignores_the_mask_given_is_refused_at_start(layer_1):
    """The start-up probe checks every layer: one layer that builds its own 4D mask (of the shape of
    the probe's, which a one-token causal mask has) or attends by a function of its own (here the
    model's own SDPA, not the registered attention) would sample from other logits, though the
    layer before it takes the mask as given."""
    tokenizer, model = tiny_actor()
    attention = model.model.layers[1].self_attn
    forward = attention.forward

    def own(*args, **kwargs):
        if layer_1 == "makes its own mask":
            return forward(*args, **{**kwargs, "attention_mask": torch.zeros_like(kwargs["attention_mask"])})
        before, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
        try:
            return forward(*args, **kwargs)
        finally:
            model.config._attn_implementation = before

    attention.forward = own
    with pytest.raises(ValueError, match="builds its own: use --rollout hf"):
        FastHFRollout(model.eval(), tokenizer)
    attention.forward = forward  # the same model, every layer given the mask: accepted
    FastHFRollout(model, tokenizer)


def test_max_new_tokens_below_one_is_refused_with_its_name(policy):
    model, tokenizer = policy
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        FastHFRollout(model, tokenizer).generate([tokenizer("+21=\n")["input_ids"]], 0)


def test_a_model_with_layers_of_any_attention_but_full_is_refused_at_start():
    """hf-fast's cache and masks are full attention's: not only sliding-window layers but any other
    kind a config lists (Llama 4's chunked attention, say) would be decoded as full attention."""
    tokenizer, model = tiny_actor()
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="this model has chunked_attention layers: use --rollout hf"):
        FastHFRollout(model.eval(), tokenizer)
