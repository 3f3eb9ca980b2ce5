"""Whether a user's loss is mean cross-entropy, which tensor parallel's loss from vocabulary
slices may stand in for (`tensor_parallel.vocab_parallel_loss`): anything else (label
smoothing, class weights, a scale) would be replaced without a word, so it is refused. Checked
once per loss function, by running it next to `F.cross_entropy` on a small probe."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.comm.parallel_ops import IGNORE_INDEX

# Whether each loss function is plain cross-entropy (`_loss_identity`: a lambda made anew each
# step is one function), with the objects its key names by address, kept alive with it.
_PLAIN: dict[tuple, tuple[bool, list]] = {}


def _loss_identity(loss_fn) -> tuple[tuple, list]:
    """A key that tells loss functions apart by what decides what they compute: their code
    and the objects they carry (bound instance, default arguments, closure cells' contents),
    by address; and those objects (kept alive in the cache, so no address is reused)."""
    function = getattr(loss_fn, "__func__", loss_fn)  # (a bound method: its function)
    code = getattr(function, "__code__", None)
    if code is None:  # (a module or other callable object: itself)
        return (id(loss_fn),), [loss_fn]
    carried = [getattr(loss_fn, "__self__", None), *(function.__defaults__ or ())]
    carried += list((function.__kwdefaults__ or {}).values())
    for cell in function.__closure__ or ():
        try:
            carried.append(cell.cell_contents)
        except ValueError:  # (a cell not yet filled)
            carried.append(None)
    return (code, *map(id, carried)), carried


def check_plain_cross_entropy(loss_fn, target: torch.Tensor, vocab_size: int) -> None:
    """Refuse, in one line, a loss that is not mean cross-entropy over the last dimension with
    -100 ignored: checked once per function, on logits of the whole vocabulary and targets
    drawn alike on every rank (so every rank decides alike, whatever its batch), shaped as
    one sample's (its positions cut to 4: the probe stays small)."""
    key, carried = _loss_identity(loss_fn)
    known = _PLAIN.get(key, (None,))[0]
    if known is None:
        if len(_PLAIN) > 256:  # (bounded, whatever the caller makes)
            _PLAIN.clear()
        shape = (1, *(min(n, 4) for n in target.shape[1:]))
        g = torch.Generator().manual_seed(0)
        rows = torch.randint(0, vocab_size, shape, generator=g)
        if rows.numel() > 1:  # (one position padded: a loss that does not ignore -100 fails)
            rows.view(-1)[0] = IGNORE_INDEX
        probe = torch.randn((*shape, vocab_size), generator=g)
        rows, probe = rows.to(target.device), probe.to(target.device)
        with torch.no_grad():
            theirs = loss_fn(probe, rows)
            plain = F.cross_entropy(probe.reshape(-1, vocab_size), rows.reshape(-1))
        known = bool(torch.isclose(theirs.float(), plain, rtol=1e-5, atol=1e-6))
        _PLAIN[key] = (known, carried)
    if not known:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise ValueError(
            f"loss_parallel computes mean cross-entropy from the vocabulary's slices, and the "
            f"loss given ({name}) is another (label smoothing, weights, a scale or a sum?): "
            "pass loss_parallel=False (strategy.loss_parallel: false) to compute it on the "
            "gathered logits"
        )
