"""What `shardwise train` predicts before its first step, and that next to what it measured."""

from __future__ import annotations

from shardwise.plan.costs import MODEL_STATE, CostJob, trainer_comm
from shardwise.plan.predictors import predict
from shardwise.plan.steptime import predict_step, step_timed
from shardwise.strategies.section import StrategySection


def for_run(job: CostJob, strategy: StrategySection, calibration: dict | None = None) -> dict:
    """What `shardwise train` writes to RUN_DIR/prediction.json before its first step: this
    rank's predicted model state, activations, bytes per step with the trainer's own
    collective, and, given a calibration of this machine, the step time by part."""
    costs = predict(job, strategy)
    out = costs.as_dict()
    if costs.comm:
        out["comm_bytes_per_step"] = sum(costs.comm.values()) + sum(
            trainer_comm(job.world_size).values()
        )
    if calibration is not None and step_timed(strategy) and job.batch is not None:
        out["step_time_s"] = predict_step(job, strategy, calibration, costs)
    return out


def versus_measured(
    predicted: dict,
    memory: dict[str, int],
    comm_bytes_per_step: float,
    step_time_s: float | None = None,
) -> dict:
    """Predicted next to measured (model state by category, bytes per step, activations, the
    step's peak, step time), with the relative error of each, for the summary and the report."""
    rows: dict[str, dict] = {}
    if predicted.get("memory") and memory:
        for category in (*MODEL_STATE, "model_state"):
            want = (
                sum(predicted["memory"][c] for c in MODEL_STATE)
                if category == "model_state"
                else predicted["memory"][category]
            )
            got = (
                sum(memory[c] for c in MODEL_STATE)
                if category == "model_state"
                else memory[category]
            )
            rows[category] = _pair(want, got)
    if "comm_bytes_per_step" in predicted:
        rows["comm_bytes_per_step"] = _pair(predicted["comm_bytes_per_step"], comm_bytes_per_step)
    if predicted.get("activations") is not None and memory.get("activations") is not None:
        rows["activations"] = _pair(predicted["activations"], memory["activations"])
    if predicted.get("peak") is not None and memory.get("step_peak") is not None:
        rows["peak"] = _pair(predicted["peak"], memory["step_peak"])
    if "step_time_s" in predicted and step_time_s is not None:
        rows["step_time_s"] = _pair(predicted["step_time_s"]["total"], step_time_s)
    out = {"rows": rows, "notes": predicted.get("notes", [])}
    if "calibration" in predicted:  # how old the rates the step time was priced at are
        out["calibration"] = predicted["calibration"]
    return out


def _pair(predicted: float, measured: float) -> dict:
    error = (predicted - measured) / measured if measured else (0.0 if not predicted else None)
    return {"predicted": predicted, "measured": measured, "error": error}
