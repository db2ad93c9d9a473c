"""The paper's diagnostics, one script each (README, "Analysis"). Shared here: the command line of
the scripts, which turns a bad flag, input or setting into a one-line message."""
import sys

import tyro


def run_cli(main, args_type, description: str, with_train_flags: bool = False):
    """main(the script's own Args[, train.py's flags]) from the command line. With train.py's flags:
    flags before a `--` are the script's, the ones after it go to `config.parse_config`, so the
    script sees the run exactly as train.py does. Bad input (a ValueError, such as config.ConfigError
    and data.DataError, or a missing file) ends the process with `error: ...`; a signal (Ctrl-C, a
    scheduler's SIGTERM) with a line and its exit code, not a traceback."""
    argv = sys.argv[1:]
    cut = argv.index("--") if with_train_flags and "--" in argv else len(argv)
    args = tyro.cli(args_type, args=argv[:cut], description=description)
    try:
        return main(args, argv[cut + 1 :]) if with_train_flags else main(args)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # Ctrl-C outside a grid: whatever finished whole is kept
        print("interrupted; the same command reuses what finished", file=sys.stderr)
        sys.exit(130)
    except BaseException as err:
        preemption = sys.modules.get("support.preemption")  # imported by whatever can raise Preempted
        if preemption and isinstance(err, preemption.Preempted):  # a grid stopped on a signal; its line is printed
            sys.exit(err.exit_code)
        raise
