"""What train.py keeps on disk, and how running it again, or resuming it, treats what is there.

The run directory, <out_dir>/<run_name>/:

    .lock           while a run uses the directory, its process (`locked`): a second run on it stops.
    config.json     the settings. Rerunning or resuming with settings that change the experiment
                    stops (`prepare`): only the run's length and how it runs may change.
    eval_sft.json   pi_SFT's held-out scores, computed once, and again for other held-out records
                    (`evaluate.evaluate_once`).
    metrics.jsonl   one row per PPO step, plus TensorBoard events (`MetricsLog`).
    checkpoint/     actor, critic, optimizers, schedulers and step (`save` / `resume`), and
                    checkpoint.old/, the one before it, kept in case the newest is damaged (a
                    --resume sets a damaged one aside as checkpoint.damaged/).
    actor_hf/       the final actor in Hugging Face format, tokenizer included (`export_actor`;
                    actor_hf_steps/step_<N>/ with --save-hf-every).
    value_pretrain  a link to the value-pretrained critic and its curve, a stage shared by the runs
                    that pretrain the same critic (`build_shared`, below).
    summary.json    pi_SFT's and the final policy's scores (train.py).

Cached stages (`build_once`): pi_SFT (<out_dir>/_shared/sft), the outcome reward model
(<out_dir>/_shared/orm) and value pretraining (<out_dir>/_shared/value_pretrain/<key>) are each
built once into a staging directory, with the settings they depend on in settings.json, then
renamed to their final path: a kill never leaves a directory that looks complete, and a later run
with other settings stops instead of reusing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
from pathlib import Path

import torch
from tqdm import tqdm

from support import checkpoints
import fsdp_utils
from support.config import Config, ConfigError, check_settings

STAGE_SETTINGS = "settings.json"  # in a cached stage's directory: what it was built with

# What may differ between a run directory's config.json and a rerun or --resume of it: the run's
# length, and how it runs (memory savers and throughput levers too, to resume a run that ran out of
# memory or time), and where the run directory is (it may move). No cached stage is keyed on them.
MAY_CHANGE = ("resume", "overwrite", "out_dir", "threads", "steps", "save_every", "save_hf_every", "eval_every", "grader_workers",
              "grader_timeout_s", "wandb_project", "micro_batch_size", "activation_checkpointing", "cpu_offload",
              "gpu_memory_utilization", "checkpoint_fraction", "micro_batch_tokens", "logprob_chunk_tokens",
              "compile_layers")
# What a rerun takes from the run directory instead of computing it again (or, metrics.jsonl, keeps up
# to the step it resumes from): never without the config.json that says which settings made it.
REUSED = ("eval_sft.json", "value_pretrain", "checkpoint", "checkpoint.tmp", "checkpoint.old", "checkpoint.damaged",
          "metrics.jsonl")


@contextlib.contextmanager
def locked(cfg: Config):
    """Hold the run's directory for the block: a second run on it (the same command twice, or a
    --resume while the first runs) stops at once, naming the process that holds it. The lock is a
    POSIX lock (fcntl.lockf) on <run_dir>/.lock, taken by rank 0: the kernel drops it when the
    process ends, however it ends, so the file a killed run leaves blocks nothing, and unlike
    flock's it is not inherited by the processes the run starts (grader workers, vLLM's). Taking
    it is the first write to the out-dir: one that cannot be written stops here, before any model
    loads. The file, and the directories made for it, go at the end: a refused command leaves the
    out-dir as it was."""
    run_dir, fd, refusal = os.path.join(cfg.out_dir, cfg.run_name), None, None
    path, made = os.path.join(run_dir, ".lock"), []
    if fsdp_utils.is_main():
        for parent in _parents(run_dir):
            if not os.path.isdir(parent):
                made.append(parent)
        try:
            os.makedirs(run_dir, exist_ok=True)
            fd, holder = _lock(path)
        except OSError as err:
            refusal = f"cannot write to {run_dir} ({err.strerror}); choose another --out-dir"
        else:
            if fd is None:
                refusal = (f"{run_dir} is in use by another run ({holder}); wait for it to end, or stop it "
                           f"(SIGTERM saves a checkpoint) and run again with --resume")
    try:
        refusal = fsdp_utils.from_main(refusal)
        if refusal:
            raise ConfigError(refusal)
        yield run_dir
    finally:
        if fd is not None:
            os.unlink(path)  # before the lock goes: a run that opened this file then locks a new one (`_lock`)
            os.close(fd)
        for directory in reversed(made):  # the ones this run made, if it left nothing in them
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _parents(path: str) -> list[str]:
    """`path` and the directories above it, outermost first."""
    path = os.path.abspath(path)
    return [*_parents(os.path.dirname(path)), path] if os.path.dirname(path) != path else [path]


def _lock(path: str) -> tuple[int | None, str]:
    """(a descriptor holding the lock on the file at `path`, "") or, when another process holds
    it, (None, which process that is). A lock taken on a file its holder has just removed (at its
    end) is taken again on the new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            os.close(fd)
            return None, f"process {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.ftruncate(fd, 0)  # the file a killed run left names it
                os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
                return fd, ""
        os.close(fd)


def check_settings_of(cfg: Config) -> str:
    """The run's directory, if what it holds was made with these settings (its config.json, see
    MAY_CHANGE); ConfigError if not, or if it holds outputs but no config.json to check them against."""
    run_dir = os.path.join(cfg.out_dir, cfg.run_name)
    saved = os.path.join(run_dir, "config.json")
    if os.path.exists(saved):
        check_settings(run_dir, read_json(saved, "restore it or choose another --run-name"), dataclasses.asdict(cfg),
                       ignore=MAY_CHANGE, remedy="give the settings in its config.json, choose another --run-name, "
                                                 "or delete it")
    elif reused := [name for name in REUSED if os.path.exists(os.path.join(run_dir, name))]:
        raise ConfigError(f"{run_dir} holds {', '.join(reused)} but no config.json, the settings "
                         f"{'they were' if len(reused) > 1 else 'it was'} made with; choose another --run-name or "
                         f"delete it")
    return run_dir


def check(cfg: Config) -> str:
    """The run's directory, read and not written: stops if its config.json holds other settings
    (see MAY_CHANGE), if it holds outputs but no config.json to check them against, if it holds
    checkpoints and neither --resume nor --overwrite says what to do with them, if it is finished but
    its checkpoints are gone and --overwrite does not say to train it again, or, with
    --resume, if its checkpoints are all damaged, if its metrics.jsonl is damaged, or if it would
    start past --steps. A refused command leaves the directory as it was."""
    run_dir = check_settings_of(cfg)
    saved_before = checkpoints.saved_checkpoints(os.path.join(run_dir, "checkpoint"))
    if saved_before and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"{run_dir} holds {saved_before[0]}: --resume to continue from it, --overwrite to start "
                          f"PPO over (replacing it and metrics.jsonl), or another --run-name")
    logged = os.path.join(run_dir, "metrics.jsonl")
    trained = os.path.exists(logged) and os.path.getsize(logged) > 0  # (--steps 0 finishes with no checkpoint)
    if finished(run_dir) and trained and not saved_before and not cfg.overwrite:  # checkpoints deleted to free the disk
        raise ConfigError(f"{run_dir} holds a finished run (summary.json) and no checkpoint to go on from: PPO "
                          f"would start over and replace its metrics.jsonl and actor_hf; --overwrite to train it "
                          f"again, or another --run-name")
    if cfg.resume and (found := checkpoints.latest_checkpoint(os.path.join(run_dir, "checkpoint"))):
        step = checkpoints.checkpoint_extra(found)["step"]
        if step + 1 > cfg.steps:
            raise ConfigError(f"{found} is at step {step}: {step + 1} trained, more than --steps {cfg.steps}")
        if os.path.exists(logged):
            logged_rows(logged)
    return run_dir


def read_json(path: str, remedy: str):
    """The JSON object in `path` (a file the run wrote); ConfigError naming the file when it is not one."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read().decode())
        if isinstance(value, dict):
            return value
        reason = f"a JSON {type(value).__name__}, not an object"
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        reason = f"{type(err).__name__}: {err}"
    raise ConfigError(f"{path} is damaged ({reason[:200]}); {remedy}")


def prepare(cfg: Config) -> str:
    """The run's directory, checked against what is already there, with config.json written.
    Called once every input has been checked: a failed start must not block its corrected rerun."""
    run_dir = check(cfg)
    saved = os.path.join(run_dir, "config.json")
    os.makedirs(run_dir, exist_ok=True)
    fsdp_utils.barrier()  # every rank has read the old config.json before rank 0 replaces it
    if fsdp_utils.is_main():
        write_json(saved, dataclasses.asdict(cfg))
    return run_dir


def finished(run_dir) -> bool:
    """True once train.py has written summary.json, its last act: the checkpoint there is the final policy."""
    return os.path.isfile(os.path.join(run_dir, "summary.json"))


def json_safe(obj):
    """`obj` with every NaN or inf float replaced by None: strict JSON readers reject bare NaN.
    (Explained variance is undefined, NaN, on a batch whose returns are all equal.)"""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str, obj) -> None:
    write_whole(path, json.dumps(json_safe(obj), indent=2, allow_nan=False))


def write_whole(path: str, text: str) -> None:
    """Written aside and swapped in: a kill mid-write leaves the old file or the new one, never a
    part the next run cannot read."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def build_once(path: str, settings: dict, build, owner: str, remedy: str = "delete it to build it again") -> bool:
    """A cached stage at `path`: reused when it exists (after checking its settings.json against
    `settings`), else `build(staging)` writes it into `staging`, `<path>.partial-<owner>` (the run
    building it: two runs building one stage at once never mix their files, and a killed build's
    rerun finds its own leftovers), which then gets settings.json and its final name. True if built
    now. `build` runs on every rank (a collective export needs them all; a stage that one rank
    builds checks the rank itself, and the others wait for it as long as it takes:
    `fsdp_utils.wait_patiently`); rank 0 renames. A build that finds `path` taken when it ends
    (another run built it meanwhile) is dropped, as are the leftovers of an owner's killed build
    once another run has built the stage."""
    staging = staging_path(path, owner)
    # Every rank looks before any builds: ranks that decided apart would wait in different collectives.
    if fsdp_utils.any_rank(os.path.exists(path)):
        check_stage(path, settings, remedy)
        if fsdp_utils.is_main():
            shutil.rmtree(staging, ignore_errors=True)  # a value pretraining's checkpoint: the critic and Adam's state
        return False
    # A killed build's leftovers stay: value pretraining resumes from its checkpoint there, and
    # every file a build writes is written whole.
    os.makedirs(staging, exist_ok=True)
    build(staging)
    if fsdp_utils.is_main():
        write_json(os.path.join(staging, STAGE_SETTINGS), settings)  # in before the final name
        try:
            os.rename(staging, path)  # atomic; fails if another build named it first
        except OSError:
            if not os.path.isdir(path):
                raise
            shutil.rmtree(staging)
    fsdp_utils.wait_patiently()  # for as long as rank 0 builds alone (pi_SFT)
    return True


def staging_path(path: str, owner: str) -> str:
    """Where `owner` (a run's name) builds the stage `path` before it takes that name (`build_once`)."""
    return f"{path}.partial-{owner}"


def build_shared(cfg, link: str, settings: dict, build, shared: str | None = None) -> bool:
    """A stage that every run with the same `settings` shares, e.g. value pretraining, which the
    runs of one seed in a lambda sweep repeat bit for bit. It is built once (`build_once`) into
    <out_dir>/_shared/<name of link>/<hash of settings>, and `link`, in the run directory, points
    there (a relative link: the out-dir can move). Each run stages its own build, so two runs
    building it at once never mix their files, and a killed one resumes its own. True if built now.
    A run resumed at another world size keeps the stage it linked (PPO restores the critic from
    its own checkpoint; `resume` notes that the rest samples differently). `shared`: where to build it
    instead, a stage whose settings.json may record more settings than `settings` (an older key)."""
    if check_link(link, settings):  # linked by an earlier start of this run
        return False
    shared = shared or shared_path(cfg, os.path.basename(link), settings)
    os.makedirs(os.path.dirname(shared), exist_ok=True)
    built = build_once(shared, settings, build, owner=cfg.run_name)
    if fsdp_utils.is_main():
        os.symlink(os.path.relpath(shared, os.path.dirname(link)), link)
    fsdp_utils.barrier()
    return built


def check_link(link: str, settings: dict) -> bool:
    """Whether a run's `link` to a shared stage is there (on any rank), once checked: ConfigError when
    the stage it points to is gone, or was built with other `settings` than this run's."""
    if os.path.islink(link) and not os.path.exists(link):
        raise ConfigError(f"{link} points to {os.readlink(link)}, which is gone; delete the link to build it again")
    # Every rank looks before rank 0 links it (build_shared): a rank that looked after it would skip the
    # barrier the others wait in, and train on alone (a deadlock).
    if not fsdp_utils.any_rank(os.path.lexists(link)):
        return False
    check_stage(link, settings, ignore=("world_size",))
    return True


def shared_path(cfg, name: str, settings: dict) -> str:
    """Where `build_shared` keeps the stage `name` built with `settings`."""
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cfg.out_dir, "_shared", name, key)


def input_files(cfg) -> dict[str, str]:
    """A digest of the contents of every file in --model's folder (`file_digest`: sampled) and of
    the data files of --data and --val-data (whole), for the settings of a stage built from them: a
    model or data written again at the same path (SFT run again into the same folder) then no longer
    passes for the one the stage was built from, while a copy (a node's own) still does. Rank 0's
    on every rank. Empty for the built-in task and its pi_SFT, whose settings say what they are."""
    from support.data import data_files

    model = sorted(p for p in Path(cfg.model).iterdir() if p.is_file()) if cfg.model and Path(cfg.model).is_dir() else []
    data = [p for spec in ([cfg.data] if cfg.data else []) + list(cfg.val_data or ()) for p in data_files(spec)]
    digests = ({str(p): file_digest(p, pieces=16) for p in model} | {str(p): file_digest(p) for p in data}
               if fsdp_utils.is_main() else None)
    return fsdp_utils.from_main(digests)


def file_digest(path: Path, pieces: int | None = None, piece_bytes: int = 1 << 16) -> str:
    """sha256 of a file's size and contents; with `pieces`, of that many pieces spread over it
    (the whole file when smaller): a few milliseconds for a model's tens of GB of weights, and a
    retrained model differs in every piece."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        if pieces is None or size <= pieces * piece_bytes:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        else:
            for i in range(pieces):
                f.seek(i * (size - piece_bytes) // (pieces - 1))
                digest.update(f.read(piece_bytes))
    return digest.hexdigest()[:16]


# Stage settings recorded since a later version: a stage built before holds none, and is not refused for it.
RECORDED_LATER = ("input_files",)


def check_stage(path: str, settings: dict, remedy: str = "delete it to build it again", ignore=()) -> None:
    """Stop unless the cached stage at `path` records, in its settings.json, that it was built with
    `settings`. Without that file (a directory made by hand, or by an older version) it cannot be
    told from another experiment's, so it is refused, never taken as it is."""
    saved = os.path.join(path, STAGE_SETTINGS)
    if not os.path.exists(saved):
        raise ConfigError(f"{path} holds no {STAGE_SETTINGS} with the settings it was built with, so it cannot "
                          f"be checked against this run's; {remedy}")
    stored = read_json(saved, remedy)
    unrecorded = tuple(k for k in RECORDED_LATER if k not in stored)
    check_settings(path, stored, settings, ignore=(*ignore, *unrecorded), remedy=remedy)


def save(cfg, run_dir: str, step: int, models: dict, optimizers: dict, schedulers: list) -> None:
    checkpoints.save_checkpoint(
        os.path.join(run_dir, "checkpoint"), models, optimizers,
        {"step": step, "schedulers": [s.state_dict() for s in schedulers], "config": dataclasses.asdict(cfg),
         "world_size": fsdp_utils.world_size()},
    )


def resume(cfg, run_dir: str, models: dict, optimizers: dict, schedulers: list) -> int:
    """With --resume, restore the newest checkpoint that reads back in place (saying which damaged
    one it passes over); the step to start from."""
    ckpt = os.path.join(run_dir, "checkpoint")
    if cfg.resume and (restored := checkpoints.restore_latest(ckpt, models, optimizers)):
        found, extra = restored  # start <= cfg.steps: see check
        start, saved_world, world = extra["step"] + 1, extra.get("world_size", 1), fsdp_utils.world_size()
        for scheduler, state in zip(schedulers, extra["schedulers"]):
            scheduler.load_state_dict(state)
        if fsdp_utils.is_main():
            tqdm.write(f"resumed from {found} at step {start}")
            if saved_world != world:  # each rank samples its own share
                tqdm.write(f"note: world size {world}, checkpoint written at {saved_world}: the rest of the run "
                           f"samples differently than the uninterrupted run would have")
        return start
    if ((found := checkpoints.saved_checkpoints(ckpt)) or cfg.resume) and fsdp_utils.is_main():  # found: --overwrite
        tqdm.write(f"{'found' if found else 'no checkpoint at'} {ckpt}: PPO starts at step 0"
                   f"{', removing it' if found else ''}, and replaces {run_dir}/metrics.jsonl")
    if cfg.overwrite:  # nothing of the replaced run stays to be resumed from, or taken for this one's end
        checkpoints.remove_checkpoint(ckpt)
        if fsdp_utils.is_main():
            for name in ("summary.json", "actor_hf", "actor_hf_steps"):
                path = os.path.join(run_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else Path(path).unlink(missing_ok=True)
        fsdp_utils.barrier()
    return 0


def last_checkpoint(run_dir: str) -> str:
    """The newest checkpoint a stopped run left, as a sentence."""
    found = checkpoints.saved_checkpoints(os.path.join(run_dir, "checkpoint"))
    return f"Last checkpoint: {found[0]}." if found else "No checkpoint yet."


def export_actor(cfg, actor, tokenizer, path: str) -> None:
    """The actor as a Hugging Face checkpoint with its tokenizer, which `from_pretrained`, vLLM and
    evaluation harnesses open as they are: streamed from the shards (`checkpoints.export_hf_checkpoint`,
    a collective: every rank calls it), in bf16 when the run computes in bf16, else fp32."""
    if fsdp_utils.is_main():
        os.makedirs(os.path.dirname(path), exist_ok=True)
    checkpoints.export_hf_checkpoint(actor, tokenizer, path, dtype=torch.bfloat16 if cfg.mixed_precision else None)


def snapshot_due(cfg, steps_done: int) -> bool:
    """--save-hf-every: a snapshot after every N steps but the last (the final actor is actor_hf)."""
    return bool(cfg.save_hf_every) and steps_done % cfg.save_hf_every == 0 and steps_done < cfg.steps


def snapshot_path(run_dir: str, steps_done: int) -> str:
    return os.path.join(run_dir, "actor_hf_steps", f"step_{steps_done}")


def export_into_run(cfg, actor, tokenizer, run_dir: str, path: str) -> None:
    """`export_actor`; a failed write says what the run kept, and that --resume writes it again."""
    try:
        export_actor(cfg, actor, tokenizer, path)
    except checkpoints.CheckpointError as err:
        raise checkpoints.CheckpointError(f"{err}. {last_checkpoint(run_dir)} Resume with the same command "
                                          f"and --resume to write it again") from None


class MetricsLog:
    """metrics.jsonl + TensorBoard (+ Weights & Biases with `wandb_project`), written by rank 0; a
    resumed run first drops the rows after its checkpoint (`logged_rows`; wandb keeps what it was sent)."""

    def __init__(self, run_dir: str, keep_up_to_step: int, wandb_project: str | None = None,
                 config: dict | None = None):
        self.path, self.enabled = os.path.join(run_dir, "metrics.jsonl"), fsdp_utils.is_main()
        self.wandb = None
        if not self.enabled:
            return
        if wandb_project is not None:  # config.validate checked that it imports
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(os.path.normpath(run_dir)),
                                    dir=run_dir, config=config)
        from torch.utils.tensorboard import SummaryWriter

        rows = []
        if keep_up_to_step >= 0 and os.path.exists(self.path):
            rows, torn = logged_rows(self.path)
            if torn is not None:
                tqdm.write(f"{self.path}: dropped its last line, cut short when the run stopped ({torn[:60]!r})")
            rows = [(step, line) for step, line in rows if step <= keep_up_to_step]
        # A kill cuts only rows after the checkpoint: rows missing before it (a log cut short by hand or
        # by a full disk, or deleted) cannot be written again, and the run goes on without them, said.
        missing = sorted(set(range(keep_up_to_step + 1)) - {step for step, _ in rows})
        if missing:
            tqdm.write(f"{self.path}: no rows for {len(missing)} of the steps the checkpoint covers (steps "
                       f"{missing[0]} to {missing[-1]}): the log goes on from step {keep_up_to_step + 1} without them")
        write_whole(self.path, "".join(line for _, line in rows))  # a kill mid-write keeps the old log
        self.tb = SummaryWriter(run_dir, purge_step=keep_up_to_step + 1)  # drop the replayed steps

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(json_safe({"step": step, **metrics}), allow_nan=False) + "\n")
        for key, value in metrics.items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()
        if self.wandb is not None:  # undefined values (NaN) are left out, as wandb has no null
            self.wandb.log({k: v for k, v in json_safe(metrics).items() if v is not None}, step=step)

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def logged_rows(path: str) -> tuple[list[tuple[int, str]], str | None]:
    """The rows of a metrics.jsonl as (step, line), and its last line if a kill cut it short (not a
    row, no newline): that one is dropped on resume. Any other line that is not a row is damage
    that dropping would hide: ConfigError naming the line."""
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            text = line.decode()
            step = json.loads(text)["step"]
            if not isinstance(step, int):
                raise TypeError(f"step {step!r}")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            if number == len(lines) and not line.endswith(b"\n") and line.isascii() and line.startswith(b"{"):
                return rows, line.decode()  # how a row cut short looks: JSON rows are written in ASCII
            raise ConfigError(f"{path}:{number}: not a metrics row ({type(err).__name__}: {str(err)[:100]}); "
                              f"repair or delete that line to resume, or run with --overwrite instead of "
                              f"--resume to start again from step 0") from None
        rows.append((step, text if text.endswith("\n") else text + "\n"))
    return rows, None
