"""A user's own training loop with shardwise's parts and no trainer: `sw.prepare`, the
checkpointer, the non-finite policy and the watchdog (run by tests/test_own_loop.py under
`shardwise run`). Rank 1 may be told to die (SIGKILL) or to hang at a step."""

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

import shardwise as sw

parser = argparse.ArgumentParser()
parser.add_argument("--run-dir", required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--kill-at", type=int, default=0)
parser.add_argument("--hang-at", type=int, default=0)
args = parser.parse_args()

rt = sw.init(timeout_s=300)  # the backend's own timeout: far beyond the watchdog's
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(200, 13, generator=g), torch.randint(0, 3, (200,), generator=g))
model = nn.Sequential(nn.Linear(13, 17), nn.ReLU(), nn.Dropout(0.1), nn.Linear(17, 3))
model, opt = sw.prepare(model, sw.DDP(), optimizer=torch.optim.AdamW, lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
loader = sw.data.loader(data, batch_size=8, shuffle=True, seed=0)

checkpointer = sw.Checkpointer(args.run_dir, model, opt, scheduler, keep=2)
policy = sw.NonFinitePolicy("skip", max_bad_steps=3)
watchdog = sw.Watchdog(rt.rank, rt.world_size, timeout_s=3.0, report_dir=args.run_dir).start()
start, extra = checkpointer.resume()
if extra is not None:
    loader.load_state_dict(extra["loader"])


def batches():
    while True:
        yield from loader


feed = batches()
for step in range(start + 1, args.steps + 1):
    watchdog.step = step
    if step == args.kill_at:
        # The premise: the checkpoint saved before is complete when rank 1 dies (written in the
        # background, it once was not yet, three steps later on a loaded CI machine).
        checkpointer.wait()
        if rt.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    if rt.rank == 1 and step == args.hang_at:
        time.sleep(3600)  # alive, but never in the step's all-reduce
    x, y = next(feed)
    loss = sw.train_step(model, x, y, F.cross_entropy)
    if policy.after_step(step, policy.check(model, loss)):
        opt.step()
    opt.zero_grad()
    scheduler.step()
    if step % 4 == 0:
        checkpointer.save(step, extra={"loader": loader.state_dict()})

checkpointer.close()
watchdog.stop()
state = sw.full_state_dict(model)
if rt.is_main:
    save_file({k: v.contiguous() for k, v in state.items()}, f"{args.run_dir}/final.safetensors")
sw.shutdown()
