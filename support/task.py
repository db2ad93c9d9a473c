"""The built-in Long-CoT task: repeated doubling, worked line by line or guessed by shortcut.

The CPU stand-in for the paper's Long-CoT maths (§3.1, §4). A problem asks for the last
four digits of x * 2^k (x = 1000..9999); k (the difficulty) sets the length of the full chain of
thought, one doubling per line, 7 tokens per line plus the answer: k = 1 -> ~19 tokens, k = 48 ->
~350 tokens, i.e. 17 GAE horizons 1/(1-0.95) = 20, so most decisions sit many horizons away
from the reward.

Lines are labelled counting down: the prompt's exponent is a letter (k = 4 is "2^d"), the first
line is labelled with it and the last one is always "a", so the model never has to count or to
compare with the prompt to know when it is done. Doubling is local: a digit receives a carry
exactly when the digit to its right is 5 or more, so every digit of a line depends on two digits
of the line above, at fixed distances, and nothing must be searched for or reversed. (Designs
that needed either, e.g. sums whose every line copies the next term from the prompt, were not
learnt by a tiny model within the SFT budget.) A tiny model gets a line right nearly always; a
long chain still accumulates slips, in its merged lines and its structure.

    prompt  1437*2^d=\n
    full    d:2874\n        1437 * 2
            c:5748\n        2874 * 2
            b:1496\n        5748 * 2 = 11496, last four digits
            a:2992\n
            \boxed{2992}

Two ways to shorten the reasoning exist at every line, each with a real but uncertain cost:
- merge: two doublings in one line ("ba:2992" multiplies by 4), saving 7 tokens; a x4 carry
  depends on several digits to the right, so merged lines slip more often (`sft.py` measures it);
- shortcut: stop after any line and guess, "?\\boxed{...}", the exact answer done "in one's
  head": one doubling is a line's work, twenty are hopeless, so shortcuts are mostly wrong on
  long problems (the default pi_SFT gets almost none right).
The SFT data mixes them (`sft_response`), so pi_SFT can do either and PPO can drift between them.
"""

import random
import re
from dataclasses import dataclass, field

import torch
from tokenizers import pre_tokenizers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

WIDTH = 4  # digits kept by default: the answer is x * 2^k mod 10**WIDTH
LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # doublings left, 1 to 52
MAX_DIFFICULTY = len(LABELS)
DEFAULT_DIFFICULTY = (1, 48)  # ~19 to ~350 response tokens
CONTEXT = 1024  # positions of the built-in model (max_position_embeddings): prompt and response together


@dataclass(frozen=True)
class TaskShape:
    """How long the chain of thought is: digits of x (a line is width + 3 tokens), the range of k of
    the RL and held-out problems, and the range the SFT cold start trains on."""

    width: int
    difficulty: tuple[int, int]
    sft_difficulty: tuple[int, int]


# `short`: the default demo task. `long`: the paper's regime, the same arithmetic on 10-digit
# numbers and 40 to 52 doublings: full traces of ~540 to ~700 tokens, the SFT mix's median response
# above 25 GAE horizons at lambda 0.95. Its SFT also sees short chains, which teach a line's
# arithmetic at a fraction of the cost. (16 digits were not learnt by the tiny model in 1,000 SFT
# steps, 12 not in 1,200; 10 were within the preset's 2,000: results/long/README.md.)
SHAPES = {"short": TaskShape(WIDTH, DEFAULT_DIFFICULTY, DEFAULT_DIFFICULTY),
          "long": TaskShape(10, (40, 52), (1, 52))}
MAX_MERGE = 2  # doublings per merged line
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
ALPHABET = "0123456789*^=:?\n\\{}" + LABELS  # "boxed" is spelt with labels

_PROMPT = re.compile(r"(\d+)\*2\^([a-zA-Z])=\n")  # x has one of the SHAPES' widths
_LINE = re.compile(r"([a-zA-Z]+):(\d+)")  # as many digits as x
_WIDTHS = {shape.width for shape in SHAPES.values()}
_BOX = re.compile(r"\??\\boxed\{([^{}]*)\}")  # "?" marks a guess


def build_tokenizer() -> Qwen2Tokenizer:
    """Character-level tokenizer: one token per character, saved as a standard tokenizer.json.

    It is a byte-level BPE without merges, i.e. exactly the pipeline that `AutoTokenizer` (and so
    vLLM) rebuilds for a Qwen2 checkpoint from the saved vocabulary: a WordLevel tokenizer saved
    beside a Qwen2 config would be reloaded as Qwen2's BPE and silently drop every newline.
    Characters outside the task's alphabet are dropped, as any byte-level BPE drops unknown bytes.
    """
    to_byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [to_byte_level.pre_tokenize_str(c)[0][0] for c in ALPHABET]  # "\n" -> "Ċ"
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(symbols))}
    return Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def make_tiny_model(
    tokenizer: Qwen2Tokenizer,
    num_layers: int = 3,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 384,
    max_position_embeddings: int = CONTEXT,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 decoder sized for the task (head_dim 64: vLLM's CPU attention needs it)."""
    if hidden_size % num_heads or hidden_size // num_heads != 64:
        raise ValueError(f"hidden_size / num_heads must be 64 (got {hidden_size} / {num_heads})")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def make_problems(
    n: int, seed: int, min_difficulty: int = DEFAULT_DIFFICULTY[0], max_difficulty: int = DEFAULT_DIFFICULTY[1],
    width: int = WIDTH,
) -> list[dict]:
    """n problems {prompt, answer, difficulty}; difficulty k (doublings) uniform in [min, max];
    x has `width` digits (one of the SHAPES' widths)."""
    if not 1 <= min_difficulty <= max_difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"need 1 <= min_difficulty <= max_difficulty <= {MAX_DIFFICULTY}, "
                         f"got {min_difficulty}, {max_difficulty}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if width not in _WIDTHS:
        raise ValueError(f"width must be one of {sorted(_WIDTHS)} (task.SHAPES), got {width}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        k, x = rng.randint(min_difficulty, max_difficulty), rng.randint(10 ** (width - 1), 10**width - 1)
        problems.append({"prompt": f"{x}*2^{LABELS[k - 1]}=\n", "answer": str(x * 2**k % 10**width),
                         "difficulty": k})
    return problems


def prompt_parts(prompt: str) -> tuple[int, int, int]:
    """(x, k, width) of a task prompt (ValueError if it is not one)."""
    m = _PROMPT.fullmatch(prompt)
    if m is None or len(m.group(1)) not in _WIDTHS:
        raise ValueError(f"not a task prompt: {prompt[:40]!r}")
    return int(m.group(1)), LABELS.index(m.group(2)) + 1, len(m.group(1))


def _labels(left: int, doublings: int) -> str:
    """Labels of a line that starts with `left` doublings to go: 4, 2 -> "dc"."""
    return "".join(LABELS[left - 1 - i] for i in range(doublings))


def step_line(value: int, doublings: int, left: int, width: int = WIDTH) -> str:
    """One reasoning line: the last `width` digits of `value` * 2**doublings, zero-padded (fixed
    columns), labelled with the doublings still `left` before it."""
    if not 1 <= doublings <= MAX_MERGE:
        raise ValueError(f"a line does 1 to {MAX_MERGE} doublings, not {doublings}")
    if doublings > left:
        raise ValueError(f"{doublings} doublings with {left} left")
    return _labels(left, doublings) + ":" + str(value * 2**doublings % 10**width).zfill(width) + "\n"


def sft_response(problem: dict, rng: random.Random, shortcut_prob: float = 0.25, merge_prob: float = 0.15) -> str:
    """A supervised trace for `problem`: full by default, with merged lines and/or an early stop.

    Each line does two doublings with probability merge_prob. With probability shortcut_prob the
    trace stops after a uniformly drawn number of lines (0 .. all but one) and guesses: "?" and the
    exact answer, as if the rest were done mentally. Every SFT target is right; a model's inability
    to imitate it without the lines is what makes a shortcut costly. The "?" tells the model that
    the box holds a guess rather than a copy of the last line.
    """
    if not (0.0 <= shortcut_prob <= 1.0 and 0.0 <= merge_prob <= 1.0):
        raise ValueError(f"probabilities must be in [0, 1], got {shortcut_prob}, {merge_prob}")
    x, k, width = prompt_parts(problem["prompt"])
    groups, done = [], 0
    while done < k:
        groups.append(MAX_MERGE if done + 1 < k and rng.random() < merge_prob else 1)
        done += groups[-1]
    guess = rng.random() < shortcut_prob
    if guess:
        groups = groups[: rng.randrange(len(groups))]
    lines, value, done = [], x, 0
    for g in groups:
        lines.append(step_line(value, g, k - done, width))
        value, done = value * 2**g % 10**width, done + g
    return "".join(lines) + ("?" if guess else "") + "\\boxed{" + str(x * 2**k % 10**width) + "}"


def full_response(problem: dict) -> str:
    """The canonical full trace: one doubling per line, every line, correct answer."""
    return sft_response(problem, random.Random(0), shortcut_prob=0.0, merge_prob=0.0)


@dataclass
class Trace:
    """What a response did. strategy: full | merged | shortcut | invalid."""

    strategy: str
    boxed: str | None = None  # content of the final \boxed{}, None if absent
    line_ok: list[bool] = field(default_factory=list)  # per line: right, given the line above
    line_steps: list[int] = field(default_factory=list)  # per line: doublings it does
    steps_done: int = 0  # doublings done before the box


def parse_response(prompt: str, response: str) -> Trace:
    """Check a response line by line (the task's own arithmetic).

    invalid: a malformed line, labels that skip, repeat or run past the prompt's last label, a
    line of more than MAX_MERGE doublings, no final box, or text after it. Lines are judged
    against the value written on the line above, so per-step reliability is measurable even after
    an earlier slip.
    """
    x, k, width = prompt_parts(prompt)
    *lines, last = response.split("\n")
    trace, value = Trace("invalid"), x
    for line in lines:
        m = _LINE.fullmatch(line)
        done = trace.steps_done
        steps = len(m.group(1)) if m else 0
        if (m is None or steps > min(MAX_MERGE, k - done) or m.group(1) != _labels(k - done, steps)
                or len(m.group(2)) != width):
            return trace
        trace.line_ok.append(step_line(value, steps, k - done, width) == line + "\n")
        trace.line_steps.append(steps)
        trace.steps_done += steps
        value = int(m.group(2))  # the value as written, right or wrong
    m = _BOX.fullmatch(last)
    if m is None:
        return trace
    trace.boxed = m.group(1)
    if trace.steps_done < k:
        trace.strategy = "shortcut"
    else:
        trace.strategy = "merged" if any(n > 1 for n in trace.line_steps) else "full"
    return trace
