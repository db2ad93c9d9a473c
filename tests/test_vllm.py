"""vLLM rollouts (`support/vllm_rollout.py`, `VLLMRollout`) against Hugging Face `generate` on the same weights.

Three launches of tests/dist_workers/vllm_worker.py, each checked by every test below: torchrun
with 2 CPU ranks as one tensor-parallel group (tp2) or as two data-parallel engines (dp2), and
one plain process. Workers run as child processes: vLLM changes process-wide state.
fp32 on CPU: log-probs agree to ~1e-6; LOGPROB_ATOL leaves room for kernel differences only.
"""

import importlib.util

import pytest

from dist_workers.common import run_torchrun

LOGPROB_ATOL = 1e-4
# Looked up, not imported: vLLM changes process-wide state. requirements.txt installs it on Linux only.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (Linux only)")]


@pytest.fixture(scope="module", params=[(2, 2), (2, 1), (0, 1)], ids=["torchrun-tp2", "torchrun-dp2", "single"])
def results(request, tmp_path_factory):
    nproc, tp = request.param
    return run_torchrun("vllm_worker.py", str(tmp_path_factory.mktemp("vllm")), str(tp), nproc=nproc)


def _assert_same_as_hf(r):
    assert r["same_prompts"] and r["same_tokens"] and r["same_mask"]
    assert r["logprob_max_diff"] <= LOGPROB_ATOL
    assert r["finish_reasons"][0] == r["finish_reasons"][1]


def test_vllm_greedy_equals_hf_on_each_rank(results):
    """Under torchrun the engine loads the checkpoint; in one process it starts from random
    ("dummy") weights, refuses to generate, and gets them from the first `sync_weights`."""
    if len(results) == 1:
        assert "sync_weights" in results[0]["generate_before_weights_refused"]
    for rank_result in results:
        _assert_same_as_hf(rank_result["initial"])
    reasons = {f for r in results for f in r["initial"]["finish_reasons"][1]}
    assert reasons == {"stop", "length"}  # both ways of ending were compared


def test_weights_synced_after_update_give_hf_greedy_tokens_and_logprobs(results):
    for rank_result in results:
        _assert_same_as_hf(rank_result["synced"])
        assert rank_result["synced"]["changed_logprob_max"] > 0.1  # the update did change the policy


def test_each_rank_gets_its_own_prompts_back_with_reproducible_sampling(results):
    assert [r["sampled"]["rows"] for r in results] == ([3, 2] if len(results) == 2 else [5])
    for rank_result in results:
        s = rank_result["sampled"]
        assert s["reproducible"] and s["eos_last_when_stop"] and s["padding_zero"]


def test_sampling_logprobs_are_tempered_softmax_of_the_model(results):
    for rank_result in results:
        assert rank_result["sampled"]["tempered_logprob_max_diff"] <= LOGPROB_ATOL
        assert rank_result["sampled"]["dtypes"] == ["torch.float32", "torch.float32"]


def test_bad_requests_raise_value_error_with_a_message(results):
    errors = results[0]["errors"]
    assert "at least one token" in errors["empty_prompt"]
    assert "max_model_len" in errors["too_long"]
    assert "token ids" in errors["out_of_vocab"]
    assert "tensor_parallel_size" in errors["tp_not_dividing_world"]


def test_the_chat_template_warmup_that_fails_for_want_of_a_tokenizer_is_not_printed():
    """vLLM renders a chat once as it starts and, with no tokenizer (skip_tokenizer_init: token ids in
    and out), logs that this failed, with a traceback, for every model whose tokenizer has a chat
    template: a traceback in a run that works. That record is dropped; any other failure is printed."""
    import logging
    import sys

    from support.vllm_rollout import _no_tokenizer_to_warm_up

    def warning(error):
        try:
            raise error
        except ValueError:
            return logging.LogRecord("vllm.renderers.base", logging.WARNING, "base.py", 380,
                                     "Chat template warmup failed", None, sys.exc_info())

    assert not _no_tokenizer_to_warm_up(warning(ValueError("Tokenizer not available when `skip_tokenizer_init=True`")))
    assert _no_tokenizer_to_warm_up(warning(ValueError("expected token 'end of print statement'")))
