"""A new user's mistakes, end to end through train.py's command line (issue 17): each stops with one
line naming what is wrong and leaves the run directory byte for byte as it was, so the corrected
command runs; caches whose settings cannot be checked are refused; metrics files are strict JSON.

The command line runs in this process (`runpy`, as `python train.py ...` would, error handler
included): a subprocess pays ~10 s of imports per command. Two checks run a real subprocess.
"""

import contextlib
import hashlib
import io
import json
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import task
from support.sft import ModelError, check_model
from test_train import MICRO, ROOT

QUICK = ["--steps", "0", "--value-pretrain-steps", "0"]  # a run that starts and stops at once


def run_script(script: str, *argv: str) -> tuple[str | None, str]:
    """`python <script> argv...` in this process: (the error it exits with, or None; its stdout).
    Anything but a clean exit or `SystemExit("error: ...")` (a traceback) fails the test."""
    stdout, saved = io.StringIO(), sys.argv
    sys.argv = [str(ROOT / script), *argv]
    try:
        with contextlib.redirect_stdout(stdout):
            runpy.run_path(str(ROOT / script), run_name="__main__")
        error = None
    except SystemExit as e:
        error = e.code
    finally:
        sys.argv = saved
    assert error is None or isinstance(error, str), f"exit code {error!r}"
    return error, stdout.getvalue()


def train(out_dir, *argv: str) -> tuple[str | None, str]:
    return run_script("train.py", "--out-dir", str(out_dir), *MICRO, *argv)


def plan(out_dir, *argv: str) -> tuple[str | None, str]:
    """train.py --plan at the tiny preset's batch (MICRO's does not split over --plan's 16 GPUs)."""
    return run_script("train.py", "--out-dir", str(out_dir), *argv, "--plan")


def refused(out_dir, *argv: str, match: str, command=train) -> str:
    """Run train.py, expecting one line `error: ...` that matches `match`, and nothing written."""
    before = snapshot(out_dir)
    error, _ = command(out_dir, *argv)
    assert error is not None and error.startswith("error: ") and "\n" not in error, error
    assert re.search(match, error), error
    assert snapshot(out_dir) == before, "a refused command changed the output directory"
    return error


def snapshot(root) -> dict:
    """Every path under `root` with the SHA-256 of its bytes (None for a directory)."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def strict_json(text: str):
    """json.loads that rejects NaN and Infinity, as strict readers (JavaScript, jq) do."""
    def reject(name):
        raise ValueError(f"bare {name} in JSON")
    return json.loads(text, parse_constant=reject)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def first_run(out_dir):
    """The first run of a new user, through the command line: it trains pi_SFT, value-pretrains for
    one step and runs one PPO step, checkpointed. One-token responses all score -1 (truncated or
    boxless), so every return of a batch is equal and explained variance is undefined."""
    error, stdout = train(out_dir, "--run-name", "first", "--steps", "1", "--save-every", "1",
                          "--value-pretrain-steps", "1", "--max-new-tokens", "1")
    assert error is None, error
    return stdout


@pytest.fixture(scope="module")
def sft(out_dir, first_run):
    return str(out_dir / "_shared" / "sft")


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """A good JSONL file of the built-in task's problems, and the same with its third line cut short."""
    root = tmp_path_factory.mktemp("data")
    lines = [json.dumps({"prompt": p["prompt"], "answer": p["answer"]}) for p in task.make_problems(24, seed=5)]
    (root / "good.jsonl").write_text("\n".join(lines) + "\n")
    (root / "cut.jsonl").write_text("\n".join(lines[:2] + [lines[2][:25]] + lines[3:]) + "\n")
    return root / "good.jsonl", root / "cut.jsonl", len(lines[2][:25])


# 1. An unbounded grader -----------------------------------------------------------------------------------

# Two answers that each kept math-verify busy for over 30 s, as Python source for the subprocess (the
# second, a 1 MB sum, would not fit a command-line argument). tests/test_reward.py has the others.
HOSTILE = """["\\\\boxed{9^{9^{9^{9}}}}", "\\\\boxed{" + "+".join(["1"] * 500_000) + "}"]"""


def test_sft_report_grades_hostile_samples_within_its_timeout(tmp_path):
    """`python -m support.sft`'s report grades its own samples; samples that hang math-verify (here every
    one of them) score -1 after the grader's timeout instead of hanging the command."""
    code = f"""
import runpy, sys
sys.path.insert(0, {str(ROOT)!r})
import rollout
hostile = {HOSTILE}
rollout.decode_responses = lambda tokenizer, batch: [hostile[i % len(hostile)] for i in range(len(batch))]
sys.argv = ["sft.py", "--steps", "1", "--batch-size", "2", "--eval-problems", "2", "--grader-timeout-s", "1",
            "--out-dir", {str(tmp_path)!r}]
runpy.run_path({str(ROOT / "support" / "sft.py")!r}, run_name="__main__")
"""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accuracy 0.000" in done.stdout and "n=2" in done.stdout, done.stdout
    assert time.monotonic() - t0 < 120  # two 1 s timeouts and restarts, plus start-up (~20 s)


# 2. Non-finite floats and ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, match", [
    ("--grader-timeout-s", "inf", r"--grader-timeout-s = inf \(must be finite and > 0\)"),
    ("--truncation-reward", "nan", r"--truncation-reward = nan \(must be finite and <= 0, or unset"),
    # held-out scores count an outcome > 0 as solved: a cut response would be
    ("--truncation-reward", "0.5", r"--truncation-reward = 0.5 \(must be <= 0, or unset: a cut response scored above 0"),
    ("--lam-actor", "1.5", r"--lam-actor = 1.5 \(must be in \[0, 1\]\)"),
    # pi_SFT of the short task never saw k = 49 (task.SHAPES)
    ("--task-difficulty", "40 49", r"--task-difficulty = \(40, 49\) \(must be two k with 1 <= min <= max <= 48"),
])
def test_bad_flag_values_stop_naming_the_flag_and_its_valid_range(out_dir, first_run, flag, value, match):
    refused(out_dir, "--run-name", "first", flag, *value.split(), match=match)


# 3. A failed start must not block its corrected rerun --------------------------------------------------------


def test_model_typo_with_the_default_run_name_leaves_nothing_behind(out_dir, sft, capfd):
    refused(out_dir, "--model", str(out_dir / "typo"), *QUICK, match=r"--model .*typo: no Hugging Face checkpoint")
    assert not (out_dir / "tiny__sft__seed0").exists()
    error, stdout = train(out_dir, "--model", sft, *QUICK)  # the corrected command
    assert error is None, error
    assert (out_dir / "tiny__sft__seed0" / "config.json").exists()
    assert "TensorBoard events, actor_hf/" in stdout  # --steps 0 saves no checkpoint/: the summary does not claim one
    # The expected fresh value head is said in one line, not in transformers' load report.
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.err + captured.out
    assert f"a fresh value head (score.weight, score.bias) on the backbone of {sft}" in captured.out + stdout


def test_data_cut_short_is_reported_where_and_its_corrected_rerun_runs(out_dir, sft, data_files):
    good, cut, cut_length = data_files
    refused(out_dir, "--run-name", "data", "--model", sft, "--data", str(cut), *QUICK,
            match=rf"cut\.jsonl:3: malformed JSON \(.*: the line ends at column {cut_length}, cut short\?\)")
    assert not (out_dir / "data").exists()
    error, _ = train(out_dir, "--run-name", "data", "--model", sft, "--data", str(good), *QUICK)
    assert error is None, error


# 4. A refused --resume, or a rerun with other settings, leaves the directory as it was ----------------------


def test_refused_resume_leaves_the_run_directory_byte_for_byte(out_dir, first_run):
    refused(out_dir, "--run-name", "first", "--steps", "0", "--resume", "--max-new-tokens", "1",
            "--value-pretrain-steps", "1", match=r"first/checkpoint is at step 0: 1 trained, more than --steps 0")


def test_a_rerun_with_other_settings_names_every_changed_flag(out_dir, first_run):
    error = refused(out_dir, "--run-name", "first", "--steps", "1", "--value-pretrain-steps", "1",
                    "--actor-lr", "1e-4", "--critic-lr", "1e-3", "--lam-actor", "0.9", "--gamma", "0.99",
                    "--seed", "3", "--clip-high", "0.28", match=r"first was made with other settings")
    for change in ("--actor-lr 5e-05 -> 0.0001", "--critic-lr 0.0003 -> 0.001", "--lam-actor 0.95 -> 0.9",
                   "--gamma 1.0 -> 0.99", "--seed 0 -> 3", "--clip-high 0.2 -> 0.28", "--max-new-tokens 1 -> 40"):
        assert change in error
    assert "..." not in error and "actor_lr" not in error


# 5. Caches whose settings cannot be checked are refused, never reused ----------------------------------------


def test_a_pi_sft_written_by_sft_py_with_other_settings_is_refused(tmp_path):
    error, stdout = run_script("support/sft.py", "--steps", "2", "--eval-problems", "0",
                               "--out-dir", str(tmp_path / "_shared" / "sft"))
    assert error is None and f"saved to {tmp_path / '_shared' / 'sft'}" in stdout
    refused(tmp_path, *QUICK, match=r"_shared/sft was made with other settings \(--sft-steps 2 -> 8\)")
    (tmp_path / "_shared" / "sft" / "settings.json").unlink()  # as a killed or older `python -m support.sft` left it
    refused(tmp_path, *QUICK, match=r"_shared/sft holds no settings.json")


def test_an_orm_or_a_value_pretrained_critic_without_its_settings_is_refused(out_dir, sft):
    orm = out_dir / "_shared" / "orm"
    shutil.copytree(sft, orm, ignore=shutil.ignore_patterns("settings.json"))  # a model, no settings
    try:
        refused(out_dir, "--run-name", "rm", "--critic-init", "rm", *QUICK, match=r"orm holds no settings.json")
    finally:
        shutil.rmtree(orm)
    critic = out_dir / "orphan" / "value_pretrain" / "critic"
    shutil.copytree(sft, critic)  # a value-pretrained critic whose run's config.json is gone
    refused(out_dir, "--run-name", "orphan", "--value-pretrain-steps", "1", "--steps", "0",
            match=r"orphan holds value_pretrain but no config.json")


# 6. A bad --model directory: one line naming it and its fault, with --plan too -----------------------------


def bad_models(sft: str, root: Path) -> dict:
    def variant(name, change):
        path = root / name
        shutil.copytree(sft, path)
        change(path)
        return str(path)

    def retype(path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen99"}))

    def truncate(path):
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    def cut(file):  # a copy that stopped halfway
        file.write_text(file.read_text()[: file.stat().st_size // 2])

    def edit(file, **fields):
        def change(path):
            (path / file).write_text(json.dumps({**json.loads((path / file).read_text()), **fields}))
        return change

    return {
        "config.json is not JSON": variant("nonjson", lambda p: (p / "config.json").write_text("{not json")),
        "config.json has no model_type": variant("empty", lambda p: (p / "config.json").write_text("{}")),
        "config.json's model_type 'qwen99' is not a causal LM": variant("unknown", retype),
        "no weights": variant("noweights", lambda p: (p / "model.safetensors").unlink()),
        "model.safetensors is unreadable, truncated": variant("truncated", truncate),
        "no tokenizer": variant("notokenizer", lambda p: [f.unlink() for f in p.glob("tokenizer*")]),
        # tokenizer_config.json alone: transformers built a tokenizer of its special tokens, in silence.
        "no tokenizer vocabulary": variant("novocabulary", lambda p: (p / "tokenizer.json").unlink()),
        "tokenizer.json is not JSON": variant("cuttokenizer", lambda p: cut(p / "tokenizer.json")),
        "tokenizer_config.json is not JSON": variant("cuttokenizerconfig", lambda p: cut(p / "tokenizer_config.json")),
        # Dropped in silence before, with the end tokens it lists.
        "generation_config.json is not JSON": variant("cutgeneration", lambda p: cut(p / "generation_config.json")),
        # A critic saved by a run: its scalar head was dropped in silence and the rest trained as the policy.
        "a Qwen2ForTokenClassification \\(a value or reward model's scalar head\\), not a policy":
            variant("critic", edit("config.json", architectures=["Qwen2ForTokenClassification"])),
        # Sampled past the positions the model was trained on (hf), or a vLLM traceback after loading.
        "its context holds 48 positions .* ask for 552": variant("short", edit("config.json", max_position_embeddings=48)),
        "the tokenizer has no pad_token \\(Llama's has none\\)": variant("nopad", edit("tokenizer_config.json", pad_token=None)),
        "the tokenizer has no eos_token, the token that ends a response":
            variant("noeos", edit("tokenizer_config.json", eos_token=None)),
        # A tokenizer that is not the model's: an IndexError inside torch at the first prompt with such an id.
        "the tokenizer has 74 tokens and the model's embedding 60 rows": variant("vocab", edit("config.json", vocab_size=60)),
    }


def test_a_bad_model_directory_stops_with_one_line_naming_it(out_dir, sft, tmp_path):
    for fault, path in bad_models(sft, tmp_path).items():
        refused(out_dir, "--run-name", "badmodel", "--model", path, *QUICK, match=rf"--model {re.escape(path)}: {fault}")
        if fault.startswith(("no weights", "model.safetensors is unreadable", "no tokenizer", "its context", "the tok",
                             "tokenizer", "generation_config")):
            error, stdout = plan(out_dir, "--model", path)  # --plan reads the config alone
            assert error is None and "peak" in stdout, error
        else:
            refused(out_dir, "--model", path, match=rf"--model {re.escape(path)}: {fault}", command=plan)
    assert not (out_dir / "badmodel").exists()


def test_a_tokenizer_without_a_pad_token_is_refused_before_the_actor_loads(out_dir, sft, tmp_path, monkeypatch):
    """The refusal came when the rollout engine was built: after the data was read and the actor
    loaded, minutes at 32B."""
    from support import checkpoints

    path = bad_models(sft, tmp_path)["the tokenizer has no pad_token \\(Llama's has none\\)"]
    monkeypatch.setattr(checkpoints, "load_pretrained", lambda *a, **k: pytest.fail("the actor was loaded"))
    refused(out_dir, "--run-name", "badmodel", "--model", path, *QUICK, match="the tokenizer has no pad_token")


def test_a_model_type_with_no_token_classification_model_trains_no_critic_on_it(out_dir, sft, tmp_path):
    """OPT (and OLMo, Gemma 3, GPT-J, ...: most causal LMs of transformers) has no ForTokenClassification
    class, so the critic could not be built on its backbone: the run stopped with a traceback after the actor
    was loaded and evaluated. It is refused at the model check; GRPO, which trains no critic, takes it."""
    import transformers

    path = tmp_path / "opt"
    transformers.OPTForCausalLM(transformers.OPTConfig(vocab_size=74, hidden_size=16, num_hidden_layers=1,
                                                       num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16,
                                                       max_position_embeddings=1024)).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(sft, name), path / name)
    check_model(str(path))  # a policy all the same
    with pytest.raises(ModelError, match=rf"--model {re.escape(str(path))}: transformers has no token-classification "
                                         rf"model for model_type 'opt', .*; --estimator grpo trains no critic"):
        check_model(str(path), critic=True)
    refused(out_dir, "--run-name", "opt", "--model", str(path), *QUICK, match="no token-classification model")
    assert not (out_dir / "opt").exists()


def test_a_hub_name_as_model_says_it_is_not_downloaded(tmp_path, monkeypatch):
    """--model Qwen/Qwen2.5-0.5B-Instruct said only "no Hugging Face checkpoint there": hub names are
    not downloaded, and the message says how to get one; a local folder (there, or a path) is not a hub name."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=r"--model Qwen/Qwen2\.5-0\.5B-Instruct: no Hugging Face checkpoint there "
                                         r"\(no config\.json\); hub names are not downloaded: download it first "
                                         r"\(hf download Qwen/Qwen2\.5-0\.5B-Instruct --local-dir DIR\) and pass"):
        check_model("Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "models" / "mine").mkdir(parents=True)
    for path in ("models/mine", "models/typo", "./Qwen/Qwen2.5", "/no/such", "a/b/c"):  # typo: models/ is there
        with pytest.raises(ModelError, match=r"\(no config\.json\)$"):
            check_model(path)


def test_pytorch_model_bin_weights_are_checked_like_safetensors(sft, tmp_path):
    path = tmp_path / "bin"
    shutil.copytree(sft, path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")  # the older format
    (path / "model.safetensors").unlink()
    check_model(str(path))  # complete: accepted
    weights = path / "pytorch_model.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match="pytorch_model.bin is unreadable, truncated"):
        check_model(str(path))


def test_a_bad_model_directory_prints_one_line_from_the_real_command_line(sft, tmp_path):
    path = bad_models(sft, tmp_path)["config.json is not JSON"]
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--out-dir", str(tmp_path / "runs"),
                           "--model", path], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: --model {path}: config.json is not JSON")
    assert not (tmp_path / "runs").exists()


PRESET_PARAMS = {"qwen2.5-1.5b": "1.54B", "qwen2.5-7b": "7.62B", "qwen2.5-32b": "32.76B"}


def test_the_readme_plan_examples_run(sft, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if re.match(r"^(WORLD_SIZE=\d+ )?python train.py .*--plan", line)]
    assert any("--model" not in c for c in commands) and any("--model /path/to/sft" in c for c in commands)
    assert "--plan alone plans the paper's Qwen2.5-32B shape" in readme
    for command in commands:
        argv = command.replace("/path/to/sft", sft).split()
        while "=" in argv[0]:  # VAR=value before the command
            monkeypatch.setenv(*argv.pop(0).split("="))
        error, stdout = run_script("train.py", *argv[2:])
        assert error is None and "peak" in stdout and "fits" in stdout.split("peak")[1], (command, error)
        if "--model" not in command:  # the preset's own model: the paper's for qwen2.5-32b
            preset = argv[argv.index("--preset") + 1]
            assert f"actor {PRESET_PARAMS[preset]} parameters" in stdout, command
    assert set(PRESET_PARAMS) <= {c.split("--preset ")[1].split()[0] for c in commands}  # each GPU preset's plan


def test_the_readme_quickstart_command_parses_and_reads_gsm8k_as_shipped(sft, tmp_path):
    """The one-GPU quickstart's flags, with the GSM8K sample (tests/data/formats) for the downloaded
    files: the 1.5B preset, the question field, the final numbers as gold answers, the template."""
    from transformers import AutoTokenizer

    from support.config import parse_config
    from support.data import prepare_data

    readme = (ROOT / "README.md").read_text()
    command = readme.split("## Quickstart on one GPU")[1].split("python train.py ")[1].split("```")[0]
    command = command.replace("\\\n", " ")  # the shell's line continuations
    sample = str(ROOT / "tests" / "data" / "formats" / "gsm8k.jsonl")
    argv = shlex.split(command.replace("~/models/qwen2.5-1.5b-instruct", sft).replace(
        "~/data/gsm8k/main/train-00000-of-00001.parquet", sample).replace(
        "~/data/gsm8k/main/test-00000-of-00001.parquet", sample))
    cfg = parse_config([*argv, "--out-dir", str(tmp_path)])
    assert (cfg.preset, cfg.actor_lr, cfg.rollout, cfg.mixed_precision) == ("qwen2.5-1.5b", 1e-6, "vllm", True)
    train_records, held_out = prepare_data(cfg, AutoTokenizer.from_pretrained(sft))
    assert [r["answer"] for r in held_out] == ["54", "1625", "-5", "84"] == [r["answer"] for r in train_records]
    assert train_records[0]["prompt"].endswith("in all? Please reason step by step, and put your final answer "
                                               "within \\boxed{}.")


# 7. Metrics files are strict JSON -----------------------------------------------------------------------------


def test_undefined_explained_variance_is_written_as_null(out_dir, first_run):
    run_dir = out_dir / "first"
    rows = [strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] and rows[0]["critic/vf_explained_var"] is None
    curve = [strict_json(line) for line in (run_dir / "value_pretrain" / "curve.jsonl").read_text().splitlines()]
    assert curve[0]["explained_variance"] is None
    assert strict_json((run_dir / "summary.json").read_text())["value_pretrain"]["explained_variance"] is None
    assert "explained variance undefined (all returns equal)" in first_run


def test_the_sft_log_names_where_pi_sft_was_saved(out_dir, first_run):
    assert f"SFT: saved to {out_dir / '_shared' / 'sft'}" in first_run and "sft.partial" not in first_run


def test_unicode_digits_are_not_ascii_numbers():
    from reward import Grader

    with Grader(num_workers=1) as grader:  # the last: the ground truth's own text
        graded = grader.grade(["\\boxed{١٢٣٤}", "\\boxed{１２３４}", "\\boxed{１２３４}"], ["1234", "1234", "１２３４"])
    assert graded.outcomes == [-1.0, -1.0, 1.0]


# 8. Users' data in the layouts of verl, TRL and GSM8K: one line each, nothing written --------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Files that break each rule of a layout, one fault each (on the second record). Text prompts
    elsewhere: pi_SFT's tokenizer has no chat template, which chat-message prompts need."""
    root = tmp_path_factory.mktemp("layouts")

    def jsonl(name, rows):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(root / name)

    (root / "empty").mkdir()
    return {
        "no_user": jsonl("no_user.jsonl", [{"prompt": "1+1=", "answer": "2"},
                                           {"prompt": [{"role": "system", "content": "be brief"}], "answer": "4"}]),
        "nested": jsonl("nested.jsonl", [{"data_source": "d", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}},
                                         {"data_source": "d", "prompt": "2+2=", "reward_model": {"style": "rule"}}]),
        "gsm8k": jsonl("gsm8k.jsonl", [{"question": "1+1=", "answer": "1+1 = 2\n#### 2"},
                                       {"question": "2+2=", "answer": "2+2 is four\n#### four"}]),
        "train": jsonl("train.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4),
        "val_other_schema": jsonl("val.jsonl", [{"problem": "3+3=", "solution": "6"}]),
        "empty_glob": str(root / "empty" / "*.parquet"),
    }


@pytest.mark.parametrize("case, flags, match", [
    ("no_user", [], r"no_user\.jsonl:2: the chat messages in field 'prompt' have no user turn \(roles: system\)"),
    ("nested", ["--answer-key", "reward_model.ground_truth"],
     r"nested\.jsonl:2: missing field 'reward_model\.ground_truth'"),
    ("gsm8k", ["--prompt-key", "question"], r"gsm8k\.jsonl:2: no number after '####' in the answer \(GSM8K format\)"),
    ("train", ["--val-data", "{val_other_schema}"], r"val\.jsonl:1: missing field 'prompt'"),
    ("empty_glob", [], r"--data = '.*empty/\*\.parquet' \(must be a file, a folder of .json/.jsonl/.parquet files or "
                       r"a glob matching files; here, .*empty/\*\.parquet: the pattern matches no \.jsonl, \.json, "
                       r"\.parquet file\)"),  # data_files' reason, not only what would be valid
])
def test_users_data_faults_stop_with_one_line_and_write_nothing(out_dir, sft, layouts, case, flags, match):
    flags = [f.format(**layouts) for f in flags]
    refused(out_dir, "--run-name", "layouts", "--model", sft, "--data", layouts[case], *flags, *QUICK, match=match)
    assert not (out_dir / "layouts").exists()


def test_wandb_asked_for_but_not_installed_stops_with_one_line(out_dir, monkeypatch):
    """wandb is optional (not in requirements.txt): without it --wandb-project says how to get it."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    refused(out_dir, "--run-name", "tracked", "--wandb-project", "vc-ppo", *QUICK,
            match=r"--wandb-project = 'vc-ppo' \(must be unset: wandb is not installed \(pip install wandb\)\)")
