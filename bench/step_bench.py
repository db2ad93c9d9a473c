"""PPO update time against the bare forward + backward of the same model on the same tokens.

    python bench/step_bench.py            # prints per-repeat times and, last, `step ratio=<x>`

Both sides run the same micro-batches through the same model (a plain next-token loss for the
reference, the full actor update of train.py for PPO) and end with the same AdamW step, so the
ratio is the overhead of PPO's bookkeeping: log-probs at the rollout temperature, entropy,
clipping, metrics, global-token normalisation. Goal: <= 1.3.
"""

import statistics
import time

import torch
import tyro
from tqdm import tqdm

from support import task
from support.config import Config
from ppo_update import update_model
from rollout import RolloutBatch
from train import actor_loss


def fixed_batch(vocab: int, rows: int, prompt_len: int, response_len: int, seed: int = 0) -> RolloutBatch:
    """Random tokens with ragged response lengths (a quarter of each row may be padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(response_len * 3 // 4, response_len + 1, (rows,), generator=g)
    mask = (torch.arange(response_len) < lengths[:, None]).float()
    return RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (rows, prompt_len), generator=g),
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
        response_ids=torch.randint(3, vocab, (rows, response_len), generator=g) * mask.long(),
        response_mask=mask,
        logprobs=torch.zeros(rows, response_len),
        finish_reasons=["stop"] * rows,
    )


def bare_step(model, optimizer, batch, micro_batch_size):
    """Forward + next-token loss + backward per micro-batch, then one optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    T = batch.response_ids.shape[1]
    for rows in torch.arange(len(batch)).split(micro_batch_size):
        micro = batch.select(rows)
        logits = model(**micro.model_inputs(), logits_to_keep=T + 1, use_cache=False).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro.response_ids.flatten())
        loss.backward()
    optimizer.step()


def main(rows: int = 64, prompt_len: int = 40, response_len: int = 300, micro_batch_size: int = 16,
         repeats: int = 5, threads: int = 2) -> float:
    """Median PPO update time / median bare step time, measured alternately in one run."""
    torch.set_num_threads(threads)
    tokenizer = task.build_tokenizer()
    model = task.make_tiny_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = fixed_batch(len(tokenizer), rows, prompt_len, response_len)
    cfg = Config(ppo_epochs=1, num_minibatches=1, micro_batch_size=micro_batch_size)
    g = torch.Generator().manual_seed(1)
    rows_data = {
        "old_logprobs": -torch.rand(rows, response_len, generator=g) * batch.response_mask,
        "advantages": torch.randn(rows, response_len, generator=g) * batch.response_mask,
    }
    timings = {"bare": [], "ppo": []}
    for _ in tqdm(range(repeats + 1), desc="step bench"):  # the first round warms up
        t0 = time.perf_counter()
        bare_step(model, optimizer, batch, micro_batch_size)
        t1 = time.perf_counter()
        update_model(cfg, model, optimizer, batch, rows_data, actor_loss, seed=0, prefix="actor")
        t2 = time.perf_counter()
        timings["bare"].append(t1 - t0)
        timings["ppo"].append(t2 - t1)
    bare, ppo = (statistics.median(timings[k][1:]) for k in ("bare", "ppo"))
    tokens = int(batch.response_mask.sum()) + rows * prompt_len
    print(f"{rows} rows x ({prompt_len} prompt + <= {response_len} response) tokens = {tokens} tokens, "
          f"micro-batch {micro_batch_size}, {threads} threads, median of {repeats}")
    print(f"bare forward+backward+step: {bare:.3f} s   PPO actor update: {ppo:.3f} s")
    print(f"step ratio={ppo / bare:.2f}")
    return ppo / bare


if __name__ == "__main__":
    tyro.cli(main)
