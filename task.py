"""The built-in Long-CoT task: long column additions, step by step or by shortcut.

The CPU stand-in for the paper's Long-CoT maths (PAPER.md §1, §7). A problem is a sum of k
two-digit terms; k (the difficulty) sets the length of a full chain of thought, about 13 tokens
per term: 1 term -> ~24 tokens, 24 terms -> ~320 tokens, i.e. 16 GAE horizons 1/(1-0.95) = 20.

Numbers inside the prompt and the trace are written least-significant digit first ("37" is
"73"), and every digit of a running total carries an explicit carry mark ('.' 0, "'" 1, '"' 2),
so each generated digit depends on three tokens at fixed distances: a tiny model is reliable per
step, yet a long chain accumulates errors. Only the final answer is written normally.

    prompt  a73b58c21d49=\n                   37 + 85 + 12 + 94: terms labelled a, b, ...
    full    a73:7.3.0.0.\n                    0 + 37 = 37    (4 digits, each with a carry mark)
            b58:2'2'1.0.\n                    37 + 85 = 122  (7+5 = 12: write 2, carry 1; ...)
            c21:4.3.1.0.\n                    122 + 12 = 134
            d49:8.2'2.0.\n                    134 + 94 = 228
            \boxed{228}

Each line starts by copying the next labelled term: the labels make that copy a lookup by content
instead of an induction over positions, which a tiny model learns far faster.

Two ways to shorten the reasoning exist at every line, each with a real but not certain cost:
- merge: add two terms in one line ("c21d49:..."), saving 10 tokens; three-operand columns are
  harder for a small model, so merged lines fail more often (measured by `sft.py`);
- shortcut: stop after any line and box the exact total "in one's head": easy for one or two
  terms, hopeless for twenty, so shortcuts are mostly wrong on long problems.
The SFT data mixes them (`sft_response`), so pi_SFT can do either and PPO can drift between them.
"""

import random
import re
from dataclasses import dataclass, field

import torch

from tokenizers import pre_tokenizers
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

TERM_DIGITS = 2  # terms are 10..99
WIDTH = 4  # digits of every running total; 4 digits hold 101 * 99 = 9999
LABELS = "abcdefghijklmnopqrstuvwxyz"  # one per term, so at most 26 terms (26 * 99 < 10**WIDTH)
MAX_DIFFICULTY = len(LABELS)
DEFAULT_DIFFICULTY = (1, 24)  # ~24 to ~320 response tokens
CARRY_MARKS = ".'\""  # carry 0, 1, 2 (a merged line adds up to 9+9+9+2 = 29 per column)
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
ALPHABET = "0123456789=:" + CARRY_MARKS + "\n\\{}" + LABELS  # "boxed" is made of labels

_LINE = re.compile(r"((?:[a-z]\d{%d})+):((?:\d[%s]){%d})" % (TERM_DIGITS, re.escape(CARRY_MARKS), WIDTH))
_TERM = re.compile(r"([a-z])(\d{%d})" % TERM_DIGITS)
_BOX = re.compile(r"\\boxed\{([^{}]*)\}")
_PROMPT = re.compile(r"((?:[a-z]\d{%d})+)=\n" % TERM_DIGITS)


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
    max_position_embeddings: int = 1024,
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


def _rev(n: int, width: int) -> str:
    return str(n).zfill(width)[::-1]


def make_problems(
    n: int, seed: int, min_difficulty: int = DEFAULT_DIFFICULTY[0], max_difficulty: int = DEFAULT_DIFFICULTY[1]
) -> list[dict]:
    """n problems {prompt, answer, difficulty}; difficulty k (number of terms) uniform in [min, max]."""
    if not 1 <= min_difficulty <= max_difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"need 1 <= min_difficulty <= max_difficulty <= {MAX_DIFFICULTY}, "
                         f"got {min_difficulty}, {max_difficulty}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        k = rng.randint(min_difficulty, max_difficulty)
        terms = [rng.randint(10 ** (TERM_DIGITS - 1), 10**TERM_DIGITS - 1) for _ in range(k)]
        prompt = _labelled(terms, 0) + "=\n"
        problems.append({"prompt": prompt, "answer": str(sum(terms)), "difficulty": k})
    return problems


def prompt_terms(prompt: str) -> list[int]:
    """The terms of a task prompt, in order (ValueError if it is not one)."""
    m = _PROMPT.fullmatch(prompt)
    labelled = _TERM.findall(m.group(1)) if m else []
    if not labelled or [lab for lab, _ in labelled] != list(LABELS[: len(labelled)]):
        raise ValueError(f"not a task prompt: {prompt[:40]!r}")
    return [int(digits[::-1]) for _, digits in labelled]


def _labelled(terms: list[int], first: int) -> str:
    """Terms written with their labels, digits reversed: [37, 85], 0 -> "a73b58"."""
    return "".join(LABELS[first + i] + _rev(t, TERM_DIGITS) for i, t in enumerate(terms))


def step_line(total: int, terms: list[int], first: int) -> str:
    """One reasoning line: add `terms` (labels from index `first`) to the running `total`,
    column by column, marking carries."""
    cells, carry = [], 0
    digits = [_rev(total, WIDTH)] + [_rev(t, WIDTH) for t in terms]
    for col in range(WIDTH):
        s = sum(int(d[col]) for d in digits) + carry
        carry = s // 10
        cells.append(str(s % 10) + CARRY_MARKS[carry])
    if carry:
        raise ValueError(f"{total} + {terms} overflows {WIDTH} digits")
    return _labelled(terms, first) + ":" + "".join(cells) + "\n"


def sft_response(problem: dict, rng: random.Random, shortcut_prob: float = 0.3, merge_prob: float = 0.1) -> str:
    """A supervised trace for `problem`: full by default, with merged lines and/or an early stop.

    Each line merges the next two terms with probability merge_prob. With probability
    shortcut_prob the trace stops after a uniformly drawn number of lines (0 .. all but one) and
    boxes the exact total, as if the rest were done mentally: the SFT target is always correct,
    the model's ability to imitate it without the lines is what makes a shortcut costly.
    """
    if not (0.0 <= shortcut_prob <= 1.0 and 0.0 <= merge_prob <= 1.0):
        raise ValueError(f"probabilities must be in [0, 1], got {shortcut_prob}, {merge_prob}")
    terms = prompt_terms(problem["prompt"])
    groups, i = [], 0
    while i < len(terms):
        size = 2 if i + 1 < len(terms) and rng.random() < merge_prob else 1
        groups.append(terms[i : i + size])
        i += size
    if rng.random() < shortcut_prob:
        groups = groups[: rng.randrange(len(groups))]
    lines, total, done = [], 0, 0
    for g in groups:
        lines.append(step_line(total, g, done))
        total, done = total + sum(g), done + len(g)
    return "".join(lines) + "\\boxed{" + str(sum(terms)) + "}"


def full_response(problem: dict) -> str:
    """The canonical full trace: one term per line, every line, correct answer."""
    return sft_response(problem, random.Random(0), shortcut_prob=0.0, merge_prob=0.0)


@dataclass
class Trace:
    """What a response did. strategy: full | merged | shortcut | invalid."""

    strategy: str
    boxed: str | None = None  # content of the final \boxed{}, None if absent
    line_ok: list[bool] = field(default_factory=list)  # per line: arithmetic right given the line above
    line_terms: list[int] = field(default_factory=list)  # per line: how many terms it adds
    terms_done: int = 0  # prompt terms consumed before the box


def parse_response(prompt: str, response: str) -> Trace:
    """Check a response line by line against the prompt's terms (the task's own arithmetic).

    invalid: a malformed line, a line whose terms are not the next prompt terms, more lines than
    terms, no final box, or text after it. Lines are judged locally (against the total written on
    the line above), so per-step reliability is measurable even after an earlier slip.
    """
    terms = prompt_terms(prompt)
    *lines, last = response.split("\n")
    trace, total = Trace("invalid"), 0
    for line in lines:
        m = _LINE.fullmatch(line)
        if m is None:
            return trace
        k = trace.terms_done
        labelled = _TERM.findall(m.group(1))
        written = [int(digits[::-1]) for _, digits in labelled]
        if [lab for lab, _ in labelled] != list(LABELS[k : k + len(labelled)]) or k + len(labelled) > len(terms):
            return trace  # a skipped, repeated or invented term
        # Right = the term copied right and the columns right, given the total written above.
        copied = written == terms[k : k + len(written)]
        trace.line_ok.append(copied and total + sum(written) < 10**WIDTH and step_line(total, written, k) == line + "\n")
        trace.line_terms.append(len(written))
        trace.terms_done += len(written)
        total = int(m.group(2)[0::2][::-1])  # the total as written, right or wrong
    m = _BOX.fullmatch(last)
    if m is None:
        return trace
    trace.boxed = m.group(1)
    if trace.terms_done < len(terms):
        trace.strategy = "shortcut"
    else:
        trace.strategy = "merged" if any(n > 1 for n in trace.line_terms) else "full"
    return trace


def response_strategy(prompt: str, response: str) -> str:
    """full | merged | shortcut | invalid (see `parse_response`)."""
    return parse_response(prompt, response).strategy
