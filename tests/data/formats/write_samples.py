"""Writes the sample files beside it, one per layout users bring (tests/test_data.py loads and grades each).
The problems are the project's own, written here, in each layout's field names and nesting:

- gsm8k.jsonl: GSM8K (`question`, `answer`: a worked solution ending `#### <number>`);
- verl.parquet: verl's preprocessed files (`data_source`, `prompt` as chat messages, `ability`,
  `reward_model.ground_truth`, `extra_info`), GSM8K and MATH rows side by side as verl mixes them;
- math.json: MATH (`problem`, `level`, `type`, `solution` with the answer in its last `\\boxed{}`),
  as one JSON array;
- trl.jsonl: TRL's conversational prompts (`prompt` a list of messages with a system turn, `solution`).

    python tests/data/formats/write_samples.py
"""

import json
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent

# (question, worked solution, final number): GSM8K style, with a thousands separator and a negative
GSM8K = [
    ("A baker makes 36 rolls in the morning and half as many in the afternoon. How many rolls does she make "
     "in all?", "Afternoon: 36/2 = <<36/2=18>>18 rolls.\nIn all: 36+18 = <<36+18=54>>54 rolls.", "54"),
    ("A library has 1,250 books and buys 375 more. How many books does it have now?",
     "1,250 + 375 = <<1250+375=1625>>1,625 books.", "1,625"),
    ("The temperature at dawn was 4 degrees. By midnight it had fallen 9 degrees. What was it at midnight?",
     "4 - 9 = <<4-9=-5>>-5 degrees.", "-5"),
    ("Sam reads 12 pages a day for 7 days. How many pages does he read?", "12 x 7 = <<12*7=84>>84 pages.", "84"),
]
# (problem, solution ending in a box, the boxed answer)
MATH = [
    ("What is $\\frac{3}{6}$ in lowest terms?", "Divide both by 3: $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$.",
     "\\frac{1}{2}"),
    ("Solve $2x + 3 = 11$.", "Subtract 3 and halve: $x = \\boxed{4}$.", "4"),
    ("What is $\\sqrt{49} + 1$?", "$\\sqrt{49} = 7$, so the sum is $\\boxed{8}$.", "8"),
    ("Expand $(x+1)^2$.", "$(x+1)^2 = \\boxed{x^2 + 2x + 1}$.", "x^2 + 2x + 1"),
]
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def main() -> None:
    with open(HERE / "gsm8k.jsonl", "w") as f:
        for question, work, number in GSM8K:
            f.write(json.dumps({"question": question, "answer": f"{work}\n#### {number}"}) + "\n")
    verl = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{q} {GSM8K_INSTRUCTION}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": n.replace(",", "")},
             "extra_info": {"split": "train", "index": i}} for i, (q, _, n) in enumerate(GSM8K)]
    verl += [{"data_source": "DigitalLearningGmbH/MATH-lighteval",
              "prompt": [{"role": "user", "content": f"{p} {MATH_INSTRUCTION}"}], "ability": "math",
              "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": "train", "index": i}}
             for i, (p, _, a) in enumerate(MATH)]
    pd.DataFrame(verl).to_parquet(HERE / "verl.parquet", index=False)
    rows = [{"problem": p, "level": "Level 1", "type": "Algebra", "solution": s} for p, s, _ in MATH]
    (HERE / "math.json").write_text(json.dumps(rows, indent=1) + "\n")
    with open(HERE / "trl.jsonl", "w") as f:
        for p, s, _ in MATH:
            messages = [{"role": "system", "content": "You are a careful mathematician."},
                        {"role": "user", "content": p}]
            f.write(json.dumps({"prompt": messages, "solution": s}) + "\n")


if __name__ == "__main__":
    main()
