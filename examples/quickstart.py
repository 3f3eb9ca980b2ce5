"""An example of the Python API, runnable as written:

python examples/quickstart.py                               # one process
shardwise run --nproc 2 examples/quickstart.py              # our launcher
torchrun --nproc-per-node 2 examples/quickstart.py          # torchrun
"""

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.data.datasets import digits
from shardwise.nn.models import MLP

rt = sw.init()  # process group from torchrun's environment; gloo on CPU, NCCL on CUDA
torch.manual_seed(0)
model, opt = sw.prepare(
    MLP([64, 128, 10]), sw.DDP(bucket_mb=25), optimizer=torch.optim.AdamW, lr=3e-3
)
dataset = digits().train
for epoch in range(5):
    loader = sw.data.loader(dataset, batch_size=32, shuffle=True, seed=epoch)  # this rank's shard
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
state = sw.full_state_dict(model)  # the complete state dict, on every rank
if rt.rank == 0:
    print(
        f"world {rt.world_size}: final loss {loss.item():.4f}, {len(state)} tensors in state dict"
    )
sw.shutdown()
