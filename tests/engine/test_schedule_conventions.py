"""The reference conventions of ``schedules.<name>.convention`` against values taken from the
references themselves, at the edge updates 0, W-1, W and n-1 (n = 20 updates, W = 5).

The literals were computed once by running: DINO's ``utils.cosine_scheduler``
(facebookresearch/dino), ml-cvnets' ``optim/scheduler/cosine.py`` ``CosineScheduler`` with
``max_iterations=20`` (apple/ml-cvnets), seamseg's ``seamseg/utils/scheduler.py`` ``LambdaLR``
(the poly of ``scheduler_from_config``, ``count=20``) wrapped in ``BurnInLR`` and stepped as its
``train`` does (``global_step += 1`` then ``scheduler.step(global_step)``; mapillary/seamseg),
fairseq's ``CosineLRSchedule.step_update`` (``max_update=20``, ``t_mult=1``), and Hugging Face's
``get_cosine_schedule_with_warmup``, which is also called here.
"""

from __future__ import annotations

import pytest
import torch

from raytrain_loops.config import load_config
from raytrain_loops.config.base import ConfigError
from raytrain_loops.config.engine import Schedule
from raytrain_loops.engine import schedule_value
from raytrain_loops.recipes import resolve

N, W = 20, 5
EDGES = (0, W - 1, W, N - 1)


def _values(s: Schedule, steps: tuple[int, ...] = EDGES) -> list[float]:
    return [schedule_value(s, t, N) for t in steps]


def test_dino_cosine_scheduler():
    # cosine_scheduler(2e-3, 1e-5, epochs=4, niter_per_ep=5, warmup_epochs=1, start_warmup_value=1e-4)
    s = Schedule(kind="cosine", convention="dino", value=2e-3, end=1e-5, warmup_steps=W, warmup_start=1e-4)
    assert _values(s) == pytest.approx([1e-4, 2e-3, 2e-3, 3.174313726986334e-05], rel=1e-12)
    # cosine_scheduler(0.04, 0.4, epochs=4, niter_per_ep=5): DINO's weight decay, no warm-up
    wd = Schedule(kind="cosine", convention="dino", value=0.04, end=0.4)
    assert _values(wd, (0, N - 1)) == pytest.approx([0.04, 0.3977839013071248], rel=1e-12)
    # cosine_scheduler(2e-3, 1e-5, epochs=20, niter_per_ep=1, warmup_epochs=1, start_warmup_value=1e-4)
    one = Schedule(kind="cosine", convention="dino", value=2e-3, end=1e-5, warmup_steps=1, warmup_start=1e-4)
    assert _values(one, (0, 1)) == pytest.approx([1e-4, 2e-3], rel=1e-12)


def test_cvnets_cosine_scheduler():
    # CosineScheduler: max_iterations=20, warmup_iterations=5, warmup_init_lr=1e-4, max_lr=2e-3, min_lr=1e-5
    s = Schedule(kind="cosine", convention="cvnets", value=2e-3, end=1e-5, warmup_steps=W, warmup_start=1e-4)
    assert _values(s) == pytest.approx([1e-4, 1.62e-3, 2e-3, 8.573986515126969e-05], rel=1e-12)


def test_seamseg_poly_with_burn_in_at_the_one_based_global_step():
    # lr=4e-3, poly gamma=0.9 over count=20, BurnInLR(steps=5, start=0.025): warmup_start = 4e-3 * 0.025
    s = Schedule(kind="poly", convention="seamseg", value=4e-3, power=0.9, warmup_steps=W, warmup_start=1e-4)
    assert _values(s) == pytest.approx([8.8e-4, 4e-3, 0.003087558026894282, 0.00026985656953471286], rel=1e-12)
    # burn_in_steps=0: no BurnInLR, the poly read at the global step itself, 0 at the last update
    plain = Schedule(kind="poly", convention="seamseg", value=4e-3, power=0.9)
    assert _values(plain, (0, N - 1)) == pytest.approx([0.003819541526485999, 0.0], rel=1e-12)


def test_fairseq_cosine():
    # CosineLRSchedule: lr=2e-3, min_lr=1e-5, warmup_updates=5, warmup_init_lr=1e-4, max_update=20
    s = Schedule(kind="cosine", convention="fairseq", value=2e-3, end=1e-5, warmup_steps=W, warmup_start=1e-4)
    assert _values(s) == pytest.approx([1e-4, 1.62e-3, 2e-3, 3.174313726986334e-05], rel=1e-12)


def test_hf_cosine_schedule_with_warmup():
    # get_cosine_schedule_with_warmup(optimizer with lr=2e-3, num_warmup_steps=5, num_training_steps=20)
    s = Schedule(kind="cosine", convention="hf", value=2e-3, warmup_steps=W)
    assert _values(s) == pytest.approx([0.0, 1.6e-3, 2e-3, 2.1852399266194312e-05], rel=1e-12)
    # and every update against the installed function itself
    from transformers import get_cosine_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    sched = get_cosine_schedule_with_warmup(opt, W, N)
    reference = []
    for _ in range(N):
        reference.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert _values(s, tuple(range(N))) == pytest.approx(reference, rel=1e-12)


def test_a_convention_holds_its_last_value_past_the_run():
    for convention in ("dino", "cvnets", "hf"):
        s = Schedule(kind="cosine", convention=convention, value=2e-3, end=1e-5, warmup_steps=W)
        assert schedule_value(s, N + 7, N) == schedule_value(s, N - 1, N)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "poly", "convention": "dino"}, "dino defines kind=cosine only; got kind=poly"),
        ({"kind": "cosine", "convention": "seamseg"}, "seamseg defines kind=poly only; got kind=cosine"),
        ({"kind": "cosine", "convention": "hf", "per": "epoch"}, "needs per=step"),
    ],
)
def test_a_convention_with_the_wrong_shape_names_the_key(fields, message):
    with pytest.raises(ConfigError, match="convention") as err:
        Schedule(**fields)
    assert message in str(err.value)


def test_each_seed_recipe_schedules_as_its_seed():
    seeds = {"dino": "dino", "cvnets_cls": "cvnets", "seamseg": "seamseg", "lm": "fairseq"}
    for recipe, convention in seeds.items():
        assert load_config(resolve(recipe), []).schedules["lr"].convention == convention, recipe
    dino = load_config(resolve("dino"), []).schedules
    assert dino["weight_decay"].convention == dino["ema_momentum"].convention == "dino"
