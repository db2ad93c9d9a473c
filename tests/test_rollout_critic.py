"""The rollout layout (README "Tensor layout") and the critic's reading positions."""

import logging
import re
import shutil

import pytest
import torch

from support import task
from critic import load_value_model, response_values, shift_values, value_outputs
from support.checkpoints import CheckpointError
from ppo import response_logprobs
from ppo_update import assert_finite
import rollout
from rollout import HFRollout, decode_responses, left_pad
from train import policy_forward


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    tokenizer = task.build_tokenizer()
    model = task.make_tiny_model(tokenizer, num_layers=2, intermediate_size=256, seed=0)
    path = tmp_path_factory.mktemp("policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, str(path)


def prompts(tokenizer):
    texts = ["+21=\n", "+73+58+21+49+11=\n", "+10+10=\n"]  # different lengths: left padding matters
    return [tokenizer(t)["input_ids"] for t in texts]


def test_left_pad_puts_padding_first_and_rejects_empty_prompts():
    ids, mask = left_pad([[5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    with pytest.raises(ValueError, match="prompt_ids"):
        left_pad([[5], []], pad_id=0)


def test_sampling_logprobs_equal_recomputed_logprobs_at_the_rollout_temperature(policy):
    model, tokenizer, _ = policy
    engine = HFRollout(model, tokenizer)
    batch = engine.generate(prompts(tokenizer), max_new_tokens=24, temperature=0.7, seed=3)
    with torch.no_grad():
        logits = batch.response_slice(model(**batch.model_inputs()).logits)
    recomputed = response_logprobs(logits, batch.response_ids, temperature=0.7) * batch.response_mask
    assert torch.allclose(recomputed, batch.logprobs, atol=1e-5)


def test_mask_covers_tokens_up_to_and_including_eos_and_padding_is_zero():
    """A sampled rollout that ends both ways: a "stop" response is every token up to and including
    its first EOS (mask 1 there, EOS its last masked token), a "length" one runs to max_new_tokens
    without EOS; after the mask, padding tokens with log-prob 0. tests/dist_workers' tiny actor says
    EOS after a "7" (a random model rarely does), so with this seed both endings and padding occur."""
    from dist_workers.common import PROMPTS, tiny_actor

    tokenizer, model = tiny_actor()
    max_new_tokens = 16
    batch = HFRollout(model, tokenizer).generate(prompts(tokenizer) + [tokenizer(p)["input_ids"] for p in PROMPTS],
                                                 max_new_tokens=max_new_tokens, temperature=1.0, seed=3)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert set(batch.finish_reasons) == {"stop", "length"}
    stopped_early = [r == "stop" and n < max_new_tokens for r, n in zip(batch.finish_reasons, batch.lengths.tolist())]
    assert sum(stopped_early) >= 2 and (batch.response_mask == 0).any()  # padding after an EOS, in several rows
    assert batch.response_ids.shape[1] == max_new_tokens
    for b, (row, length, reason) in enumerate(zip(batch.response_ids, batch.lengths.tolist(), batch.finish_reasons)):
        assert batch.response_mask[b, :length].eq(1).all() and batch.response_mask[b, length:].eq(0).all()
        assert (row[:length - 1] != eos).all()  # no EOS before the last token
        if reason == "stop":
            assert row[length - 1].item() == eos  # the EOS is in the mask
            assert batch.logprobs[b, length - 1] < 0  # and keeps its log-prob
        else:
            assert length == max_new_tokens and row[length - 1].item() != eos
        assert (row[length:] == pad).all()
    assert (batch.logprobs[batch.response_mask == 0] == 0).all()
    assert (batch.logprobs[batch.response_mask == 1] < 0).all()
    assert len(decode_responses(tokenizer, batch)) == len(batch)


def test_same_seed_gives_the_same_rollout_and_leaves_global_rng_alone(policy):
    model, tokenizer, _ = policy
    engine = HFRollout(model, tokenizer)
    state = torch.get_rng_state()
    a = engine.generate(prompts(tokenizer), max_new_tokens=16, seed=7)
    b = engine.generate(prompts(tokenizer), max_new_tokens=16, seed=7)
    c = engine.generate(prompts(tokenizer), max_new_tokens=16, seed=8)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids[:, :5], c.response_ids[:, :5])  # and the seed is what decides
    assert torch.equal(torch.get_rng_state(), state)


def test_each_rank_samples_with_the_seed_plus_its_rank(policy, monkeypatch):
    """Under torchrun rank r draws from seed + r: the ranks' batches differ, and a resumed run replays them."""
    model, tokenizer, _ = policy
    engine = HFRollout(model, tokenizer)
    on_rank_0 = {seed: engine.generate(prompts(tokenizer), max_new_tokens=16, seed=seed).response_ids for seed in (7, 9)}
    monkeypatch.setattr(rollout, "rank", lambda: 2)
    on_rank_2 = engine.generate(prompts(tokenizer), max_new_tokens=16, seed=7).response_ids
    assert torch.equal(on_rank_2, on_rank_0[9])
    assert not torch.equal(on_rank_2, on_rank_0[7])


def test_critic_reads_value_of_s_t_at_the_position_before_token_t(policy):
    """values[b, t] is V(s_t), the critic's output after the prompt and the response's tokens < t:
    checked against a forward of that prefix alone, unpadded, for every token of every row."""
    model, tokenizer, path = policy
    batch = HFRollout(model, tokenizer).generate(prompts(tokenizer), max_new_tokens=12, seed=0)
    critic = load_value_model(path)
    values = response_values(critic, batch)
    for b, prompt in enumerate(prompts(tokenizer)):
        response = batch.response_ids[b].tolist()
        for t in range(int(batch.lengths[b])):
            prefix = torch.tensor([prompt + response[:t]])
            alone = value_outputs(critic, prefix, torch.ones_like(prefix), torch.arange(prefix.shape[1])[None])
            assert values[b, t].item() == pytest.approx(alone[0, -1].item(), abs=1e-5)
    assert (values[batch.response_mask == 0] == 0).all()


def test_critic_from_sft_gets_a_fresh_small_head_and_round_trips(policy, tmp_path):
    _, tokenizer, path = policy
    critic = load_value_model(path, head_init_std=0.01)
    assert critic.score.bias.abs().max() == 0 and critic.score.weight.std() < 0.02
    critic.save_pretrained(tmp_path)
    again = load_value_model(str(tmp_path))  # a saved value model keeps its head
    assert torch.equal(again.score.weight, critic.score.weight)


def test_trim_drops_only_padding_columns_and_keeps_every_real_token(policy):
    """A micro-batch without the batch's longest prompt is trimmed to its own longest prompt: the
    columns dropped are the left pads (prompts are left-padded), never a real prompt token, and the
    outputs at every real response token stay those of the untrimmed rows."""
    model, tokenizer, _ = policy
    texts = prompts(tokenizer)
    batch = HFRollout(model, tokenizer).generate(texts, max_new_tokens=8, temperature=0.7, seed=3)
    rows = batch.select([0, 2])  # row 1 holds the longest prompt
    trimmed = rows.trim()
    assert trimmed.prompt_ids.shape[1] == max(len(texts[0]), len(texts[2])) < batch.prompt_ids.shape[1]
    for b, r in enumerate([0, 2]):
        real = trimmed.prompt_mask[b].bool()
        assert trimmed.prompt_ids[b][real].tolist() == texts[r] and int(real.sum()) == len(texts[r])
    with torch.no_grad():
        before = rows.response_slice(model(**rows.model_inputs()).logits)
        after = trimmed.response_slice(model(**trimmed.model_inputs()).logits)
    T, real = trimmed.response_ids.shape[1], trimmed.response_mask.bool()
    assert torch.allclose(after[real], before[:, :T][real], atol=1e-5)


def test_positions_count_real_tokens_for_a_model_with_learned_positions():
    """GPT-2 adds a learned embedding of each absolute position: a left-padded prompt must start at
    position 0 (model_inputs counts real tokens, as `generate` does), or the recomputed log-probs of
    every padded row differ from the sampling ones. RoPE models (the task's) only see position
    differences, so they cannot tell."""
    import transformers

    tokenizer = task.build_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=2, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=None)).eval()
    batch = HFRollout(model, tokenizer).generate(prompts(tokenizer), max_new_tokens=12, temperature=0.7, seed=3)
    assert (batch.prompt_mask == 0).any()
    with torch.no_grad():
        logits = batch.response_slice(model(**batch.model_inputs()).logits)
    recomputed = response_logprobs(logits, batch.response_ids, temperature=0.7) * batch.response_mask
    assert torch.allclose(recomputed, batch.logprobs, atol=1e-5)


def test_a_gpt2_backbone_gets_its_fresh_head_under_its_own_name(policy, tmp_path, capsys):
    """GPT-2's and GPT-NeoX's token-classification head is `classifier`, not `score`: a critic on
    their backbone stopped with 'no tensor classifier.bias in the checkpoint', as if it were damaged."""
    import transformers

    _, tokenizer, _ = policy
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1,
                                                         n_head=2)).save_pretrained(tmp_path)
    critic = shift_values(load_value_model(str(tmp_path), seed=3), 0.5)
    assert "a fresh value head (classifier.weight, classifier.bias)" in capsys.readouterr().out
    assert (critic.classifier.bias == 0.5).all() and 0 < critic.classifier.weight.std() < 0.03
    ids = torch.tensor([[5, 6, 7]])
    assert value_outputs(critic, ids, torch.ones_like(ids), torch.arange(3)[None]).shape == (1, 3)


def test_actor_and_critic_load_without_dropout_so_the_first_ratio_is_one(policy, tmp_path):
    """GPT-2 has dropout 0.1 in its attention, residual and embedding. PPO's update runs in training
    mode and divides by log-probs taken in eval mode, so with dropout the first mini-batch's ratio
    would not be 1 and the critic would regress on noisy values: both loaders set every dropout of
    the config to 0, and two training-mode forwards give the eval-mode output."""
    import transformers

    from support.checkpoints import load_pretrained

    _, tokenizer, _ = policy
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1,
                                                         n_head=2)).save_pretrained(tmp_path)
    actor = load_pretrained(transformers.AutoModelForCausalLM, str(tmp_path))
    critic = load_value_model(str(tmp_path), seed=3)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for model in actor, critic:
        assert model.config.resid_pdrop == model.config.attn_pdrop == model.config.embd_pdrop == 0.0
        with torch.no_grad():
            eval_out = model.eval()(ids).logits
            train_outs = [model.train()(ids).logits for _ in range(2)]
        assert all(torch.equal(out, eval_out) for out in train_outs)


def test_every_dropout_of_a_config_is_zeroed_nested_ones_and_layer_drops_included():
    """Dropouts go by many names (resid_pdrop, hidden_dropout_prob, decoder_layerdrop, drop_path_rate)
    and some sit in a nested config (MPT's attention config); the other numbers stay as they are."""
    import transformers

    from support.checkpoints import without_dropout

    bart = without_dropout(transformers.BartConfig(dropout=0.1, decoder_layerdrop=0.1, encoder_layerdrop=0.2))
    assert (bart.dropout, bart.decoder_layerdrop, bart.encoder_layerdrop, bart.d_model) == (0.0, 0.0, 0.0, 1024)
    llava = without_dropout(transformers.LlavaConfig(text_config={"model_type": "llama", "attention_dropout": 0.1}))
    assert llava.text_config.attention_dropout == 0.0
    mpt = without_dropout(transformers.MptConfig(resid_pdrop=0.1, emb_pdrop=0.1))  # its attn_pdrop is typed int
    assert (mpt.resid_pdrop, mpt.emb_pdrop, mpt.attn_config.attn_pdrop) == (0.0, 0.0, 0)
    assert without_dropout(transformers.Qwen2Config(attention_dropout=0.2)).attention_dropout == 0.0


def test_assert_finite_names_the_bad_parameter(policy):
    _, _, path = policy
    critic = load_value_model(path)
    with torch.no_grad():
        critic.score.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="score.weight"):
        assert_finite(critic.named_parameters(), "critic")


def full_forward_logprobs(model, batch):
    """log pi(y_t | s_t) at temperature 1 from a forward over the whole sequence."""
    with torch.no_grad():
        logits = batch.response_slice(model(**batch.model_inputs()).logits)
    return response_logprobs(logits, batch.response_ids) * batch.response_mask


def test_a_response_that_stops_keeps_its_eos_as_its_last_masked_token():
    """mask = 1 on every generated token, the EOS included (its log-prob is trained:
    it is how the policy learns to stop). tests/dist_workers' tiny actor emits EOS right after a
    prompt ending in "7" and runs to the length limit otherwise, so both endings occur."""
    from dist_workers.common import PROMPTS, tiny_actor

    tokenizer, model = tiny_actor()
    batch = HFRollout(model, tokenizer).generate([tokenizer(p)["input_ids"] for p in PROMPTS], max_new_tokens=6,
                                                 temperature=0.0)
    eos = tokenizer.eos_token_id
    assert set(batch.finish_reasons) == {"stop", "length"}
    recomputed = full_forward_logprobs(model, batch)
    for b, reason in enumerate(batch.finish_reasons):
        length = int(batch.lengths[b])
        assert batch.response_mask[b, :length].eq(1).all() and batch.response_mask[b, length:].eq(0).all()
        if reason == "stop":
            assert batch.response_ids[b, length - 1].item() == eos and length < 6
            assert batch.logprobs[b, length - 1] < 0  # the EOS's own log-prob is kept
            assert batch.logprobs[b, length - 1] == pytest.approx(recomputed[b, length - 1].item(), abs=1e-5)
        else:
            assert length == 6 and (batch.response_ids[b] != eos).all()


def test_micro_batches_group_rows_of_similar_length():
    """RolloutBatch.micro_batches sorts the requested rows by response length before cutting
    them into micro-batches, so each is padded only to its own longest response."""
    from rollout import RolloutBatch

    lengths = torch.tensor([7, 1, 6, 2, 5, 3])
    mask = (torch.arange(7)[None] < lengths[:, None]).float()
    batch = RolloutBatch(torch.ones(6, 2, dtype=torch.long), torch.ones(6, 2, dtype=torch.long),
                         3 * mask.long(), mask, torch.zeros(6, 7), ["stop"] * 6)
    micro = list(batch.micro_batches(torch.tensor([0, 1, 2, 3, 4]), 2))
    assert [rows.tolist() for rows, _ in micro] == [[1, 3], [4, 2], [0]]
    assert [m.response_ids.shape[1] for _, m in micro] == [2, 6, 7]


def test_rollout_batch_moves_every_tensor_to_the_trainers_device():
    """vLLM builds its batch on the CPU; the trainer's models may sit on a GPU (here: "meta")."""
    from rollout import RolloutBatch

    ones = torch.ones(2, 3)
    batch = RolloutBatch(ones.long(), ones.long(), ones.long(), ones, ones, ["stop", "length"])
    moved = batch.to("meta")
    assert all(getattr(moved, name).device.type == "meta"
               for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs"))
    assert moved.finish_reasons == batch.finish_reasons and batch.response_mask.device.type == "cpu"


def test_micro_batches_fill_a_token_budget_and_match_other_ranks_counts(monkeypatch):
    """With max_tokens: runs of length-sorted rows whose rows x (longest prompt + longest response)
    fit the budget (a longer row alone); a rank told that another has more runs splits its fullest."""
    from rollout import RolloutBatch
    import rollout

    lengths = torch.tensor([7, 1, 6, 2, 5, 3, 30])
    mask = (torch.arange(30)[None] < lengths[:, None]).float()
    prompt_mask = torch.ones(7, 2, dtype=torch.long)
    batch = RolloutBatch(prompt_mask, prompt_mask, 3 * mask.long(), mask, torch.zeros(7, 30), ["stop"] * 7)
    micro = list(batch.micro_batches(torch.arange(7), 1, max_tokens=20))
    assert [rows.tolist() for rows, _ in micro] == [[1, 3, 5], [4, 2], [0], [6]]  # 3x5, 2x8, 1x9, 1x32
    assert all(m.response_ids.numel() <= 20 or len(m) == 1 for _, m in micro)
    monkeypatch.setattr(rollout, "all_reduce", lambda x, op=None: x.fill_(6.0))  # another rank has 6 runs
    micro = list(batch.micro_batches(torch.arange(7), 1, max_tokens=20))
    assert sorted(len(rows) for rows, _ in micro) == [1, 1, 1, 1, 1, 2]
    assert sorted(r for rows, _ in micro for r in rows.tolist()) == list(range(7))


def test_a_fresh_value_head_is_said_in_one_line_and_any_other_missing_tensor_stops(policy, tmp_path, capsys):
    """transformers' red LOAD REPORT table ("score.weight MISSING") is expected for the critic
    made from pi_SFT and said in one line; a checkpoint missing anything else stops with its name
    (as the sharded loader does), instead of training a randomly initialised tensor."""
    from safetensors.torch import load_file, save_file

    reports = []
    handler = logging.Handler()
    handler.emit = lambda record: reports.append(record.getMessage())
    logging.getLogger("transformers.modeling_utils").addHandler(handler)
    try:
        _, _, path = policy
        load_value_model(path)
        assert not [r for r in reports if "LOAD REPORT" in r]
        assert f"critic: a fresh value head (score.weight, score.bias) on the backbone of {path}" in capsys.readouterr().out
        shutil.copytree(path, tmp_path / "broken", dirs_exist_ok=True)
        weights = load_file(str(tmp_path / "broken" / "model.safetensors"))
        lost = next(k for k in weights if "mlp.up_proj" in k)
        del weights[lost]
        save_file(weights, str(tmp_path / "broken" / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=f"no tensor {re.escape(lost)} in the checkpoint"):
            load_value_model(str(tmp_path / "broken"))
        assert "fresh value head" not in capsys.readouterr().out
    finally:
        logging.getLogger("transformers.modeling_utils").removeHandler(handler)


def test_without_left_padding_the_mask_is_dropped_and_real_tokens_keep_their_outputs(policy):
    """Prompts of one length (the built-in task's): only responses are padded, on the right, so
    model_inputs passes no mask (SDPA's causal path) and every real token's log-prob is what the
    padding mask gives; prompts of several lengths keep the mask (their pads come first)."""
    model, tokenizer, _ = policy
    engine = HFRollout(model, tokenizer)
    same_length = [tokenizer(t)["input_ids"] for t in ["+21=\n", "+73=\n", "+10=\n", "+55=\n"]]
    batch = engine.generate(same_length, max_new_tokens=24, seed=5)
    for row, length in ((0, 7), (2, 15)):  # two responses end early (a random model rarely says EOS)
        batch.response_mask[row, length:] = 0
        batch.response_ids[row, length:] = tokenizer.pad_token_id
    inputs = batch.model_inputs()
    assert inputs["attention_mask"] is None
    masked = {**inputs, "attention_mask": torch.cat([batch.prompt_mask, batch.response_mask.long()], 1)}
    with torch.no_grad():
        causal = batch.response_slice(model(**inputs).logits)
        reference = batch.response_slice(model(**masked).logits)
    real = batch.response_mask.bool()
    assert torch.allclose(causal[real], reference[real], atol=1e-6)
    assert engine.generate(prompts(tokenizer), max_new_tokens=4, seed=5).model_inputs()["attention_mask"] is not None


def test_scoring_and_training_forwards_build_no_kv_cache(policy):
    """Log-probs (whole logits or from hidden states) and values, in eval mode as the old
    log-probs and values are computed: no KV cache is built (nothing generates after these
    forwards; a compiled decoder layer would recompile for each state of one)."""
    model, tokenizer, path = policy
    batch = HFRollout(model, tokenizer).generate(prompts(tokenizer), max_new_tokens=6, seed=0)
    critic = load_value_model(path)
    caches = []
    hooks = [m.base_model.register_forward_hook(lambda _m, _i, out: caches.append(out.past_key_values))
             for m in (model, critic)]
    try:
        policy_forward(model.eval(), batch, 1.0)
        policy_forward(model, batch, 1.0, with_entropy=True, chunk_tokens=5)
        response_values(critic.eval(), batch)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(caches) == 3 and all(cache is None for cache in caches)


def _cut_short(batch, tokenizer, lengths=(3, None, 5)):
    """Rows of `batch` cut to `lengths` (None: as generated): a random model rarely says EOS, so a
    generated batch may hold no padding at all."""
    for row, length in enumerate(lengths):
        if length is not None:
            batch.response_mask[row, length:] = 0
            batch.response_ids[row, length:] = tokenizer.pad_token_id
    return batch


def test_critic_values_are_exactly_zero_on_the_padding_of_shorter_responses(policy):
    """response_values promises V = 0 on padding (the old values PPO stores and clips around); the
    head's outputs there are not 0, so only the response mask makes them so."""
    model, tokenizer, path = policy
    batch = _cut_short(HFRollout(model, tokenizer).generate(prompts(tokenizer), max_new_tokens=8, seed=0), tokenizer)
    critic = load_value_model(path)
    padding = batch.response_mask == 0
    with torch.no_grad():
        values = response_values(critic, batch)
        raw = batch.response_slice(value_outputs(critic, **batch.model_inputs()))
    assert padding.sum() >= 8 and (raw[padding] != 0).all()  # the test has padding the head does not zero
    assert torch.equal(values[padding], torch.zeros_like(values[padding]))


def test_a_fresh_value_head_is_drawn_from_its_seed(policy):
    """load_value_model's seed gives the fresh head: the same seed the same head (every rank, a
    resumed run), another seed another head (runs of other --seed start from other critics)."""
    _, _, path = policy
    one, again, other = (load_value_model(path, seed=s).score.weight for s in (1, 1, 2))
    assert torch.equal(one, again) and not torch.equal(one, other)


def test_an_offset_moves_every_value_of_a_trained_head_by_exactly_that_much(policy):
    """--critic-init-offset adds to the head's bias, whatever it holds: an ORM's bias is not 0, so
    setting the bias to the offset would move the values by some other amount."""
    model, tokenizer, path = policy
    batch = HFRollout(model, tokenizer).generate(prompts(tokenizer), max_new_tokens=6, seed=0)
    critic = load_value_model(path)
    with torch.no_grad():
        critic.score.bias.fill_(0.3)  # as a trained reward model's head holds
        before = response_values(critic, batch)
        after = response_values(shift_values(critic, 0.5), batch)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(after[mask], before[mask] + 0.5)
    assert torch.allclose(critic.score.bias, torch.tensor(0.8))


def test_critic_loss_regresses_the_values_onto_the_returns_and_clips_around_the_old_values(policy):
    """Eq. (2) through critic_loss: with the returns equal to the critic's own values there is nothing to
    learn without clipping; with old values 1 above, a clip of 0.2 holds the clipped value 0.8 above the
    return, and max() takes that branch: 0.5 * 0.8^2 on every token."""
    from types import SimpleNamespace

    from critic import critic_loss

    model, tokenizer, path = policy
    batch = HFRollout(model, tokenizer).generate(prompts(tokenizer), max_new_tokens=6, seed=0)
    critic = load_value_model(path)
    with torch.no_grad():
        values = response_values(critic, batch)
    per_token = {"returns": values, "old_values": (values + 1.0) * batch.response_mask}
    cfg = SimpleNamespace(loss_agg="token-mean")
    plain, _ = critic_loss(critic, batch, per_token, None, cfg)
    clipped, metrics = critic_loss(critic, batch, per_token, None, cfg, clip=0.2)
    assert plain.item() == pytest.approx(0.0, abs=1e-10)
    assert clipped.item() == pytest.approx(0.5 * 0.8 ** 2, rel=1e-5) and metrics["vf_clipfrac"].item() == 1.0


def test_a_token_budget_counts_the_widest_prompt_of_the_run_and_keeps_a_run_that_fills_it_exactly():
    """A micro-batch is padded to its widest prompt plus its longest response, so a run's size is
    rows x (widest prompt of any of its rows + the last row's response), not the last row's prompt.
    Prompts 6, 1, 4, 1, 1 and responses 1, 2, 3, 3, 3 in a budget of 16: 2 x (6 + 2) = 16 fits
    exactly; a third row makes 3 x (6 + 3); then 2 x (4 + 3) = 14 fits and 3 x (4 + 3) does not."""
    from rollout import RolloutBatch

    prompts, lengths = torch.tensor([6, 1, 4, 1, 1]), torch.tensor([1, 2, 3, 3, 3])
    prompt_mask = (torch.arange(6)[None] >= 6 - prompts[:, None]).long()  # left-padded
    mask = (torch.arange(3)[None] < lengths[:, None]).float()
    batch = RolloutBatch(5 * prompt_mask, prompt_mask, 3 * mask.long(), mask, torch.zeros(5, 3), ["stop"] * 5)
    micro = list(batch.micro_batches(torch.arange(5), 1, max_tokens=16))
    assert [rows.tolist() for rows, _ in micro] == [[0, 1], [2, 3], [4]]
    assert [len(m) * (m.prompt_ids.shape[1] + m.response_ids.shape[1]) for _, m in micro] == [16, 14, 4]


def test_select_keeps_each_rows_finish_reason_with_its_tensors():
    """select picks the finish reasons ("length": cut off at max_new_tokens) of the rows it picks,
    in their order, for a list of row numbers as for a slice."""
    import dataclasses

    from test_ppo import synthetic_rollout

    batch = dataclasses.replace(synthetic_rollout([3, 1, 2]), finish_reasons=["length", "stop", "stop"])
    picked = batch.select([2, 0])
    assert picked.lengths.tolist() == [2, 3] and picked.finish_reasons == ["stop", "length"]
    assert picked.truncated == [False, True]
    assert batch.select(slice(1, None)).finish_reasons == ["stop", "stop"]
