"""Rewards (paper §4 setup): the rule-based verifier, the outcome reward model, pass@k.

- `rule_reward`: +1 if the last `\\boxed{}` / `\\fbox{}` of the response is mathematically equivalent
  to the ground truth (math-verify), else -1. The paper's only training reward.
- `Grader`: the same verdict for a batch, in worker processes with a hard per-item timeout, because
  math-verify can hang (its own timeout is signal-based, main-thread only, and cannot interrupt
  C-level big-integer arithmetic such as `9^{9^{9^{9}}}`).
- `train_orm` / `orm_scores`: the outcome reward model (ORM) that plain PPO initialises its critic
  from (§3.1): a backbone + scalar head (`critic.py`) regressed onto +-1 at the last token only.
- `pass_at_k`: the unbiased pass@k estimator used in evaluation.

torch is imported inside the ORM functions only: grader workers import this module and stay light.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections import deque
from functools import lru_cache
from multiprocessing.connection import Connection, Pipe, wait

# math-verify warns once that its timeout is disabled; the Grader's process timeout replaces it.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_PLAIN_INT = re.compile(r"-?\d{1,50}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` (nested braces allowed), or None.

    A last box that never closes (a truncated response) or is empty counts as no answer: an earlier
    box was not the final answer either.
    """
    opens = list(_BOX_OPEN.finditer(text))
    if not opens:
        return None
    start = k = opens[-1].end()
    depth = 1
    while k < len(text):
        if text[k] == "\\":  # an escape: \{ and \} are literal braces (sets), \\ a line break
            k += 2
            continue
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                content = text[start:k].strip()
                return content or None
        k += 1
    return None


def _gold_text(ground_truth: str) -> str:
    """The ground truth as bare LaTeX: the content of its last box if it has one, no `$` around."""
    gold = last_boxed(ground_truth) or ground_truth
    return gold.strip().strip("$").strip()


def _fast_verdict(answer: str, gold: str) -> bool | None:
    """Decide without math-verify when the strings settle it; None when they do not."""
    if " ".join(answer.split()) == " ".join(gold.split()):
        return True
    if _PLAIN_INT.fullmatch(answer) and _PLAIN_INT.fullmatch(gold):
        return int(answer) == int(gold)  # two integer literals are equal iff their values are
    return None


@lru_cache(maxsize=4096)
def _parse(latex: str) -> list:
    """math-verify parse of `$latex$` (cached: one gold is graded against many samples)."""
    from math_verify import parse

    # Timeouts disabled: signal-based, they fail outside the main thread; callers bound the time.
    return parse(f"${latex}$", parsing_timeout=None)


def _math_equal(answer: str, gold: str) -> bool:
    """math-verify equivalence of two bare LaTeX strings; any internal error is a mismatch."""
    from math_verify import verify

    try:
        return bool(verify(_parse(gold), _parse(answer), timeout_seconds=None))
    except Exception:  # math-verify raises on some inputs despite raise_on_error=False
        return False


def rule_reward(response: str, ground_truth: str) -> float:
    """+1.0 if the response's last box equals the ground truth mathematically, else -1.0.

    Only `response` is graded, so callers pass the response text alone (a box in the prompt must not
    count). Never raises. No timeout here: grade untrusted text with `Grader`.
    """
    try:
        answer = last_boxed(response)
        if answer is None:
            return -1.0
        gold = _gold_text(ground_truth)
        verdict = _fast_verdict(answer, gold)
        if verdict is None:
            verdict = _math_equal(answer, gold)
        return 1.0 if verdict else -1.0
    except Exception:
        return -1.0


@dataclasses.dataclass
class GradeResult:
    rewards: list[float]  # +1 / -1 per response, in input order
    num_timeouts: int  # items whose worker was killed at the timeout (or died) -> scored -1
    num_missing_box: int  # responses without a (closed, non-empty) box -> scored -1


def _worker_main(fd: int) -> None:
    """Grader worker: warm up, say "ready", then answer [(idx, answer, gold), ...] item by item."""
    conn = Connection(fd)
    _math_equal("\\frac{1}{2}", "0.5")  # first call builds math-verify's grammar: do it before work
    try:
        conn.send("ready")
        while (chunk := conn.recv()) is not None:
            for idx, answer, gold in chunk:
                conn.send((idx, _math_equal(answer, gold)))
    except (EOFError, OSError):  # the parent is gone (it stopped, or failed): so is this worker,
        return  # quietly, so that the parent's own error stays the last thing printed


class _Worker:
    """One grader process: a fresh interpreter that imports only this module (never torch).

    Not multiprocessing's spawn: that re-imports the parent's `__main__` (train.py, hence torch)
    in every child. Here the child gets one end of a socket pair and nothing else.
    """

    def __init__(self):
        parent_end, child_end = Pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        code = f"import sys; sys.path.insert(0, {here!r}); import reward; reward._worker_main({child_end.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_end.fileno()],
                                     stdin=subprocess.DEVNULL)
        child_end.close()
        self.conn = parent_end
        self.ready = False
        self.pending: deque = deque()  # items sent and not yet answered, in order
        self.deadline = math.inf

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class Grader:
    """Batch `rule_reward` with a pool of worker processes and a hard per-item timeout.

    Box extraction and the string fast path run in the calling process; only the items that need
    math-verify go to workers, in chunks. A worker silent for `timeout_s` on one item is killed and
    replaced; that item scores -1 and is counted, the rest of its chunk goes to another worker.
    The pool lives until `close()` (or the end of a `with` block), so each call pays no start-up.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, max_chunk: int = 32):
        if num_workers < 1 or timeout_s <= 0 or max_chunk < 1:
            raise ValueError(f"Grader: need num_workers >= 1, timeout_s > 0, max_chunk >= 1; got "
                             f"{num_workers}, {timeout_s}, {max_chunk}")
        self.timeout_s, self.max_chunk = timeout_s, max_chunk
        self.workers = [_Worker() for _ in range(num_workers)]  # they warm up while the caller works

    def __enter__(self) -> "Grader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self.workers:
            try:  # a worker still starting up (or hung) is not worth waiting for
                w.proc.wait(timeout=1 if w.ready and not w.pending else 0.01)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        self.workers = []

    def grade(self, responses: list[str], answers: list[str]) -> GradeResult:
        """Rewards for `responses` (response text only) against `answers` (ground truths)."""
        if len(responses) != len(answers):
            raise ValueError(f"grade: {len(responses)} responses but {len(answers)} answers")
        if not self.workers:
            raise ValueError("grade: this Grader is closed")
        rewards = [-1.0] * len(responses)
        todo: deque = deque()
        for w in list(self.workers):
            if w.pending:  # left by an interrupted call: its answers must not land in this one
                w.pending.clear()
                self._replace(w, todo, rewards)
        missing = 0
        for i, (response, ground_truth) in enumerate(zip(responses, answers)):
            answer = last_boxed(str(response))
            if answer is None:
                missing += 1
                continue
            gold = _gold_text(str(ground_truth))
            verdict = _fast_verdict(answer, gold)
            if verdict is None:
                todo.append((i, answer, gold))
            else:
                rewards[i] = 1.0 if verdict else -1.0
        # ~4 chunks per worker: few messages, yet the load still balances.
        chunk = max(1, min(self.max_chunk, math.ceil(len(todo) / (4 * len(self.workers)))))
        timeouts = 0
        while todo or any(w.pending for w in self.workers):
            for w in list(self.workers):
                if w.ready and not w.pending and todo:
                    items = [todo.popleft() for _ in range(min(chunk, len(todo)))]
                    try:
                        w.conn.send(items)
                    except OSError:  # died while idle: nothing of this chunk was lost
                        todo.extendleft(reversed(items))
                        self._replace(w, todo, rewards)
                        continue
                    w.pending.extend(items)
                    w.deadline = time.monotonic() + self.timeout_s
            busy = [w.deadline for w in self.workers if w.pending]
            wait_s = max(0.0, min(busy) - time.monotonic()) if busy else None
            for conn in wait([w.conn for w in self.workers], timeout=wait_s):
                w = next(w for w in self.workers if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the worker died
                    timeouts += self._replace(w, todo, rewards)
                    continue
                if msg == "ready":
                    w.ready = True
                else:
                    idx, equal = msg
                    rewards[idx] = 1.0 if equal else -1.0
                    w.pending.popleft()
                    w.deadline = time.monotonic() + self.timeout_s
            now = time.monotonic()
            for w in list(self.workers):
                if w.pending and now > w.deadline:
                    timeouts += self._replace(w, todo, rewards)
        return GradeResult(rewards=rewards, num_timeouts=timeouts, num_missing_box=missing)

    def _replace(self, w: _Worker, todo: deque, rewards: list[float]) -> int:
        """Kill `w`, score its current item -1, requeue the rest; returns 1 if an item was lost."""
        if not w.ready:
            w.kill()
            raise RuntimeError("Grader: a worker died while starting (see its stderr above)")
        w.kill()
        lost = 0
        if w.pending:
            idx, _, _ = w.pending.popleft()
            rewards[idx] = -1.0
            lost = 1
            todo.extendleft(reversed(w.pending))
        self.workers[self.workers.index(w)] = _Worker()
        return lost


# --- outcome reward model (§3.1): the critic initialisation of plain PPO -----------------------


def _last_token_outputs(model, batch):
    """The model's scalar output after reading each whole response: position P + L_b - 1, [B]."""
    import torch

    from critic import value_outputs

    outputs = value_outputs(model, **batch.model_inputs())  # [B, P + T]
    last = batch.prompt_ids.shape[1] + batch.lengths - 1
    return outputs.gather(1, last.unsqueeze(1)).squeeze(1).to(torch.float32)


def train_orm(model, batches: list, labels: list, steps: int, lr: float,
              weight_decay: float = 0.0, max_grad_norm: float = 1.0) -> list[dict]:
    """Train the ORM: MSE between the last-token output and the +-1 label, as a reward model is.

    `batches` are `RolloutBatch`es, `labels[i]` a float tensor [B_i] of +-1 (e.g. `rule_reward`).
    Steps cycle through the batches. Returns per-step metrics (loss, sign accuracy).
    """
    import torch

    if len(batches) != len(labels) or not batches:
        raise ValueError(f"train_orm: need as many label tensors as batches (>0); got "
                         f"{len(batches)} batches, {len(labels)} labels")
    for i, (batch, label) in enumerate(zip(batches, labels)):
        if tuple(label.shape) != (len(batch),):
            raise ValueError(f"train_orm: labels[{i}] has shape {tuple(label.shape)}, want ({len(batch)},)")
        if bool((batch.lengths < 1).any()):
            raise ValueError(f"train_orm: batches[{i}] holds an empty response (no last token)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    history = []
    for step in range(steps):
        batch, label = batches[step % len(batches)], labels[step % len(batches)].float()
        scores = _last_token_outputs(model, batch)
        loss = torch.nn.functional.mse_loss(scores, label)  # loss at the last token only
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        accuracy = (torch.sign(scores.detach()) == torch.sign(label)).float().mean()
        history.append({"step": step, "orm/loss": loss.item(), "orm/sign_accuracy": accuracy.item(),
                        "orm/grad_norm": grad_norm.item()})
    model.eval()
    return history


def orm_scores(model, batch):
    """ORM score of each complete response (output at its last token): [B] float32."""
    import torch

    with torch.no_grad():
        return _last_token_outputs(model, batch)


# --- evaluation ---------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    Product form 1 - prod_{i=n-c+1}^{n} (1 - k / i): no huge binomials.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


# --- rewards of a rollout batch (Algorithm 1: "compute rewards") --------------------------------


def score_rollout(batch, texts: list[str], prompts: list[dict], grader: Grader, cfg):
    """Outcome scores [B], token rewards [B, T] (the score on each response's last token, DESIGN.md)
    and grader counts. A response cut at max_new_tokens scores `cfg.truncation_reward` (if set)."""
    import torch

    graded = grader.grade(texts, [p["answer"] for p in prompts])
    device = batch.device
    scores = torch.tensor(graded.rewards, dtype=torch.float32, device=device)
    if cfg.truncation_reward is not None:
        truncated = torch.tensor([f == "length" for f in batch.finish_reasons], device=device)
        scores = torch.where(truncated, float(cfg.truncation_reward), scores)
    token_rewards = torch.zeros_like(batch.response_mask)
    token_rewards[torch.arange(len(batch), device=device), batch.lengths - 1] = scores
    counts = {"timeouts": graded.num_timeouts, "missing_box": graded.num_missing_box}
    return scores, token_rewards, counts


# What the cached ORM depends on. It is shared by runs of every seed, so it samples with seed 0
# whichever run trains it: the same ORM whatever order the runs come in.
ORM_SETTINGS = ("orm_batches", "orm_steps", "orm_lr", "prompts_per_step", "samples_per_prompt",
                "max_new_tokens", "temperature", "top_p", "truncation_reward", "model", "data",
                "task_train_size", "max_prompt_tokens", "eval_fraction")


def prepare_orm(cfg, sft_path: str, engine, tokenizer, records: list[dict], grader: Grader) -> str:
    """The critic's initial weights: pi_SFT itself (`--critic-init sft`), or an ORM trained on
    pi_SFT's graded samples (`rm`), cached in <out_dir>/_shared/orm and reused when it exists."""
    if cfg.critic_init == "sft":
        return sft_path
    from tqdm import tqdm

    from config import check_settings
    from critic import load_value_model
    from data import sample_prompts, stream_seed
    from fsdp_utils import export_hf_checkpoint, world_size
    from rollout import decode_responses
    from rundir import write_json

    path = os.path.join(cfg.out_dir, "_shared", "orm" if cfg.model is None else f"orm-{cfg.run_name}")
    settings = {k: getattr(cfg, k) for k in ORM_SETTINGS}
    if os.path.exists(path):
        saved = os.path.join(path, "orm_settings.json")
        if os.path.exists(saved):  # a cache from before the settings were saved is taken as it is
            with open(saved) as f:
                check_settings(path, json.load(f), settings, remedy="delete it to train a new one")
        return path
    if world_size() > 1:
        # train_orm is a single-process trainer (whole model, whole batch): under torchrun each rank
        # would train its own ORM on its share of the samples. Train it once, then reuse the cache.
        raise SystemExit(f"error: --critic-init rm under torchrun needs a trained outcome reward model at {path} "
                         f"(a Hugging Face token-classification checkpoint, 1 label): train.py trains one only "
                         f"in a single process")
    batches, labels = [], []
    for i in tqdm(range(cfg.orm_batches), desc="ORM data", dynamic_ncols=True, leave=False):
        prompts = sample_prompts(records, dataclasses.replace(cfg, seed=0), i, stream="orm")
        batch = engine.generate([p["prompt_ids"] for p in prompts], cfg.max_new_tokens,
                                cfg.temperature, cfg.top_p, seed=stream_seed(0, "orm/sampling", i))
        scores, _, _ = score_rollout(batch, decode_responses(tokenizer, batch), prompts, grader, cfg)
        batches.append(batch)
        labels.append(scores)
    model = load_value_model(sft_path).to(batches[0].device)  # where the engine put the samples
    history = train_orm(model, batches, labels, steps=cfg.orm_steps, lr=cfg.orm_lr)
    # The settings go in before the directory takes its final name: a kill never leaves a cache
    # without them, which would be taken as it is.
    staged = path + ".new"
    export_hf_checkpoint(model, tokenizer, staged)
    write_json(os.path.join(staged, "orm_settings.json"), settings)
    os.replace(staged, path)
    last = history[-1]
    tqdm.write(f"ORM: {cfg.orm_steps} steps on {sum(map(len, batches))} graded samples, "
               f"loss {last['orm/loss']:.3f}, sign accuracy {last['orm/sign_accuracy']:.2f} -> {path}")
    return path
