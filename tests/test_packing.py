"""Packing variable-length documents (#14): every document once, little padding, the same
per-token loss and gradients as one padded row per document, a job that trains packed on two
ranks as on one, and the benchmark on a tiny setting."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from harness import finish, set_args, start_cli
from shardwise.bench import packing_bench as bench_packing
from shardwise.config import PACKAGE_DATA, ConfigError, load_config
from shardwise.data import datasets
from shardwise.data.datasets import PAD_TARGET, DocumentRows
from shardwise.data.skew import skew_report
from shardwise.nn.models import TinyGPT, document_mask, lm_loss

TEXT = PACKAGE_DATA / "genesis_kjv.txt"


def _splits(packing: str, seq_len: int = 256) -> datasets.Splits:
    return datasets.verses(TEXT, seq_len, test_fraction=0.1, packing=packing)


def _batch(rows: DocumentRows) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(rows[i] for i in range(len(rows))), strict=True)
    return torch.stack(xs), torch.stack(ys)


def _documents(rows: DocumentRows, bos: int) -> Counter:
    """The documents of every row, recovered from its tensors: split at BOS, pads dropped."""
    found: Counter = Counter()
    for i in range(len(rows)):
        x, y = rows[i]
        real = (y != PAD_TARGET).nonzero().flatten()
        x, y = x[: len(real)], y[: len(real)]
        assert real.tolist() == list(range(len(real)))  # padding only after the documents
        starts = [*(x == bos).nonzero().flatten().tolist(), len(x)]
        assert starts[0] == 0
        for a, b in itertools.pairwise(starts):
            found[(*x[a:b].tolist(), y[b - 1].item())] += 1  # inputs and the last target
    return found


def test_packing_keeps_every_document_once_with_little_padding():
    unpacked, packed = _splits("none"), _splits("pack")
    bos = packed.bos_token
    assert bos == packed.num_classes - 1
    docs = _documents(unpacked.train, bos)
    assert sum(docs.values()) == len(unpacked.train)  # one document per unpacked row
    assert _documents(packed.train, bos) == docs
    assert packed.train.num_real == unpacked.train.num_real
    # The bar: at most 5% padding packed. One padded row per verse (25-319
    # characters, rows of 256) is about half padding: measured 1.8% against 50.6%.
    assert packed.train.padding_fraction <= 0.05
    assert unpacked.train.padding_fraction > 0.4
    assert len(packed.train) < 0.55 * len(unpacked.train)


def test_long_verses_are_cut_into_documents_that_fit():
    splits = _splits("pack", seq_len=64)
    rows = splits.train
    assert all(len(doc) <= 65 for row in rows.rows for doc in row)  # BOS + at most 64
    assert rows.padding_fraction <= 0.05
    x, _ = rows[0]
    assert x.shape == (64,) and x[0].item() == splits.bos_token


def _loss_and_grads(model: TinyGPT, rows: DocumentRows) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    x, y = _batch(rows)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_packed_rows_give_the_unpacked_per_token_loss_and_gradients():
    splits = _splits("pack")
    several = [row for row in splits.train.rows if len(row) >= 3][:2]
    rows = several + [row for row in splits.train.rows if len(row) == 2][:2]
    packed = DocumentRows(rows, 256)
    unpacked = DocumentRows([[doc] for row in rows for doc in row], 256)
    assert (len(packed), len(unpacked)) == (4, 10)

    def compare(bos: int | None) -> tuple[float, float, float]:
        torch.manual_seed(0)
        model = TinyGPT(splits.num_classes, 256, d_model=64, n_layer=2, n_head=4, bos_token=bos)
        loss_p, grads_p = _loss_and_grads(model, packed)
        loss_u, grads_u = _loss_and_grads(model, unpacked)
        pairs = zip(grads_p, grads_u, strict=True)
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)
        return loss_p, loss_u, worst

    # float32 sums over ~2,500 tokens in another order (other row widths, other softmax
    # lengths) differ by a few ulps of 1.2e-7 each: 1e-5 is far above that (seen: 1e-7 on the
    # loss, 3e-7 on the gradients) and far below what the documents seeing each other costs.
    loss_p, loss_u, worst = compare(splits.bos_token)
    assert loss_p == pytest.approx(loss_u, rel=1e-5)
    assert worst < 1e-5
    # Without the document mask, packed documents attend to each other: the loss moves.
    loss_p, loss_u_plain, worst = compare(None)
    assert loss_u_plain == pytest.approx(loss_u, rel=1e-6)  # alone in a row: nothing to mask
    assert abs(loss_p - loss_u) > 1e-4 * loss_u
    assert worst > 1e-2


def test_positions_restart_and_attention_stays_inside_each_document():
    bos, a = 9, 1
    pos, mask = document_mask(torch.tensor([[bos, a, a, bos, a, 0]]), bos)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2]]  # the pad (0) goes on from the last document
    allowed = [row.nonzero().flatten().tolist() for row in mask[0, 0]]
    assert allowed == [[0], [0, 1], [0, 1, 2], [3], [3, 4], [3, 4, 5]]
    with pytest.raises(ValueError, match="cannot be pipelined"):
        TinyGPT(10, 8, d_model=8, n_layer=1, n_head=2, bos_token=bos).pipeline_layers()


def test_skew_counts_real_tokens_and_attention_per_document():
    rows = _splits("pack").train
    report = skew_report(rows, [list(range(len(rows)))])
    (rank,) = report["ranks"]
    assert rank["tokens"] == rows.num_real
    lengths = [len(doc) - 1 for row in rows.rows for doc in row]
    assert rank["attention_cost"] == sum(n * n for n in lengths)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.dataset=text", "data.packing=pack"], "packing 'pack' needs dataset 'verses'"),
        (["strategy.name=tp"], "data.dataset 'verses' needs a data-parallel strategy"),
    ],
)
def test_packing_config_errors_are_one_line(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        load_config("verses_gpt", overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("reader", [datasets.text, datasets.verses])
def test_a_text_file_that_is_not_utf8_or_empty_is_one_line_naming_it(tmp_path, reader):
    """(Before: "'utf-8' codec can't decode byte 0xff ...", naming no file; an empty verses
    file: "data.test_fraction 0.2 holds out no evaluation sample".)"""
    cases = [(b"ab\xffcd", "not UTF-8 text (byte 2: invalid start byte)")]
    cases += [(b"", "no text in it"), (b" \n\n", "no text in it")]
    for content, says in cases:
        path = tmp_path / "data.txt"
        path.write_bytes(content)
        with pytest.raises(ValueError) as err:
            reader(path)
        assert str(err.value) == f"{path}: {says}"


@pytest.mark.usefixtures("uncalibrated")
def test_verses_gpt_trains_packed_on_two_ranks_as_on_one(tmp_path):
    small = ["model.d_model=32", "model.n_layer=1", "model.n_head=2", "train.steps=4"]
    small += ["data.seq_len=128", "optim.warmup_steps=0"]
    small += ["launch.desync_check_every=1"]  # rows of different token counts, same calls
    small += ["train.measure=false"]  # (no prediction nor meters: not what this looks at)
    jobs = []
    for ranks, batch in ((2, 4), (1, 8)):  # the same global batches of 8 rows (both at once)
        sets = [*small, f"launch.nproc={ranks}", f"data.batch_size={batch}"]
        args = [*set_args(*sets), "--run-dir", str(tmp_path / f"run{ranks}")]
        jobs.append(start_cli("train", "verses_gpt", *args, cwd=tmp_path))
    for code, out in finish(*jobs):
        assert code == 0, out[-3000:]
    runs = {
        r: load_file(str(tmp_path / f"run{r}" / "checkpoint" / "model.safetensors")) for r in (2, 1)
    }
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    assert 0 < summary["eval_loss"] < 5  # log(61) = 4.1 at chance
    # Ranks weighed by their real tokens give the one-process update of the global batch's
    # per-token mean. Seen: 1e-6 after 4 AdamW steps (float32 sums in another order);
    # weighing ranks by rows instead (their token counts differ) moves weights by ~3e-3.
    worst = max((runs[2][k] - runs[1][k]).abs().max().item() for k in runs[1])
    assert worst < 1e-4
    # The skew report counts real tokens: packed rows of 128 are at most 5% padding.
    ranks = json.loads((tmp_path / "run2" / "data_skew.json").read_text())["ranks"]
    positions = 128 * sum(r["samples"] for r in ranks)
    assert 0.95 * positions <= sum(r["tokens"] for r in ranks) < positions


def test_packing_benchmark_reports_both_variants_on_the_same_documents(tmp_path, capsys):
    out = tmp_path / "packing.json"
    assert (
        bench_packing.main(["--rows", "1", "--steps", "1", "--reps", "1", "--out", str(out)]) == 0
    )
    line = json.loads(out.read_text())
    assert line["bench"] == "packing"
    none, packed = line["results"]["none"], line["results"]["pack"]
    assert packed["padding_fraction"] <= 0.05 < 0.4 < none["padding_fraction"]
    assert packed["rows_per_step"] == 1 < none["rows_per_step"]
    assert packed["first_loss"] == pytest.approx(none["first_loss"], rel=1e-5)
    assert packed["real_tokens_per_s"] > 0 and none["real_tokens_per_s"] > 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == line
