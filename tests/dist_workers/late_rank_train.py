"""train.py with its arguments, except that rank 1 reaches value pretraining's shared stage
(`rundir.build_shared`) a few seconds after rank 0: the timing under which the second run of a
lambda sweep hung under torchrun (issue 29, item 1), made certain instead of likely."""

import os
import runpy
import sys
import time

import value_pretrain

if os.environ.get("RANK") == "1":
    shared = value_pretrain.build_shared

    def late(*args, **kwargs):
        time.sleep(3)
        return shared(*args, **kwargs)

    value_pretrain.build_shared = late
train = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train.py")
sys.argv = [train, *sys.argv[1:]]
runpy.run_path(train, run_name="__main__")
