"""Before a run: cost models, step time and memory, calibration, the planner's search."""
