"""What keeps a run's work safe when it is cut short, checked where the end-to-end faults tests
(test_faults.py) cannot reach: a kill at one exact instant of a save or a cached stage's build, and a
signal repeated after the window in which it counts as the same request. In process, fast."""

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from support import checkpoints
from support import preemption
from support import rundir
from support.config import ConfigError
from test_train import micro_config


def test_a_signal_repeated_after_the_repeat_window_stops_at_once_and_one_within_it_does_not(monkeypatch):
    """A second Ctrl-C or scancel after REPEAT_S is a user's "stop now, without a checkpoint": the
    process must die of it, not wait for the step to end. Within REPEAT_S it is the first request
    forwarded again (torchrun), and changes nothing."""
    now, sent = [100.0], []
    monkeypatch.setattr(preemption, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(preemption, "os", SimpleNamespace(kill=lambda pid, signum: sent.append(signum),
                                                          getpid=os.getpid))
    with preemption.handled(lambda: ""), preemption.deferred():
        preemption._handle(signal.SIGTERM, None)
        now[0] += preemption.REPEAT_S / 2
        preemption._handle(signal.SIGTERM, None)
        assert sent == [] and preemption.requested()
        now[0] += preemption.REPEAT_S
        preemption._handle(signal.SIGTERM, None)
        assert sent == [signal.SIGTERM]  # sent again to itself, with the default action: the process ends
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_stage_killed_before_its_settings_are_written_is_not_left_under_its_final_name(tmp_path, monkeypatch):
    """A cached stage takes its final name only once its settings.json is in: a stage killed before
    that, found under its final name, would be refused on every later run ("holds no settings.json")
    instead of being built again."""
    path, build = str(tmp_path / "stage"), lambda staging: Path(staging, "weights").write_text("w")

    def killed(file, obj):
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        rundir.build_once(path, {"a": 1}, build, owner="r")
    monkeypatch.undo()
    assert not os.path.exists(path)
    assert rundir.build_once(path, {"a": 1}, build, owner="r")  # the rerun builds it
    assert json.loads(Path(path, rundir.STAGE_SETTINGS).read_text()) == {"a": 1}


def test_a_save_after_one_killed_between_its_renames_keeps_that_checkpoint_as_the_one_before(tmp_path):
    """A save killed after moving checkpoint/ to checkpoint.old/ but before renaming checkpoint.tmp/
    leaves its newest checkpoint as checkpoint.tmp/ (which --resume restores). The next save must
    keep it as checkpoint.old/, not delete it as an incomplete save's leftovers."""
    model = torch.nn.Linear(2, 2)
    models, optimizers = {"actor": model}, {"actor": torch.optim.Adam(model.parameters())}
    path = str(tmp_path / "checkpoint")
    for step in (2, 3):
        checkpoints.save_checkpoint(path, models, optimizers, {"step": step})
    os.replace(path, path + ".tmp")  # the save of step 3, killed between its two renames
    checkpoints.save_checkpoint(path, models, optimizers, {"step": 4})
    assert [checkpoints.checkpoint_extra(c)["step"] for c in checkpoints.saved_checkpoints(path)] == [4, 3]


def test_resume_restores_the_learning_rate_of_a_warm_up_and_the_optimizer_state(tmp_path):
    """Every resume test ran at a constant learning rate (--lr-warmup-steps 0): a scheduler or an
    optimizer learning rate left as built would have gone unseen. After 2 of 4 warm-up steps the rate
    is 0.1 x 3/4."""
    def built():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))

    cfg = micro_config(tmp_path, "--resume")
    model, optimizer, scheduler = built()
    for _ in range(2):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    rundir.save(cfg, str(tmp_path), 1, {"actor": model}, {"actor": optimizer}, [scheduler])
    again, optimizer_again, scheduler_again = built()
    assert rundir.resume(cfg, str(tmp_path), {"actor": again}, {"actor": optimizer_again}, [scheduler_again]) == 2
    assert scheduler_again.get_last_lr() == scheduler.get_last_lr() == [pytest.approx(0.075)]
    assert optimizer_again.param_groups[0]["lr"] == pytest.approx(0.075)
    for p, q in zip(model.parameters(), again.parameters()):
        assert p.equal(q) and optimizer.state[p]["exp_avg_sq"].equal(optimizer_again.state[q]["exp_avg_sq"])


def test_a_first_save_killed_mid_write_is_no_checkpoint_to_resume_or_refuse_a_rerun_for(tmp_path):
    """A run killed while writing its first checkpoint leaves an incomplete checkpoint.tmp/ (no
    extra.pt, written last). That is not a checkpoint: its rerun without --resume starts, rather
    than being told to --resume from it or --overwrite it."""
    cfg = micro_config(tmp_path, "--run-name", "r")
    run_dir = Path(rundir.prepare(cfg))
    (run_dir / "checkpoint.tmp").mkdir()
    (run_dir / "checkpoint.tmp" / "__0_0.distcp").write_bytes(b"\0" * 100)
    assert checkpoints.saved_checkpoints(str(run_dir / "checkpoint")) == []
    assert rundir.check(cfg) == str(run_dir)


def test_removing_a_checkpoint_leaves_none_of_its_names_a_damaged_one_set_aside_included(tmp_path):
    """remove_checkpoint (--overwrite, and value pretraining once its critic is exported) deletes every
    name a save or a resume left: checkpoint/, .old/, an incomplete .tmp/, and the <name>.damaged/
    that restore_latest set aside (a whole model and its optimizer states for nothing)."""
    model = torch.nn.Linear(2, 2)
    models, optimizers = {"actor": model}, {"actor": torch.optim.Adam(model.parameters())}
    path = str(tmp_path / "checkpoint")
    for step in (1, 2):
        checkpoints.save_checkpoint(path, models, optimizers, {"step": step})
    os.replace(path + ".old", path + ".old.damaged")  # as restore_latest sets a damaged one aside
    os.makedirs(path + ".tmp")  # a save killed mid-write
    checkpoints.remove_checkpoint(path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag, value", [("--kl-coef", "0.1"), ("--entropy-coef", "0.01"), ("--ppo-epochs", "2")])
def test_a_rerun_that_changes_the_ppo_loss_is_refused(tmp_path, flag, value):
    """Only the run's length and how it runs may change on a rerun or --resume (rundir.MAY_CHANGE):
    a run whose loss changed mid-way would log the steps of two experiments as one."""
    rundir.prepare(micro_config(tmp_path, "--run-name", "r"))
    with pytest.raises(ConfigError, match=rf"r was made with other settings \({flag} "):
        rundir.prepare(micro_config(tmp_path, "--run-name", "r", "--resume", flag, value))


def test_the_signal_handlers_of_the_caller_are_given_back_when_the_block_ends():
    """A program that calls train.main (a sweep, a notebook) keeps its own handlers after it: one
    left installed would turn the caller's next Ctrl-C into a Preempted raised far from any run."""
    own = {s: (lambda signum, frame: None) for s in preemption.SIGNALS}
    before = {s: signal.signal(s, handler) for s, handler in own.items()}
    try:
        with preemption.handled(lambda: ""):
            assert all(signal.getsignal(s) is preemption._handle for s in own)
        assert {s: signal.getsignal(s) for s in own} == own
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_an_answer_of_true_or_false_is_a_bad_record_not_graded_as_the_text_true(tmp_path):
    """JSON true is an int to Python's isinstance: kept, its gold answer would be "True", which no
    response can match, so the record would only ever teach a reward of 0."""
    from support.data import DataError, load_records
    from test_data import GOOD, char_tokenizer, write_jsonl

    path = write_jsonl(tmp_path / "d.jsonl", GOOD + [{"prompt": "is 2 even?", "answer": True}])
    with pytest.raises(DataError, match=r"d\.jsonl:4: the answer in field 'answer' is a bool"):
        load_records(path, char_tokenizer())


def test_an_export_killed_mid_way_leaves_no_file_in_the_next_export(tmp_path):
    """A killed export leaves actor_hf.tmp/; the next one must start it empty: a stale shard index
    beside a one-file export sends every loader after shards that are not there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    path = tmp_path / "actor_hf"
    (tmp_path / "actor_hf.tmp").mkdir()
    (tmp_path / "actor_hf.tmp" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    checkpoints.export_hf_checkpoint(model, None, str(path))
    assert "model.safetensors.index.json" not in os.listdir(path)
    assert LlamaForCausalLM.from_pretrained(path).model.embed_tokens.weight.equal(model.model.embed_tokens.weight)


def test_the_run_lock_is_taken_on_the_file_left_at_its_path_and_its_directories_go_when_unused(tmp_path, monkeypatch):
    """`rundir.locked`: a run that opened .lock just before its holder removed it (the holder's end)
    must lock the file at the path, not the removed one, or a third run would run beside it. What the
    lock made (the file, the out-dir's new directories) is gone after a run that wrote nothing there."""
    import fcntl

    cfg = micro_config(tmp_path / "new" / "root", "--run-name", "r")
    run_dir = tmp_path / "new" / "root" / "r"
    real_lockf, calls = fcntl.lockf, []

    def holder_ends_first(fd, how):  # the file this run opened is unlinked before its lock is taken
        calls.append(fd)
        if len(calls) == 1:
            os.unlink(run_dir / ".lock")
        return real_lockf(fd, how)

    monkeypatch.setattr(rundir.fcntl, "lockf", holder_ends_first)
    with rundir.locked(cfg) as held:
        assert held == str(run_dir) and len(calls) == 2  # taken again, on a new file
        assert (run_dir / ".lock").read_text().split()[0] == str(os.getpid())
    assert not (tmp_path / "new").exists()  # nothing was written: the out-dir is as it was

    with rundir.locked(cfg):
        (run_dir / "config.json").write_text("{}")
    assert os.listdir(run_dir) == ["config.json"]  # the lock file goes, the run's outputs stay
