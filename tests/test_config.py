"""Config loading: built-ins validate, overrides apply, bad input is one clear line."""

import pytest

from shardwise.config import ConfigError, load_config, ranks_needed
from shardwise.jobs import straggler_delay


@pytest.mark.parametrize("name", ["digits", "tiny_gpt", "cnn_bn", "verses_gpt"])
def test_builtin_configs_validate(name):
    cfg = load_config(name)
    assert cfg.name == name


def test_overrides_are_parsed_as_yaml_scalars():
    cfg = load_config("digits", ["optim.lr=1e-2", "model.hidden=[8, 4]", "strategy.algorithm=ring"])
    assert cfg.optim.lr == 0.01
    assert cfg.model.hidden == [8, 4]
    assert cfg.strategy.algorithm == "ring"


def test_augmentation_that_does_not_fit_is_one_line():
    for sets, words in [
        (["data.dataset=text", "data.path=genesis_kjv.txt", "data.augment=shift"], "digits"),
        (["data.augment=rotate"], "'shift' or module:function"),
        (["data.augment_repeats=2"], "needs data.augment"),
        (["data.augment=shift", "data.augment_repeats=2", "data.rank_weights=[1, 2]"], "equal"),
    ]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("digits", sets)
        assert "\n" not in str(err.value)
    cfg = load_config("digits", ["data.augment=shift", "data.augment_repeats=2"])
    assert (cfg.data.augment, cfg.data.augment_repeats) == ("shift", 2)


def test_distillation_where_it_cannot_work_is_one_line():
    teacher = "distill.teacher=torch.nn:Identity"  # (a function that imports: checked)
    for sets, words in [
        (["distill.teacher=teachers:big"], "no module named 'teachers' in the working directory"),
        (["data.augment=noisy:flip"], "data.augment: noisy:flip: no module named 'noisy'"),
        (["strategy.name=ps", "strategy.timeout_s=0.5"], "timeout_s 0.5 must exceed heartbeat"),
        (["train.delay_s=[0.1, -1]"], "train.delay_s.1 = -1: Input should be greater than or"),
        ([teacher, "strategy.name=tp"], "needs a data-parallel strategy"),
        ([teacher, "data.dataset=verses", "data.path=genesis_kjv.txt"], "per-token"),
        ([teacher, "distill.alpha=2"], "less than or equal to 1"),
    ]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("digits", sets)
        assert "\n" not in str(err.value)
    assert load_config("digits", [teacher]).distill.temperature == 2.0


def test_pruning_where_it_cannot_rank_every_weight_is_one_line():
    for sets, words in [
        (["prune.sparsity=0.5", "strategy.name=pp"], "prune ranks every weight"),
        (["prune.sparsity=0.5", "prune.start=9", "prune.end=3"], "before prune.start"),
        (["prune.sparsity=1"], "less than 1"),
    ]:
        with pytest.raises(ConfigError, match=words) as err:
            load_config("digits", sets)
        assert "\n" not in str(err.value)


def test_layerwise_optimizers_are_refused_on_a_parameter_server():
    with pytest.raises(ConfigError, match="needs each parameter's norm") as err:
        load_config("digits", ["strategy.name=ps", "optim.name=lars"])
    assert "\n" not in str(err.value)
    assert load_config("digits", ["strategy.name=zero", "optim.name=lamb"]).optim.name == "lamb"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("strategy.bucket_mb=-1", "config error: strategy.bucket_mb = -1: Input should be greater"),
        ("strategy.algorithm=tree", "'shared_memory', 'ring'"),
        ("train.stepz=3", "config error: train.stepz = 3: Extra inputs are not permitted"),
        ("optim.name=lion", "config error: optim.name = 'lion': Input should be 'adamw'"),
        ("data.path=missing.txt", "config error: data.path: dataset file not found: missing.txt"),
        ("model.n_head=3", "n_head (3) must divide d_model (256)"),
        ("launch.nproc=0", "config error: launch.nproc = 0: Input should be greater than or equal"),
        ("nokey", "--set expects key=value"),
        ("train.trace_steps=[9, 3]", "trace_steps: should be [first, last] with 1 <= first"),
        ("optim.gamma=0", "config error: optim.gamma = 0: Input should be greater than 0"),
        ("optim.schedule=linear", "config error: optim.schedule = 'linear': Input should be"),
        ("faults=['clock-skew:rank=1']", "expected clock-skew:rank=...:seconds=..."),
        ("faults=['kill:rank=1:step=0']", "step must be >= 1 and rank >= 0 in 'kill:rank=1"),
        ("faults=['slow:rank=1:factor=nan']", "factor must be >= 1 and finite in 'slow:rank"),
        ("faults=['slow:rank=1:factor=inf']", "factor must be >= 1 and finite in 'slow:rank"),
        ("faults=['clock-skew:rank=0:seconds=nan']", "seconds must be finite in 'clock-skew"),
        # no field means "never" by infinity: .inf overflowed the timeout's timedelta
        ("launch.comm_timeout_s=.inf", "launch.comm_timeout_s = inf: Input should be a finite"),
        ("optim.lr=.nan", "config error: optim.lr = nan: Input should be a finite number"),
        ("train.delay_s=[0.1, .inf]", "config error: train.delay_s.1 = inf: Input should be a"),
        ("name=../x", "config error: name: should be a plain name (no '/', not starting with '.')"),
        ("name=.hidden", "config error: name: should be a plain name"),
        ("train.steps=[1", "config error: --set train.steps: '[1' is not a YAML value (expected"),
        ("optim.lr=a: b: c", "config error: --set optim.lr: 'a: b: c' is not a YAML value"),
        ("model.channels=[0, 4]", "config error: model.channels.0 = 0: Input should be greater"),
        (
            "prune.pattern=2:4",
            "prune.pattern: YAML read an unquoted 2:4 as the number 124: quote it",
        ),
        ("data.dataset=digits", "data.path is read by dataset 'text' or 'verses' only"),
        # (before: each accepted, the boolean as the number 1, the seed failing in every rank
        # as "Overflow when unpacking long long", the codec failing there too)
        ("train.steps=true", "config error: train: steps takes numbers, not booleans: got True"),
        ("train.clip_grad_norm=false", "train: clip_grad_norm takes numbers, not booleans"),
        ("strategy.bucket_mb=true", "strategy.ddp: bucket_mb takes numbers, not booleans"),
        ("train.skip_batches=[3, true]", "skip_batches takes numbers, not booleans: got [3, True]"),
        ("data.stages=[{at: 5, seed: -1}]", "data.stages.0.seed = -1: Input should be greater"),
        ("train.seed=99999999999999999999999", "train.seed = 99999999999999999999999: Input"),
        ("train.seed=-1", "train.seed = -1: Input should be greater than or equal to 0"),
        ("train.skip_batches=[0]", "train.skip_batches: global batches count from 1"),
        ("strategy.compression=powersgd:0", "strategy.compression: PowerSGD rank must be >= 1"),
        (
            "data.stages=[{at: 5}, {at: 9, tokens: genesis_kjv.txt, path: genesis_kjv.txt}]",
            "data.stages[1]: data.path is read by dataset 'text' or 'verses' only, and this "
            "data is 'tokens'",
        ),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_gpt", [override])
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_unknown_config_lists_the_builtins(tmp_path):
    with pytest.raises(ConfigError, match="cnn_bn, digits, tiny_gpt"):
        load_config(str(tmp_path / "nope.yaml"))


def test_yaml_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(bad))
    assert "not valid YAML" in str(err.value) and "\n" not in str(err.value)
    twice = tmp_path / "twice.yaml"  # (the second `train:` would replace the first in silence)
    twice.write_text("train: {steps: 5}\noptim: {lr: 0.1}\ntrain: {seed: 3}\n")
    with pytest.raises(ConfigError, match=r"twice.yaml is not valid YAML: key 'train' given "):
        load_config(str(twice))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.yaml is not UTF-8 text \(invalid"):
        load_config(str(latin))
    empty = tmp_path / "empty.yaml"  # (before: the default job, in silence)
    for text in ("", "# all commented out\n"):
        empty.write_text(text)
        with pytest.raises(ConfigError, match=r"empty.yaml holds no config \(give its sections"):
            load_config(str(empty))
    empty.write_text("{}\n")
    assert load_config(str(empty)).strategy.name == "ddp"  # (said so: the defaults)


def test_a_strategy_named_on_the_command_line_keeps_the_options_given_beside_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("strategy: {name: zero, stage: 3, bucket_mb: 4}\n")
    for sets in (
        ["strategy.stage=2", "strategy.name=zero"],
        ["strategy.name=zero", "strategy.stage=2"],
    ):
        assert load_config("digits", sets).strategy.stage == 2
        assert load_config(str(job), sets).strategy.bucket_mb == 4  # (the same strategy: kept)
    # Another strategy: the file's options were the old one's (ZeRO's stage is no DDP option).
    assert load_config(str(job), ["strategy.name=ddp"]).strategy.name == "ddp"


def test_ps_relays_are_checked_before_launch():
    cfg = load_config("digits", ["strategy.name=ps", "strategy.relays=2", "strategy.workers=4"])
    assert ranks_needed(cfg.strategy) == 1 + 2 + 4
    for sets, expected in [
        (["strategy.mode=ssp"], "ps relays work with mode sync or async, not ssp"),
        (["strategy.workers=1"], "2 relays need at least as many workers"),
    ]:
        with pytest.raises(ConfigError, match=expected):
            load_config("digits", ["strategy.name=ps", "strategy.relays=2", *sets])


def test_straggler_delays_stay_or_rotate():
    fixed = load_config("digits", ["train.delay_s=[0.1]"]).train
    assert [straggler_delay(fixed, i, 3, step=5) for i in range(3)] == [0.1, 0.0, 0.0]
    rotating = load_config("digits", ["train.delay_s=[0.1]", "train.delay_rotate=true"]).train
    table = [[straggler_delay(rotating, i, 3, step) for i in range(3)] for step in range(3)]
    assert table == [[0.1, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 0.1]]  # one slow rank a step


def test_config_command_lists_every_field_with_default_and_description(capsys):
    from shardwise.cli import main

    assert main(["config", "zero"]) == 0
    out = capsys.readouterr().out
    for field, default in [("stage", "1"), ("offload_dir", "None"), ("bucket_mb", "25.0")]:
        line = next(row for row in out.splitlines() if f" {field} " in row)
        assert f" {default} " in line and "│" in line
    assert "Literal[1, 2, 3]" in out  # the allowed values, not only the type
    assert main(["config"]) == 0
    listed = capsys.readouterr().out
    assert "zero" in listed
    # Every section it lists is described; the optional ones (none unless given) too, their
    # fields that must be given marked so (before, these three crashed with a traceback).
    sections = listed.splitlines()[0].removeprefix("sections: ").split(", ")
    assert {"distill", "prune", "start"} <= set(sections)
    for section in sections:
        assert main(["config", section]) == 0, section
        described = capsys.readouterr().out
        assert "PydanticUndefined" not in described, section
    assert main(["config", "start"]) == 0
    described = capsys.readouterr().out
    line = next(row for row in described.splitlines() if " checkpoint " in row)
    assert " (required) " in line and "start (optional: none unless given)" in described
    assert main(["config", "nope"]) == 2
    assert "no section or strategy named 'nope'" in capsys.readouterr().err


def test_a_parameter_server_job_refuses_rollback_in_one_line():
    with pytest.raises(ConfigError) as err:
        load_config("digits", ["strategy.name=ps", "train.nonfinite=rollback"])
    assert "'rollback' is for data-parallel runs" in str(err.value) and "\n" not in str(err.value)


def test_a_test_fraction_that_holds_out_nothing_is_one_line():
    from shardwise.jobs import build_splits

    with pytest.raises(ValueError, match=r"data\.test_fraction 0\.0001 holds out no evaluation"):
        build_splits(load_config("digits", ["data.test_fraction=0.0001"]))
    assert len(build_splits(load_config("digits", ["data.test_fraction=0.001"])).test) == 1


@pytest.mark.parametrize(
    ("config", "sets", "expected"),
    [
        ("digits", ["model.name=gpt"], "model 'gpt' needs data.dataset 'text' or 'verses'"),
        ("tiny_gpt", ["model.name=cnn"], "model 'cnn' needs data.dataset 'digits'"),
        (
            "tiny_gpt",
            ["data.stages=[{at: 50, seq_len: 512}]"],
            "data.stages[0].seq_len 512: longer than model 'gpt' reads (its positions are "
            "data.seq_len's 128)",
        ),
    ],
)
def test_a_built_in_model_that_cannot_read_the_data_is_refused_before_launch(
    config, sets, expected
):
    # (before: refused by each rank as it built the model, or, for a stage, when the run
    # reached it, after training up to there)
    with pytest.raises(ConfigError) as err:
        load_config(config, sets)
    assert expected in str(err.value) and "\n" not in str(err.value)
    load_config("tiny_gpt", ["data.stages=[{at: 50, seq_len: 128}]"])  # (as long: fine)


def test_micro_batches_that_do_not_divide_the_batch_are_refused_before_launch():
    # (before: accepted; the first stage refused the batch at step 1, and the last one, its
    # targets cut into fewer chunks, waited for a micro-batch that never came)
    for sets in (["strategy.name=pp", "strategy.microbatches=3"], ["strategy.name=mesh",
                 "strategy.pp=2", "strategy.microbatches=5"]):  # fmt: skip
        with pytest.raises(ConfigError, match=r"does not divide data\.batch_size 32"):
            load_config("digits", sets)
    load_config("digits", ["strategy.name=pp", "strategy.microbatches=8"])


def test_a_boolean_is_no_choice_of_numbers():
    """`stage: true` was stage 1 (pydantic reads a boolean as the number)."""
    with pytest.raises(ConfigError, match=r"strategy.zero: stage takes numbers, not booleans"):
        load_config("digits", ["strategy.name=zero", "strategy.stage=true"])
    on = load_config("digits", ["strategy.activation_checkpointing=true"])  # (a boolean's field)
    assert on.strategy.activation_checkpointing is True
