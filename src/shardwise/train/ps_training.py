"""A parameter-server training job: what each role does, and the summary the supervisor writes.

Every process runs `run_role`: servers serve (server 0 also deals out batches: `train.steps`
per worker in all, over as many epochs as that takes) and leave their final shard and report in
`RUN/ps/`; workers take batches until none are left, log every step to `RUN/ps/workerR.jsonl`
and, every `eval_every` steps, the test accuracy of the parameters they hold. When every process
has ended, `summarise` (in the supervisor, no process group needed) puts the shards together into
the model's checkpoint, evaluates it, and writes `summary.json`, `staleness.json` and
`staleness.png`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import default_collate

from shardwise import api, ps
from shardwise.checkpoint.reshardable import save_model
from shardwise.comm.broken import broken_connection
from shardwise.config import Config
from shardwise.distributed import runtime
from shardwise.faults.injection import FaultInjector
from shardwise.faults.nonfinite import EXIT_NONFINITE, all_finite
from shardwise.jobs import OPTIMIZERS, Job, base_lr, build_job, schedule, straggler_delay
from shardwise.jobs import optimizer_kwargs as make_optimizer_kwargs
from shardwise.observe.run_output import MetricsFile, write_summary
from shardwise.ps import PSError
from shardwise.ps.liveness import EXIT_SERVER_LOST
from shardwise.ps.sharding import trainable
from shardwise.ps.work_queue import WorkQueue
from shardwise.train.run_dir import agree_run_dir
from shardwise.train.validator import evaluate

SUPERVISED = "SHARDWISE_PS_ATTEMPT"  # set by our supervisor (`ps_supervisor.py`) in each process


def run_role(cfg: Config, requested_run_dir: str | None) -> None:
    started = time.perf_counter()
    rt = api.init(backend="gloo", timeout_s=cfg.launch.comm_timeout_s)
    torch.set_num_threads(cfg.launch.threads_per_rank or 1)
    run_dir = agree_run_dir(cfg, requested_run_dir, rt)
    job = build_job(cfg).materialized()  # (servers and workers each hold the whole model)
    strategy = cfg.strategy.build(rt.world_size, run_dir)
    out = run_dir / "ps"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid{rt.rank}").write_text(str(os.getpid()))  # for operators (and failure tests)
    opt_cls, opt_kwargs = OPTIMIZERS[cfg.optim.name], make_optimizer_kwargs(cfg.optim)
    role = "relay" if strategy.is_relay() else "server" if strategy.is_server() else "worker"
    faults = FaultInjector(rt.rank, run_dir, cfg.faults, role=role)
    if strategy.is_relay():
        report = ps.relay(job.model, strategy, faults)
        (out / f"relay{rt.rank}.json").write_text(json.dumps(dataclasses.asdict(report)))
    elif strategy.is_server():
        work = None
        if strategy.shard_of(rt.rank) == 0:  # server 0 deals (and its backup, in lockstep)
            total = cfg.train.steps * cfg.strategy.workers
            work = WorkQueue.for_batches(
                total, len(job.splits.train), cfg.data.batch_size, cfg.train.seed
            )
        # The rate as the data-parallel jobs have it: scaled for the workers' global batch, on
        # the config's schedule (its warm-up, its decay) by training step.
        lr = base_lr(cfg.optim, cfg.data.batch_size, cfg.strategy.workers)
        steps = schedule(cfg.optim, cfg.train.steps)
        report = ps.serve(
            job.model,
            strategy,
            opt_cls,
            work=work,
            faults=faults,
            lr_schedule=steps,
            **{**opt_kwargs, "lr": lr},
        )
        fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
        fields.pop("final")  # the shard itself goes to safetensors
        (out / f"server{rt.rank}.json").write_text(json.dumps(fields))
        save_file({"flat": report.final.contiguous()}, str(out / f"server{rt.rank}.safetensors"))
    else:
        try:
            _work(cfg, job, strategy, rt, out, opt_cls, opt_kwargs, faults)
        except (PSError, RuntimeError) as e:
            _leave_upstream_gone(rt.rank, e)
    if strategy.is_server() or strategy.is_relay():
        _report_written(cfg, strategy, rt.rank, run_dir, started)
    # Roles finish at different times. Tearing down gloo groups whose peers have already gone
    # (in destroy_process_group, or in the destructors at interpreter exit) sometimes aborts
    # the process (seen here: exit code -6 after all work was done). Everything this role owes
    # is on disk, so it leaves at once; the OS closes the sockets.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_upstream_gone(rank: int, error: Exception) -> None:
    """A worker whose server refused it, or whose connection to it broke (the server ended or
    died: the supervisor and the server's own lines say why), ends in one line; anything else
    is a bug, and keeps its traceback."""
    if isinstance(error, PSError):
        text = str(error)
    elif broken := broken_connection(str(error)):
        text = f"lost its connection to its server or relay ({broken})"
    else:
        raise error
    print(f"shardwise: ps worker rank {rank}: {text}; ending", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_SERVER_LOST)


def _report_written(cfg: Config, strategy, rank: int, run_dir: Path, started: float) -> None:
    """Servers and relays count themselves done in the store. Under our
    supervisor, the supervisor writes the summary; under torchrun (several machines, say),
    server 0 does, once all have written (their files must be visible here: one machine, or a
    shared run directory)."""
    store = runtime.store()
    store.add("shardwise/ps/written", 1)
    if rank != 0:
        return
    serving = strategy.servers + strategy.relays  # (with replicas: one of each pair at least)
    deadline = time.monotonic() + max(60.0, 4 * strategy.timeout_s)
    while (written := store.add("shardwise/ps/written", 0)) < serving:
        if time.monotonic() > deadline:
            print(
                f"shardwise: {serving - written} server(s) or relay(s) did not finish "
                "in time after server 0",
                flush=True,
            )
            return
        time.sleep(0.05)
    if SUPERVISED in os.environ:
        return
    missing = [
        shard
        for shard, path in enumerate(_shard_reports(cfg, run_dir / "ps", "safetensors"))
        if not path.exists()
    ]
    if missing:
        where = run_dir / "ps"
        print(
            f"shardwise: no summary: the shards of servers {missing} are not in {where} "
            "on this machine (use a shared run directory)",
            flush=True,
        )
        return
    summarise(cfg, run_dir, time.perf_counter() - started, {})


def _work(cfg, job: Job, strategy, rt, out: Path, opt_cls, opt_kwargs, faults) -> None:
    index = rt.rank - strategy.serving_servers - strategy.relays
    model, opt = api.prepare(job.model, strategy, optimizer=opt_cls, **opt_kwargs)
    metrics = MetricsFile(out / f"worker{rt.rank}.jsonl")
    start, step, bad = time.perf_counter(), 0, BadSteps(cfg.train, f"ps worker rank {rt.rank}")
    while (indices := model.client.next_batch()) is not None:
        faults.before_step(step + 1)  # (kill, or hang with the heartbeats going on)
        x, y = job.inputs_targets(default_collate([job.splits.train[i] for i in indices]))
        t0 = time.perf_counter()
        if delay := straggler_delay(cfg.train, index, cfg.strategy.workers, step):
            time.sleep(delay)  # a straggler: it computes slowly
        loss_fn = job.loss_fn
        if faults.poisons_loss(step + 1):  # an injected fault: this step's loss is NaN
            loss_fn = _poisoned(job.loss_fn)
        # train.accumulate: K micro-batches' gradients summed, then one push (at opt.step)
        loss = api.train_step(model, x, y, loss_fn, accumulate=cfg.train.accumulate)
        faults.observe_work(len(indices), time.perf_counter() - t0)
        faults.slow_ahead(len(indices), step=step + 1)
        step += 1
        what = _nonfinite(loss, model)
        if what is None:
            bad.good()
            opt.step()
        else:  # nothing of it reaches the servers (they would refuse it anyway)
            model.skip_step()
            bad.bad(step, what, indices)  # (ends the process under `stop`, or a long streak)
        opt.zero_grad()
        record = {
            "step": step,
            "t": time.perf_counter() - start,
            "loss": loss.item(),
            "samples": len(indices),
            "step_time_s": time.perf_counter() - t0,
            "wait_s": model.last_wait_s,
            "version": model.client.version,
            **({"skipped": True} if what else {}),
        }
        if cfg.train.eval_every and step % cfg.train.eval_every == 0:
            batch = cfg.train.eval_batch_size
            scored = evaluate(model, job.splits.test, job.loss_fn, batch, False, job.inputs_targets)
            if scored.accuracy is not None:
                record["eval_accuracy"] = scored.accuracy
        metrics.write(record)
    metrics.close()
    strategy.close(model)


def _poisoned(loss_fn):
    return lambda output, target: loss_fn(output, target) * float("nan")


def _nonfinite(loss: torch.Tensor, model) -> str | None:
    """'loss' or 'gradient' where this worker's step is not finite, else None."""
    if not math.isfinite(loss.item()):
        return "loss"
    grads = [p.grad for p in model.client.params if p.grad is not None]
    return None if not grads or bool(all_finite(grads)) else "gradient"


class BadSteps:
    """`train.nonfinite` on a parameter-server worker: a non-finite step is skipped (nothing
    pushed); under `stop`, or after `max_bad_steps` in a row, the worker ends (exit code
    EXIT_NONFINITE) and the supervisor stops the job. (`rollback` is refused for these jobs
    before they start: the servers hold the state a rollback would restore.)"""

    def __init__(self, train, who: str) -> None:
        self.policy, self.limit, self.who, self.streak = (
            train.nonfinite,
            train.max_bad_steps,
            who,
            0,
        )

    def good(self) -> None:
        self.streak = 0

    def bad(self, step: int, what: str, indices: list[int]) -> None:
        self.streak += 1
        report = f"shardwise: {self.who}: step {step}: non-finite {what} (samples {indices[:4]}...)"
        if self.policy == "stop" or self.streak >= self.limit:
            print(f"{report}; {self.streak} bad step(s) in a row: stopping", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_NONFINITE)
        print(f"{report}: update skipped", flush=True)


def summarise(cfg: Config, run_dir: Path, wall_s: float, failures: dict[int, int]) -> dict:
    """Put the servers' shards together into the model, evaluate it, write the summary."""
    out = run_dir / "ps"
    servers = [json.loads(path.read_text()) for path in _shard_reports(cfg, out, "json")]
    job = _assembled(cfg, out)
    eval_loss, accuracy, _ = evaluate(
        *(job.model, job.splits.test, job.loss_fn, cfg.train.eval_batch_size),
        everyone=False,
        inputs_targets=job.inputs_targets,
    )
    save_model(run_dir / "checkpoint", job.model.state_dict(), {"name": cfg.name, "ps": True})
    workers = {}
    for path in sorted(out.glob("worker*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        workers[path.stem] = rows
    samples = sum(r["samples"] for rows in workers.values() for r in rows)
    train_time = max((rows[-1]["t"] for rows in workers.values() if rows), default=wall_s)
    staleness = [s for report in servers for s in report["staleness"]]
    counts = collections.Counter(staleness)
    histogram = {str(k): counts[k] for k in sorted(counts)}
    (run_dir / "staleness.json").write_text(json.dumps(histogram))
    _plot_staleness(histogram, run_dir / "staleness.png", cfg.strategy.mode)
    relays = [json.loads(p.read_text()) for p in sorted(out.glob("relay*.json"))]
    dead = {int(w): s for report in servers + relays for w, s in report["dead_workers"].items()}
    dead = {
        w: s for w, s in dead.items() if w >= cfg.strategy.ranks_needed() - cfg.strategy.workers
    }
    summary = {
        "name": cfg.name,
        "strategy": cfg.strategy.describe(),
        "updates": servers[0]["updates"],
        "pushes_into_servers": sum(report["pushes_received"] for report in servers),
        "samples": samples,
        "samples_per_s": samples / train_time if train_time else 0.0,
        "eval_loss": eval_loss,
        **({} if accuracy is None else {"eval_accuracy": accuracy}),
        "staleness_histogram": histogram,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "dead_workers": dead,
        # (with backup workers, trained samples may exceed the consumed ones: a late update's
        # batch is trained again by another worker)
        "consumed_samples": servers[0]["consumed_samples"],
        "consumed_samples_per_s": servers[0]["consumed_samples"] / train_time
        if train_time
        else 0.0,
        "late_pushes": {int(w): n for w, n in servers[0]["late"].items()},
        "failed_processes": failures,
        "resumed_from": servers[0]["resumed_from"],
        "worker_steps": {k: len(v) for k, v in workers.items()},
        "wall_time_s": wall_s,
        "run_dir": str(run_dir),
    }
    write_summary(run_dir, summary)
    return summary


def _shard_reports(cfg: Config, out: Path, suffix: str) -> list[Path]:
    """Each shard's file from the server that finished serving it: its primary, or (replicas:
    2) the backup that took over from it."""
    s = cfg.strategy
    paths = []
    for shard in range(s.servers):
        ranks = [shard + k * s.servers for k in range(s.replicas)]
        done = [
            out / f"server{r}.{suffix}" for r in ranks if (out / f"server{r}.{suffix}").exists()
        ]
        paths.append(done[0] if done else out / f"server{shard}.{suffix}")
    return paths


def _assembled(cfg: Config, out: Path) -> Job:
    """The job, its model's trainable parameters the servers' shards put together."""
    shards = [load_file(str(path)) for path in _shard_reports(cfg, out, "safetensors")]
    flat = torch.cat([shard["flat"] for shard in shards])
    job = build_job(cfg).materialized()
    with torch.no_grad():
        params = trainable(job.model)
        for p, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(value.view_as(p))
    return job


def _plot_staleness(histogram: dict[str, int], path: Path, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([int(k) for k in histogram], list(histogram.values()))
    ax.set_xlabel("staleness of an applied update (server versions)")
    ax.set_ylabel("updates")
    ax.set_title(f"parameter server, {mode}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
