"""The paper's diagnostics, one script each (README, "Analysis"). Shared here: the command line of
the scripts that also take train.py's flags."""
import sys


def cli_with_train_flags(args_type, description: str):
    """(the script's own Args, train.py's flags): flags before a `--` are the script's, the ones after
    it go to `config.parse_config`, so the script sees the run exactly as train.py does."""
    import tyro

    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    return tyro.cli(args_type, args=argv[:cut], description=description), argv[cut + 1 :]
