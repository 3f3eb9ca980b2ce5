"""Before a run: cost models, step time and memory, calibration, the planner's search.

costs, work, rates, peaks   what every strategy's cost model shares: the job priced
                            (`CostJob`), its answer (`Costs`), traced compute, seconds at
                            the calibrated rates, the step's peak
cost_models/                one module per strategy: its bytes, memory and step-time work
predictors                  the registry: a strategy's YAML name to its cost model
steptime, prediction        a step's predicted seconds; what `shardwise train` predicts
calibrate, measure          `shardwise calibrate`: this machine's rates, stored and checked
command                     `shardwise plan`: model_states (--params), search (a
                            transformer on a cluster), config_plan (a config here)
"""
