"""The GPU's decoupled GAE kernel (gae_triton.py) on CPU tensors, in Triton's interpreter, for
tests/test_gae_triton.py. A process of its own: the interpreter fails ("Cannot call @triton.jit'd
outside of the scope of a kernel") in a process that imported torch._dynamo before the kernel was
built, as the rest of the suite does. Writes rank0.json into argv[1]."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before Triton builds the kernel

import torch  # noqa: E402

import gae  # noqa: E402
from support import gae_fast  # noqa: E402
from common import write_result  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from test_gae import make_batch  # noqa: E402

kernel = gae_fast.triton_kernel()
kernel.BLOCK = 16  # a few dozen tokens then cross blocks (the interpreter is slow)
result = {"equal": {}, "rejected": {}}
per_row = torch.tensor([0.0, 0.5, 0.9, 1.0], dtype=torch.float64)
# (lambda_actor, lambda_critic): VC-PPO's critic at 1.0, and below it (plain PPO's 0.95, one per
# response), where the critic's targets bootstrap from V and decay as the advantages do.
for length in (1, 16, 37):
    for lam_actor, lam_critic in ((0.0, 1.0), (0.95, 1.0), ("per-row", 1.0), (0.95, 0.95), (0.9, "per-row")):
        rewards, values, mask = make_batch(4, length, seed=length)
        lams = [per_row if lam == "per-row" else lam for lam in (lam_actor, lam_critic)]
        want = gae.decoupled_gae(rewards, values, mask, 0.99, *lams)  # the compiled CPU loop
        for name, m in (("float", mask), ("bool", mask.bool())):
            got = kernel.lambda_returns(rewards, values, m, 0.99, *lams)
            result["equal"][f"T={length} lam={lam_actor},{lam_critic} mask={name}"] = max(
                (g - w).abs().max().item() for g, w in zip(got, want))

rewards, values, mask = make_batch(3, 20, seed=1)
nan, holed, half = values.clone(), mask.clone(), mask.clone()
nan[1, -1] = float("nan")  # on padding: the CPU loop rejects it too
holed[0, 0], half[0, -1] = 0.0, 0.5
for name, (v, m) in {"good": (values, mask), "nan": (nan, mask), "hole": (values, holed),
                     "half": (values, half)}.items():
    result["rejected"][name] = kernel.lambda_returns(rewards, v, m, 1.0, 0.9, 1.0) is None
in_range = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
for name, lam in {"lam_above": torch.tensor([0.5, 1.5, 0.5]), "lam_nan": torch.tensor([0.5, 0.5, float("nan")])}.items():
    lam = lam.double()
    result["rejected"][name] = (kernel.lambda_returns(rewards, values, mask, 1.0, lam, 1.0) is None,
                                kernel.lambda_returns(rewards, values, mask, 1.0, 0.9, lam) is None)
result["rejected"]["lam_in_range"] = kernel.lambda_returns(rewards, values, mask, 1.0, in_range, in_range) is None

# gae.py's dispatch, CPU tensors standing in for CUDA ones
gae_fast.kernel_applies, gae_fast.compiled_loop_applies = gae_fast.compiled_loop_applies, lambda *tensors: False
calls = []
launch = kernel.lambda_returns
kernel.lambda_returns = lambda *args: calls.append(1) or launch(*args)
got = gae.compute_gae(rewards, values, mask, 1.0, 0.9)
result["dispatch_calls"] = len(calls)
result["dispatch_error"] = max((g - w).abs().max().item()  # the advantages and the returns
                               for g, w in zip(got, gae.gae_reference(rewards, values, mask, 1.0, 0.9)))
try:
    gae.compute_gae(rewards, nan, mask, 1.0, 0.9)
    result["bad_input_message"] = None
except ValueError as err:
    result["bad_input_message"] = str(err)
try:  # the kernel alone checks a per-response lambda here; the message still names it
    gae.decoupled_gae(rewards, values, mask, 1.0, 0.9, torch.tensor([0.5, 1.5, 0.5]))
    result["bad_lambda_message"] = None
except ValueError as err:
    result["bad_lambda_message"] = str(err)
result["dispatch_calls_with_bad_lambda"] = len(calls)
try:  # the same through the single-lambda API, which names it "lam"
    gae.compute_gae(rewards, values, mask, 1.0, torch.tensor([0.5, float("nan"), 0.5]))
    result["bad_single_lambda_message"] = None
except ValueError as err:
    result["bad_single_lambda_message"] = str(err)
result["dispatch_calls_with_bad_single_lambda"] = len(calls)
write_result(sys.argv[1], 0, result)
