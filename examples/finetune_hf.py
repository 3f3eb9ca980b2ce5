"""Fine-tune a Hugging Face causal LM from a local folder, its embeddings frozen, under ZeRO-3 on
two ranks; run it again and it resumes where it stopped.

    shardwise run --nproc 2 examples/finetune_hf.py --run-dir runs/finetune
    shardwise run --nproc 2 examples/finetune_hf.py --run-dir runs/finetune --steps 60  # resumes
    shardwise export runs/finetune/checkpoints/step-000000060 runs/finetuned --hf

The "pretrained" folder is any `save_pretrained` output (config.json and safetensors, one file
or sharded); where --model-dir holds none, a small Llama is made there first (nothing can be
downloaded here). The model is built on the meta device and each rank reads only its own
slices of the weights (`sw.HFWeights`): no rank ever holds the whole model. The data: the
bundled Genesis text, one byte per token.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import Dataset

import shardwise as sw
from shardwise.job_sections import PACKAGE_DATA

parser = argparse.ArgumentParser()
parser.add_argument("--run-dir", required=True)
parser.add_argument("--model-dir", default="runs/tiny-llama-pretrained")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--save-every", type=int, default=10)
args = parser.parse_args()
transformers.logging.set_verbosity_error()

rt = sw.init()
model_dir = Path(args.model_dir)
if rt.is_main and not (model_dir / "config.json").is_file():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir, max_shard_size="200KB")
if dist.is_initialized():
    dist.barrier()  # the folder is complete before any rank reads it


class ByteWindows(Dataset):
    """Windows of 64 bytes of a text: the model learns to continue it."""

    def __init__(self, path: Path, length: int = 64) -> None:
        self.tokens = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        self.length = length

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.length : (i + 1) * self.length]


config = transformers.AutoConfig.from_pretrained(model_dir)
with sw.empty_parameters():  # shapes only: the weights come from the folder, shard by shard
    model = transformers.AutoModelForCausalLM.from_config(config)
model.get_input_embeddings().weight.requires_grad_(False)  # frozen: no gradient, no Adam state
weights = sw.HFWeights(model_dir, model.base_model_prefix)
model, opt = sw.prepare(model, sw.ZeRO(stage=3), lr=1e-3, source=weights)

loader = sw.data.loader(ByteWindows(PACKAGE_DATA / "genesis_kjv.txt"), batch_size=8, seed=0)
checkpointer = sw.Checkpointer(args.run_dir, model, opt, keep=2)
start, extra = checkpointer.resume()  # (0, None) the first time
if extra:
    loader.load_state_dict(extra["loader"])
batches = iter(loader)
for step in range(start + 1, args.steps + 1):
    ids = next(batches)
    loss = model(input_ids=ids, labels=ids).loss  # the Hugging Face idiom, unchanged
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rt.is_main and (step % 10 == 0 or step == start + 1):
        print(f"step {step}: loss {loss.item():.3f}", flush=True)
    if step % args.save_every == 0 or step == args.steps:
        checkpointer.save(step, {"loader": loader.state_dict()})
checkpointer.wait()
if rt.is_main:
    print(f"done: {args.run_dir}/checkpoints (shardwise export ... --hf: a from_pretrained folder)")
